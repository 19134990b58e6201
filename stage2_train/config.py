"""Stage 2's configuration: its sections (stage2_train.options) in the order --help and the docs
list them, what combines options of two sections, and the command line's parser. Saved flat
(pipeline.config.to_dict) with every checkpoint and the final model."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config import parse_config, to_dict
from pipeline.errors import ConfigError
from pipeline.guidance_modes import MODES
from pipeline.io import fingerprint
from pipeline.teacher_options import source_teachers
from stage2_train.options import (
    CheckpointingOptions,
    DataOptions,
    GuidanceOptions,
    KernelsOptions,
    LoggingOptions,
    ModelOptions,
    OptimizerOptions,
)

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
# shard cache's place, size and read-ahead never change what is read; the held-out evaluation
# reads the model and changes nothing.)
RESUMABLE_CHANGES = frozenset(
    {
        "out",
        "stop_at_step",
        "save_every",
        "save_at_end",
        "resume",
        "record_documents",
        "eval_every",
        "eval_data",
        "eval_docs",
        "logger",
        "wandb_project",
        "num_workers",
        "shard_cache",
        "shard_cache_gib",
        "read_ahead",
        # recomputes, never changes, what a layer computes (the same bits on a CPU)
        "activation_checkpointing",
        # what these resolved to on the device is checked instead (stage2_train.checkpoint)
        "attention",
        "adamw_kernel",
        "compile",
        "loss_kernel",
        "fsdp_param_dtype",
    }
)



@dataclass
class TrainConfig:
    """Each builder is handed its section (`make_optimizer(model, config.optimizer, ...)`);
    the whole config goes where a decision reads several (the trainer, the checkpoint's resume
    check, the run's output)."""

    guidance: GuidanceOptions
    data: DataOptions
    model: ModelOptions
    optimizer: OptimizerOptions
    kernels: KernelsOptions
    checkpointing: CheckpointingOptions
    logging: LoggingOptions

    def __post_init__(self) -> None:
        data, guidance = self.data, self.guidance
        source_teachers(data.cache, data.more_caches, guidance.combine_teachers,
                        guidance.source_teachers)  # fmt: skip
        caches, weights = 1 + len(data.more_caches), guidance.teacher_weights
        if weights and (
            MODES[guidance.mode].distillation is None or caches == 1
            or len(weights) != caches or min(weights) <= 0
        ):  # fmt: skip
            raise ValueError(
                f"--teacher-weights {weights}: a distillation mode with --more-caches takes one "
                f"positive weight per cache ({caches} here; selection modes take "
                "--combine-teachers)"
            )
        stop, max_steps = self.checkpointing.stop_at_step, self.optimizer.max_steps
        if stop is not None and not 1 <= stop <= max_steps:
            raise ValueError(f"--stop-at-step must be in [1, --max-steps], not {stop}")
        try:  # the one divisibility check, here for a single rank; the trainer repeats it
            self.accumulation_steps(world_size=1)  # once the world size is known
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-batches per rank per optimizer step; the global batch must split evenly."""
        micro, seq_len = self.optimizer.micro_batch_size, self.data.seq_len
        per_step, total = world_size * micro * seq_len, self.optimizer.global_batch_tokens
        if total % per_step:
            factors = "--micro-batch-size x --seq-len"
            if world_size > 1:
                factors += f" ({world_size} x {micro} x {seq_len} = {per_step})"
                factors = "world size x " + factors
            else:
                factors += f" ({per_step})"
            raise ConfigError(f"--global-batch-tokens ({total}) must be a multiple of {factors}")
        return total // per_step

    @property
    def fingerprint(self) -> str:
        return fingerprint(to_dict(self))


def parse_train_config(argv: list[str] | None = None) -> TrainConfig:
    return parse_config(TrainConfig, argv, DESCRIPTION, SECTION)
