"""Stage 2's options, one dataclass per section: the component that reads them (pipeline.config
turns them into flags, manifest keys and the saved config.json, each option by its flat name).
Each section checks its own ranges; stage2_train.config's TrainConfig holds the sections and
checks what combines options of two of them."""

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
    LoggerName,
    LossKernel,
    LossNormalization,
    Packing,
    SelectionScope,
    TeacherCombination,
    UnmappedStrategy,
)
from pipeline.config import option
from pipeline.distillation import Distillation
from pipeline.distillation.teachers import mixture
from pipeline.guidance import DEFAULT_GUIDANCE, GuidanceSettings
from pipeline.guidance_modes import MODES, GuidanceMode
from pipeline.models.presets import PRESETS
from pipeline.storage import as_location, is_uri


def _at_least_one(section: object, *names: str) -> None:
    for name in names:
        if (value := getattr(section, name)) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, not {value}")


def _not_negative(section: object, *names: str) -> None:
    for name in names:
        if getattr(section, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must not be negative")


@dataclass
class GuidanceOptions:
    """What beside the cross-entropy selects tokens or adds a distillation term (docs/guidance.md).
    The mode is `mode` here and `--guidance` outside the code (the section's own name)."""

    mode: GuidanceMode = option(
        DEFAULT_GUIDANCE.mode,
        key="guidance",
        help="the selection (or distillation term) beside the cross-entropy: one of the modes "
        "above (token: the paper's method); docs/guidance.md says where the paper defines each",
    )
    topk: float = option(DEFAULT_GUIDANCE.topk, help="fraction of candidate tokens kept "
        "(ceil(topk * n))")  # fmt: skip
    aggregate: Aggregation = option(DEFAULT_AGGREGATION, help="how the losses of the teacher "
        "tokens covering one student token combine")  # fmt: skip
    unmapped: UnmappedStrategy = option(DEFAULT_GUIDANCE.unmapped, help="student tokens with "
        "no teacher loss: include (always kept), exclude (never kept), mean (get the mean teacher "
        "loss and compete in the top-k)")  # fmt: skip
    selection_scope: SelectionScope = option(DEFAULT_GUIDANCE.scope, help="rank tokens per "
        "micro-batch on each rank, or across all ranks' micro-batches at once (one threshold, "
        "all_gather)")  # fmt: skip
    loss_normalization: LossNormalization = option(
        DEFAULT_GUIDANCE.normalization,
        help="all: the kept tokens' summed loss over all N target tokens of the step (paper "
        "eq. 3); kept: over the kept tokens only (not the paper's: ~2.4x larger gradients at "
        "top-k 40%%; not for chunk modes)",
    )
    num_chunks: int = option(32, help="equal chunks per document for --guidance chunk and "
        "random-chunk (paper Table 2: 8, 16, 32, 64)")  # fmt: skip
    chunk_student_aggregate: ChunkStudentAggregate = option(
        DEFAULT_GUIDANCE.chunk_student_aggregate,
        help="how a chunk's student token losses combine into the chunk's student loss for "
        "--guidance chunk (the paper does not say; its teacher side uses --aggregate)",
    )
    combine_teachers: TeacherCombination = option("min", help="--more-caches: a student "
        "token's teacher loss is the smallest of the teachers' (min) or their mean, over the "
        "teachers that map it, or its document's source's teacher (source; the paper has one "
        "teacher)")  # fmt: skip
    source_teachers: list[str] = option([], help="--combine-teachers source: SOURCE=CACHE "
        "for each source of the corpus (its manifest's names), CACHE being --cache or one of "
        "--more-caches")  # fmt: skip
    teacher_weights: list[float] = option([], help="--more-caches under a distillation mode: "
        "one positive weight per cache (--cache first), normalized to sum to 1, for the "
        "weighted sum of the teachers' terms (default: equal)")  # fmt: skip
    uld_lambda: float = option(
        0.5,
        help="--guidance uld: weight of the Wasserstein term beside the cross-entropy (paper "
        "appendix B, eq. 6: lambda = 0.5 of 0.3, 0.5, 1.0, 1.5)",
    )
    alm_weight: float = option(1.0, help="--guidance alm: the ALM term's weight beside the "
        "cross-entropy (tokenkit's large-to-small example sums sft and alm_unconstrained with "
        "equal weights)")  # fmt: skip
    alm_temperature: float = option(100.0, help="--guidance alm: binary_ce's binarization "
        "temperature (tokenkit: 100)")  # fmt: skip
    alm_merge_threshold: float = option(0.1, help="--guidance alm: merge a chunk into the "
        "next while the teacher's space probability after it is at most this (tokenkit's "
        "tokenizer_pair_bias_threshold: 0.1)")  # fmt: skip
    alm_mode: AlmMode = option(
        "merge_by_space_prob+append_space",
        help="--guidance alm: tokenkit's alm_mode (the default is its default); naive: chunk "
        "log-probabilities only, no merging or space term, and no --space-logprob column needed",
    )

    @staticmethod
    def help_overview() -> str:  # --help's lines above the section's options, one a mode
        return "\n".join(f"{name}: {mode.summary}" for name, mode in MODES.items())

    def __post_init__(self) -> None:
        _at_least_one(self, "num_chunks")
        _not_negative(self, "uld_lambda")
        if not self.alm_weight >= 0 or not self.alm_temperature > 0:
            raise ValueError("--alm-weight must not be negative and --alm-temperature positive")
        if not 0 <= (threshold := self.alm_merge_threshold) <= 1:
            raise ValueError(f"--alm-merge-threshold must be in [0, 1], not {threshold}")
        self.settings()  # validates topk, unmapped and scope

    def settings(self) -> GuidanceSettings:
        return GuidanceSettings(
            mode=self.mode,
            topk=self.topk,
            unmapped=self.unmapped,
            scope=self.selection_scope,
            normalization=self.loss_normalization,
            chunk_student_aggregate=self.chunk_student_aggregate,
        )

    def distillation(
        self, student: ModelOptions, *cache_settings: CacheSettings
    ) -> Distillation | None:
        """The distillation term the mode trains beside the cross-entropy, or None; each cache's
        settings (its manifest's: --cache's, then each of --more-caches') size what its teacher's
        term reads, and several teachers' terms are one weighted sum (--teacher-weights).
        `student`'s tokenizer gives ALM the student's space mask."""
        build = MODES[self.mode].distillation
        if build is None:
            return None
        terms = [build(self, settings, student) for settings in cache_settings]
        return mixture(terms, self.teacher_weights)


@dataclass
class DataOptions:
    """The cache (or caches) read, and how documents become training sequences."""

    cache: str = option(help="stage 1 cache folder (with manifest.json): a local path or a URI "
        "(s3://bucket/prefix, gs://…; credentials and endpoint from the environment)")  # fmt: skip
    more_caches: list[str] = option([], help="other teachers' caches of the same corpus (stage 1 "
        "with the same --corpus and --docs-per-shard), read in step: their teacher losses combine "
        "by --combine-teachers, a distillation's terms by --teacher-weights "
        "(docs/several-teachers.md)")  # fmt: skip
    seq_len: int = option(2048, help="tokens per training sequence (documents are packed)")
    completion_only: bool = option(True, help="a cache with target spans (stage 1's --targets): "
        "train on their tokens alone; --no-completion-only: on every token")  # fmt: skip
    packing: Packing = option(
        "documents",
        help="documents: whole documents packed best-fit, attention masked at document "
        "boundaries, positions restarting per document (as stage 1 scored them); stream: "
        "documents concatenated and cut into windows, no mask (see docs/packing.md)",
    )
    packing_context: float = option(0.5, help="--packing documents: the continuation of a "
        "document longer than a window re-reads this fraction of a window before it as context, "
        "without loss")  # fmt: skip
    num_workers: int = option(2, help="data-loader worker processes per rank (0: in the main "
        "process); fewer are started where they would not split the rank's data consumers "
        "evenly")  # fmt: skip
    data_consumers: int = option(
        16,
        help="the data stream's consumers: the cache is split into this many independent streams, "
        "dealt to the ranks, so a checkpoint resumes on any world size that divides it (16: 1, "
        "2, 4, 8 or 16 ranks); each step's documents depend on it and the global batch only",
    )
    shard_cache: str = option("", help="--cache in object storage: local folder for the "
        "verified copies of shards being read (default: the system's temporary "
        "folder)")  # fmt: skip
    shard_cache_gib: float = option(8.0, help="--cache in object storage: GiB of shard copies a "
        "rank keeps at most")  # fmt: skip
    read_ahead: int = option(2, help="--cache in object storage: shards fetched ahead of the one "
        "being read")  # fmt: skip

    def __post_init__(self) -> None:
        self.cache = as_location(self.cache)
        self.more_caches = [as_location(cache) for cache in self.more_caches]
        _at_least_one(self, "seq_len", "data_consumers")
        _not_negative(self, "num_workers", "read_ahead")
        if self.shard_cache_gib <= 0:
            raise ValueError(f"--shard-cache-gib must be positive, not {self.shard_cache_gib}")
        if not 0 <= self.packing_context < 1:
            raise ValueError(f"--packing-context must be in [0, 1), not {self.packing_context}")


@dataclass
class ModelOptions:
    """The student, its tokenizer, and how it is placed and computed."""

    student: str = option(
        help="the student: a hub id, a local Hugging Face folder (with weights, or only a "
        "config.json to train from scratch), a config.json file, or a preset for training "
        f"from scratch: {', '.join(PRESETS)}"
    )
    student_tokenizer: str | None = option(None, help="student tokenizer spec (shipped name, "
        "tokenizer.json, folder, hub id); default: the student's own (required for a config or "
        "preset student)")  # fmt: skip
    fsdp: bool = option(False, help="shard the student with FSDP (students too big for a device)")
    dtype: ComputeDtype = option("auto", help="compute dtype: bfloat16 autocast needs a GPU; "
        "auto is bfloat16 on GPU, float32 on CPU (weights and optimizer state stay float32)")  # fmt: skip
    fsdp_param_dtype: FsdpParamDtype = option(
        "auto",
        help="--fsdp: the dtype FSDP2 gathers the parameters in and the forward and backward "
        "passes run in (MixedPrecisionPolicy); gradients are reduced in float32 and the "
        "optimizer keeps float32 weights either way; auto: bfloat16 where the compute dtype is "
        "bfloat16 (a GPU), float32 elsewhere (docs/gpu-path.md)",
    )
    activation_checkpointing: bool = option(False, help="recompute each decoder layer in the "
        "backward pass, keeping only its input: one layer's activations instead of all, for one "
        "more forward of the layers a step (the same training; docs/memory.md)")  # fmt: skip

    def tokenizer_spec(self) -> str:
        """The student's tokenizer: --student-tokenizer, else the student's own."""
        from pipeline.models.student import student_tokenizer_spec  # torch: only when asked

        return student_tokenizer_spec(self.student, self.student_tokenizer)


@dataclass
class OptimizerOptions:
    """The schedule, the batch and AdamW."""

    max_steps: int = option(help="optimizer steps in the schedule (the cosine decays over these)")
    seed: int = option(0, help="seed for model init, data order, and random selection")
    global_batch_tokens: int = option(
        2**21, help="tokens per optimizer step over all ranks (gradient accumulation fills it)"
    )
    micro_batch_size: int = option(4, help="sequences per forward pass on each rank")
    lr: float = option(8e-5, help="peak learning rate (after warmup)")
    min_lr: float = option(8e-6, help="learning rate at the end of the cosine decay")
    warmup_steps: int = option(100, help="linear warmup steps from 0 to --lr")
    weight_decay: float = option(0.1, help="AdamW weight decay (not applied to norms and biases)")
    adam_beta1: float = option(0.9, help="AdamW beta1")
    adam_beta2: float = option(0.95, help="AdamW beta2")
    grad_clip: float = option(1.0, help="clip the global gradient norm to this (0: no clipping)")

    def __post_init__(self) -> None:
        _at_least_one(self, "max_steps", "global_batch_tokens", "micro_batch_size")
        _not_negative(self, "warmup_steps", "weight_decay", "grad_clip")
        if self.warmup_steps >= self.max_steps:
            raise ValueError(f"--warmup-steps ({self.warmup_steps}) must be below --max-steps "
                             f"({self.max_steps})")  # fmt: skip
        if not 0 < self.min_lr <= self.lr:
            raise ValueError(f"need 0 < --min-lr <= --lr, not {self.min_lr} and {self.lr}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1)")


@dataclass
class KernelsOptions:
    """The GPU path's switches, each `auto` on its fast path on a GPU (docs/gpu-path.md)."""

    loss_kernel: LossKernel = option(
        "auto",
        help="chunked: the per-token loss from the last hidden states and the head's weight in "
        "row chunks, never the whole micro-batch's logits (Llama, Mistral, Qwen2/3 students, "
        "with or without --fsdp); plain: the model's logits, then the loss; "
        "auto: chunked on a GPU where it applies (docs/gpu-path.md)",
    )
    compile: CompileLayers = option("auto", help="layers: torch.compile each decoder layer of "
        "the student (norms, RoPE, MLP fused; tens of seconds of compiling at the first step); "
        "off: eager; auto: layers on a GPU, off on a CPU (docs/gpu-path.md)")  # fmt: skip
    attention: Attention = option("auto", help="how attention takes --packing documents' mask: "
        "flex: PyTorch flex_attention with a block mask (no T x T mask; trains on a GPU only); "
        "dense: a [B, 1, T, T] boolean mask through SDPA; auto: flex on a GPU, dense on a CPU "
        "(see docs/packing.md)")  # fmt: skip
    adamw_kernel: AdamwKernel = option("auto", help="torch's AdamW implementation: fused (one "
        "kernel updates every parameter), plain (torch's default: foreach on a GPU, a loop over "
        "parameters on a CPU), auto: fused on a GPU, plain on a CPU; the same update up to float "
        "rounding (docs/gpu-path.md)")  # fmt: skip


@dataclass
class CheckpointingOptions:
    """Where the run writes, when it saves and stops, and what it resumes from."""

    out: Path = option(help="output folder: checkpoints, metrics.jsonl and logs, final model")
    stop_at_step: int | None = option(None, help="stop cleanly after this step with a "
        "checkpoint, as a cluster time limit would; --resume auto continues the same "
        "schedule")  # fmt: skip
    save_every: int = option(500, help="save a checkpoint every N steps")
    save_at_end: bool = option(True, help="save a checkpoint and final/ at the run's last "
        "step; --no-save-at-end: only what --save-every asks for (a benchmark's runs)")  # fmt: skip
    resume: str = option(
        "auto",
        help="auto: continue from the newest complete checkpoint in OUT if any; never: start "
        "fresh (refused if OUT already has checkpoints); or a path to a step-N folder",
    )

    def __post_init__(self) -> None:
        # Path folds `s3://b/x` into a local folder `s3:/b/x`: refuse what was a URI.
        if is_uri(uri := str(self.out).replace(":/", "://", 1)):
            raise ValueError(
                f"--out {uri}: stage 2 writes to a local or mounted folder, not a URI; "
                "copy the run to object storage after it finishes"
            )
        self.out = Path(self.out)
        _at_least_one(self, "save_every")
        if self.stop_at_step is not None and not self.save_at_end:
            raise ValueError(
                "--stop-at-step saves a checkpoint to resume from: drop --no-save-at-end"
            )


@dataclass
class LoggingOptions:
    """Where each step's numbers go beside metrics.jsonl, what else is recorded, held-out loss."""

    logger: LoggerName = option("tensorboard", help="where each step's numbers go beside "
        "metrics.jsonl: tensorboard (OUT/tensorboard), wandb (Weights & Biases, OUT/wandb: offline "
        "without an API key unless WANDB_MODE says otherwise; pip install 'vocagno[wandb]') or "
        "none (docs/stage2.md, Outputs)")  # fmt: skip
    wandb_project: str = option("vocagno", help="--logger wandb: the run's wandb project (the "
        "run is named after OUT; WANDB_ENTITY picks the entity)")  # fmt: skip
    record_documents: bool = option(False, help="write OUT/documents/rank-R.jsonl: the "
        "documents each step began training on")  # fmt: skip
    eval_every: int = option(0, help="held-out loss and bits per character of --eval-data every "
        "N steps and at the schedule's last step; 0: never")  # fmt: skip
    eval_data: str | None = option(None, help="--eval-every's held-out documents: any corpus "
        "spec, as vocagno eval --data reads it; refused if the cache holds any")  # fmt: skip
    eval_docs: int = option(200, help="--eval-every reads the first N documents of --eval-data")

    def __post_init__(self) -> None:
        _not_negative(self, "eval_every")
        _at_least_one(self, "eval_docs")
        if bool(self.eval_every) != (self.eval_data is not None):
            raise ValueError("--eval-every N and --eval-data (the held-out documents) go together")
