"""Every stage 2 option, typed and validated; saved with every checkpoint and the final model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.alignment import DEFAULT_AGGREGATION
from pipeline.cache.settings import CacheSettings
from pipeline.choices import (
    AdamwKernel,
    Aggregation,
    AlmMode,
    Attention,
    ChunkStudentAggregate,
    CompileLayers,
    ComputeDtype,
    FsdpParamDtype,
    LossKernel,
    LossNormalization,
    Packing,
    SelectionScope,
    TeacherCombination,
    UnmappedStrategy,
)
from pipeline.config import options_of, parse_config, to_dict
from pipeline.distillation import Distillation
from pipeline.distillation.teachers import mixture
from pipeline.errors import ConfigError
from pipeline.guidance import DEFAULT_GUIDANCE, GuidanceSettings
from pipeline.guidance_modes import MODES, GuidanceMode
from pipeline.io import fingerprint
from pipeline.storage import as_location, is_uri
from pipeline.teacher_options import source_teachers

SECTION = "stage2"
DESCRIPTION = (
    "Stage 2 of vocagno: stream a teacher-loss cache, align every student token to the cached "
    "teacher tokens by character offsets, and train the student with the teacher-guided "
    "selective loss (no teacher in memory). Run as `torchrun --nproc-per-node N "
    "stage2_train/train.py ...` or as a single process with `python stage2_train/train.py ...`."
)
# Options that may differ between a run and its resumption: they change when or where the run
# stops or saves, never what it computes.
# (Data-loader workers only deal out the data consumers: they never change the stream; the
# shard cache's place, size and read-ahead never change what is read.)
RESUMABLE_CHANGES = frozenset(
    {
        "out",
        "stop_at_step",
        "save_every",
        "save_at_end",
        "resume",
        "record_documents",
        "num_workers",
        "shard_cache",
        "shard_cache_gib",
        "read_ahead",
        # what these resolved to on the device is checked instead (stage2_train.checkpoint)
        "attention",
        "adamw_kernel",
        "compile",
        "loss_kernel",
        "fsdp_param_dtype",
    }
)


# Each option is listed under the component that reads it: --help's groups, [stage2.<group>] tables.
DATA, GUIDANCE, MODEL, OPTIMIZER, KERNELS, CHECKPOINTING, LOGGING = (
    options_of(group)
    for group in ("data", "guidance", "model", "optimizer", "kernels", "checkpointing", "logging")
)


@dataclass
class TrainConfig:
    cache: str = DATA(
        help="stage 1 cache folder (with manifest.json): a local path or a URI (s3://bucket/prefix, "
        "gs://…; credentials and endpoint from the environment)"
    )
    student: str = MODEL(
        help="the student: a hub id, a local Hugging Face folder (with weights, or only a "
        "config.json to train from scratch), a config.json file, or a preset "
        "(llama-tiny, llama-small, tinyllama-1.1b) for training from scratch"
    )
    out: Path = CHECKPOINTING(help="output folder: checkpoints, metrics.jsonl, TensorBoard, final model")
    max_steps: int = OPTIMIZER(help="optimizer steps in the schedule (the cosine decays over these)")
    more_caches: list[str] = DATA([], help="other teachers' caches of the same corpus (stage 1 "
        "with the same --corpus and --docs-per-shard), read in step: their teacher losses combine "
        "by --combine-teachers, a distillation's terms by --teacher-weights "
        "(docs/several-teachers.md)")  # fmt: skip
    student_tokenizer: str | None = MODEL(
        None,
        help="student tokenizer spec (shipped name, tokenizer.json, folder, hub id); default: "
        "the student's own (required for a config or preset student)",
    )
    guidance: GuidanceMode = GUIDANCE(
        DEFAULT_GUIDANCE.mode,
        help="the selection (or distillation term) beside the cross-entropy, one of "
        + ", ".join(MODES)
        + " (token: the paper's method); docs/guidance.md says what each is and where the paper "
        "defines it",
    )
    uld_lambda: float = GUIDANCE(
        0.5,
        help="--guidance uld: weight of the Wasserstein term beside the cross-entropy (paper "
        "appendix B, eq. 6: lambda = 0.5 of 0.3, 0.5, 1.0, 1.5)",
    )
    combine_teachers: TeacherCombination = GUIDANCE("min", help="--more-caches: a student "
        "token's teacher loss is the smallest of the teachers' (min) or their mean, over the "
        "teachers that map it, or its document's source's teacher (source; the paper has one "
        "teacher)")  # fmt: skip
    source_teachers: list[str] = GUIDANCE([], help="--combine-teachers source: SOURCE=CACHE "
        "for each source of the corpus (its manifest's names), CACHE being --cache or one of "
        "--more-caches")  # fmt: skip
    teacher_weights: list[float] = GUIDANCE([], help="--more-caches under a distillation mode: "
        "one positive weight per cache (--cache first), normalized to sum to 1, for the "
        "weighted sum of the teachers' terms (default: equal)")  # fmt: skip
    num_chunks: int = GUIDANCE(32, help="equal chunks per document for --guidance chunk and "
        "random-chunk (paper Table 2: 8, 16, 32, 64)")  # fmt: skip
    chunk_student_aggregate: ChunkStudentAggregate = GUIDANCE(
        DEFAULT_GUIDANCE.chunk_student_aggregate,
        help="how a chunk's student token losses combine into the chunk's student loss for "
        "--guidance chunk (the paper does not say; its teacher side uses --aggregate)",
    )
    loss_normalization: LossNormalization = GUIDANCE(
        DEFAULT_GUIDANCE.normalization,
        help="all: the kept tokens' summed loss over all N target tokens of the step (paper "
        "eq. 3); kept: over the kept tokens only (not the paper's: ~2.4x larger gradients at "
        "top-k 40%%; not for chunk modes)",
    )
    topk: float = GUIDANCE(
        DEFAULT_GUIDANCE.topk, help="fraction of candidate tokens kept (ceil(topk * n))"
    )
    unmapped: UnmappedStrategy = GUIDANCE(DEFAULT_GUIDANCE.unmapped, help="student tokens with "
        "no teacher loss: include (always kept), exclude (never kept), mean (get the mean teacher "
        "loss and compete in the top-k)")  # fmt: skip
    aggregate: Aggregation = GUIDANCE(DEFAULT_AGGREGATION, help="how the losses of the teacher "
        "tokens covering one student token combine")  # fmt: skip
    selection_scope: SelectionScope = GUIDANCE(DEFAULT_GUIDANCE.scope, help="rank tokens per "
        "micro-batch on each rank, or across all ranks' micro-batches at once (one threshold, "
        "all_gather)")  # fmt: skip
    alm_weight: float = GUIDANCE(1.0, help="--guidance alm: the ALM term's weight beside the "
        "cross-entropy (tokenkit's large-to-small example sums sft and alm_unconstrained with "
        "equal weights)")  # fmt: skip
    alm_temperature: float = GUIDANCE(100.0, help="--guidance alm: binary_ce's binarization "
        "temperature (tokenkit: 100)")  # fmt: skip
    alm_merge_threshold: float = GUIDANCE(0.1, help="--guidance alm: merge a chunk into the "
        "next while the teacher's space probability after it is at most this (tokenkit's "
        "tokenizer_pair_bias_threshold: 0.1)")  # fmt: skip
    alm_mode: AlmMode = GUIDANCE(
        "merge_by_space_prob+append_space",
        help="--guidance alm: tokenkit's alm_mode (the default is its default); naive: chunk "
        "log-probabilities only, no merging or space term, and no --space-logprob column needed",
    )
    seq_len: int = DATA(2048, help="tokens per training sequence (documents are packed)")
    completion_only: bool = DATA(True, help="a cache with target spans (stage 1's --targets): "
        "train on their tokens alone; --no-completion-only: on every token")  # fmt: skip
    packing: Packing = DATA(
        "documents",
        help="documents: whole documents packed best-fit, attention masked at document "
        "boundaries, positions restarting per document (as stage 1 scored them); stream: "
        "documents concatenated and cut into windows, no mask (see docs/packing.md)",
    )
    loss_kernel: LossKernel = KERNELS(
        "auto",
        help="chunked: the per-token loss from the last hidden states and the head's weight in "
        "row chunks, never the whole micro-batch's logits (Llama, Mistral, Qwen2/3 students, "
        "with or without --fsdp); plain: the model's logits, then the loss; "
        "auto: chunked on a GPU where it applies (docs/gpu-path.md)",
    )
    compile: CompileLayers = KERNELS(
        "auto",
        help="layers: torch.compile each decoder layer of the student (norms, RoPE, MLP fused; "
        "tens of seconds of compiling at the first step); off: eager; auto: layers on a GPU, "
        "off on a CPU (docs/gpu-path.md)",
    )
    attention: Attention = KERNELS(
        "auto",
        help="how attention takes --packing documents' mask: flex: PyTorch flex_attention with "
        "a block mask (no T x T mask; trains on a GPU only); dense: a [B, 1, T, T] boolean mask "
        "through SDPA; auto: flex on a GPU, dense on a CPU (see docs/packing.md)",
    )
    packing_context: float = DATA(0.5, help="--packing documents: the continuation of a "
        "document longer than a window re-reads this fraction of a window before it as context, "
        "without loss")  # fmt: skip
    stop_at_step: int | None = CHECKPOINTING(None, help="stop cleanly after this step with a "
        "checkpoint, as a cluster time limit would; --resume auto continues the same "
        "schedule")  # fmt: skip
    save_every: int = CHECKPOINTING(500, help="save a checkpoint every N steps")
    save_at_end: bool = CHECKPOINTING(True, help="save a checkpoint and final/ at the run's last "
        "step; --no-save-at-end: only what --save-every asks for (a benchmark's runs)")  # fmt: skip
    resume: str = CHECKPOINTING(
        "auto",
        help="auto: continue from the newest complete checkpoint in OUT if any; never: start "
        "fresh (refused if OUT already has checkpoints); or a path to a step-N folder",
    )
    seed: int = OPTIMIZER(0, help="seed for model init, data order, and random selection")
    global_batch_tokens: int = OPTIMIZER(
        2**21, help="tokens per optimizer step over all ranks (gradient accumulation fills it)"
    )
    micro_batch_size: int = OPTIMIZER(4, help="sequences per forward pass on each rank")
    lr: float = OPTIMIZER(8e-5, help="peak learning rate (after warmup)")
    min_lr: float = OPTIMIZER(8e-6, help="learning rate at the end of the cosine decay")
    warmup_steps: int = OPTIMIZER(100, help="linear warmup steps from 0 to --lr")
    weight_decay: float = OPTIMIZER(0.1, help="AdamW weight decay (not applied to norms and biases)")
    adam_beta1: float = OPTIMIZER(0.9, help="AdamW beta1")
    adam_beta2: float = OPTIMIZER(0.95, help="AdamW beta2")
    adamw_kernel: AdamwKernel = KERNELS(
        "auto",
        help="torch's AdamW implementation: fused (one kernel updates every parameter), plain "
        "(torch's default: foreach on a GPU, a loop over parameters on a CPU), auto: fused on "
        "a GPU, plain on a CPU; the same update up to float rounding (docs/gpu-path.md)",
    )
    grad_clip: float = OPTIMIZER(1.0, help="clip the global gradient norm to this (0: no clipping)")
    num_workers: int = DATA(
        2,
        help="data-loader worker processes per rank (0: in the main process); fewer are started "
        "where they would not split the rank's data consumers evenly",
    )
    data_consumers: int = DATA(
        16,
        help="the data stream's consumers: the cache is split into this many independent streams, "
        "dealt to the ranks, so a checkpoint resumes on any world size that divides it (16: 1, "
        "2, 4, 8 or 16 ranks); each step's documents depend on it and the global batch only",
    )
    fsdp: bool = MODEL(False, help="shard the student with FSDP (students too big for a device)")
    dtype: ComputeDtype = MODEL(
        "auto",
        help="compute dtype: bfloat16 autocast needs a GPU; auto is bfloat16 on GPU, float32 "
        "on CPU (weights and optimizer state stay float32)",
    )
    fsdp_param_dtype: FsdpParamDtype = MODEL(
        "auto",
        help="--fsdp: the dtype FSDP2 gathers the parameters in and the forward and backward "
        "passes run in (MixedPrecisionPolicy); gradients are reduced in float32 and the "
        "optimizer keeps float32 weights either way; auto: bfloat16 where the compute dtype is "
        "bfloat16 (a GPU), float32 elsewhere (docs/gpu-path.md)",
    )
    shard_cache: str = DATA(
        "",
        help="--cache in object storage: local folder for the verified copies of shards being "
        "read (default: the system's temporary folder)",
    )
    shard_cache_gib: float = DATA(8.0, help="--cache in object storage: GiB of shard copies a "
        "rank keeps at most")  # fmt: skip
    read_ahead: int = DATA(2, help="--cache in object storage: shards fetched ahead of the one "
        "being read")  # fmt: skip
    record_documents: bool = LOGGING(False, help="write OUT/documents/rank-R.jsonl: the "
        "documents each step began training on")  # fmt: skip

    def __post_init__(self) -> None:
        # Path folds `s3://b/x` into a local folder `s3:/b/x`: refuse what was a URI.
        if is_uri(uri := str(self.out).replace(":/", "://", 1)):
            raise ValueError(
                f"--out {uri}: stage 2 writes to a local or mounted folder, not a URI; "
                "copy the run to object storage after it finishes"
            )
        self.cache, self.out = as_location(self.cache), Path(self.out)
        self.more_caches = [as_location(cache) for cache in self.more_caches]
        source_teachers(self.cache, self.more_caches, self.combine_teachers, self.source_teachers)
        caches = 1 + len(self.more_caches)
        if self.teacher_weights and (
            MODES[self.guidance].distillation is None or caches == 1
            or len(self.teacher_weights) != caches or min(self.teacher_weights) <= 0
        ):  # fmt: skip
            raise ValueError(
                f"--teacher-weights {self.teacher_weights}: a distillation mode with --more-caches "
                f"takes one positive weight per cache ({caches} here; selection modes take "
                "--combine-teachers)"
            )
        positive = ("max_steps", "num_chunks", "seq_len", "save_every", "global_batch_tokens",
                    "micro_batch_size", "data_consumers")  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be at least 1, not {getattr(self, name)}"
                )
        for name in ("warmup_steps", "num_workers", "weight_decay", "grad_clip", "read_ahead",
                     "uld_lambda"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must not be negative")
        if self.shard_cache_gib <= 0:
            raise ValueError(f"--shard-cache-gib must be positive, not {self.shard_cache_gib}")
        if self.warmup_steps >= self.max_steps:
            raise ValueError(f"--warmup-steps ({self.warmup_steps}) must be below --max-steps "
                             f"({self.max_steps})")  # fmt: skip
        if self.stop_at_step is not None and not 1 <= self.stop_at_step <= self.max_steps:
            raise ValueError(f"--stop-at-step must be in [1, --max-steps], not {self.stop_at_step}")
        if self.stop_at_step is not None and not self.save_at_end:
            raise ValueError("--stop-at-step saves a checkpoint to resume from: drop --no-save-at-end")
        if not 0 <= self.packing_context < 1:
            raise ValueError(f"--packing-context must be in [0, 1), not {self.packing_context}")
        if not 0 < self.min_lr <= self.lr:
            raise ValueError(f"need 0 < --min-lr <= --lr, not {self.min_lr} and {self.lr}")
        if not self.alm_weight >= 0 or not self.alm_temperature > 0:
            raise ValueError("--alm-weight must not be negative and --alm-temperature positive")
        if not 0 <= self.alm_merge_threshold <= 1:
            raise ValueError(f"--alm-merge-threshold must be in [0, 1], not {self.alm_merge_threshold}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1)")
        try:  # the one divisibility check, here for a single rank; the trainer repeats it
            self.accumulation_steps(world_size=1)  # once the world size is known
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        self.guidance_settings()  # validates topk, unmapped and scope

    def guidance_settings(self) -> GuidanceSettings:
        return GuidanceSettings(
            mode=self.guidance,
            topk=self.topk,
            unmapped=self.unmapped,
            scope=self.selection_scope,
            normalization=self.loss_normalization,
            chunk_student_aggregate=self.chunk_student_aggregate,
        )

    def distillation(self, *cache_settings: CacheSettings) -> Distillation | None:
        """The distillation term the mode trains beside the cross-entropy, or None; each cache's
        settings (its manifest's: --cache's, then each of --more-caches') size what its teacher's
        term reads, and several teachers' terms are one weighted sum (--teacher-weights)."""
        build = MODES[self.guidance].distillation
        if build is None:
            return None
        return mixture([build(self, settings) for settings in cache_settings], self.teacher_weights)

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-batches per rank per optimizer step; the global batch must split evenly."""
        per_step = world_size * self.micro_batch_size * self.seq_len
        if self.global_batch_tokens % per_step:
            factors = "--micro-batch-size x --seq-len"
            if world_size > 1:
                factors = f"world size x {factors} ({world_size} x {self.micro_batch_size} x "
                factors += f"{self.seq_len} = {per_step})"
            else:
                factors += f" ({per_step})"
            raise ConfigError(
                f"--global-batch-tokens ({self.global_batch_tokens}) must be a multiple of {factors}"
            )
        return self.global_batch_tokens // per_step

    @property
    def fingerprint(self) -> str:
        return fingerprint(to_dict(self))


def parse_train_config(argv: list[str] | None = None) -> TrainConfig:
    return parse_config(TrainConfig, argv, DESCRIPTION, SECTION)
