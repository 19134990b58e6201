"""Where a training run's per-step metrics go besides metrics.jsonl (stage 2's --logger).

Each logger takes a step's whole metrics record, as metrics.jsonl holds it, and keeps its numbers
under `train/<key>`; a key without a value this step (None: `mfu` on a CPU, `loss` of a step
without target tokens) is left out, never logged as 0. Only rank 0 logs.

- `tensorboard` (the default): event files in OUT/tensorboard. A resumed run purges the steps
  after its checkpoint, so its curves continue without a doubled stretch.
- `wandb`: Weights & Biases (the optional `wandb` extra), its files in OUT/wandb. The run id is
  kept in OUT/wandb/run-id, so a resumed run continues the same wandb run; a fresh start gets a
  new one. The mode is WANDB_MODE where set, else online when wandb has an API key (`wandb login`
  or WANDB_API_KEY) and offline otherwise (`wandb sync OUT/wandb/offline-run-*` uploads it).
- `none`: metrics.jsonl only.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
from pathlib import Path
from typing import Protocol

from pipeline.errors import ConfigError
from pipeline.io import atomic_write_text

TENSORBOARD_FOLDER = "tensorboard"
WANDB_FOLDER = "wandb"
WANDB_RUN_ID = "run-id"  # in OUT/wandb: the run a resumed run continues
WANDB_INSTALL = "pip install 'vocagno[wandb]'"


class MetricsLogger(Protocol):
    def log(self, metrics: dict, step: int) -> None: ...

    def close(self) -> None: ...


def scalars(metrics: dict) -> dict[str, float]:
    """A record's numbers, each under `train/<key>`, a held-out measurement `eval_<name>` under
    `eval/<name>`: None, the step itself, flags and text are left out."""
    return {
        f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}": value
        for key, value in metrics.items()
        if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)
    }


class NoLogger:
    def log(self, metrics: dict, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardLogger:
    def __init__(self, out: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events of steps after the checkpoint, logged before an interruption, go
        self.writer = SummaryWriter(str(out / TENSORBOARD_FOLDER), purge_step=start_step + 1)

    def log(self, metrics: dict, step: int) -> None:
        for tag, value in scalars(metrics).items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


def wandb_mode(wandb) -> str:
    """WANDB_MODE where set; else online with an API key, offline without (never a prompt)."""
    explicit = os.environ.get("WANDB_MODE")
    if explicit:
        return explicit
    return "online" if wandb.login(prompt=False, verify=False) else "offline"


class WandbLogger:
    def __init__(self, out: Path, start_step: int, config: dict, project: str):
        import wandb

        folder = out / WANDB_FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        saved = folder / WANDB_RUN_ID
        if start_step and saved.is_file():
            run_id = saved.read_text(encoding="utf-8").strip()
        else:  # a fresh start is a new run, even in a folder an earlier failed run logged to
            run_id = secrets.token_hex(6)  # wandb's ids: letters and digits
            atomic_write_text(saved, run_id + "\n")
        # wandb keeps a run's steps increasing: steps a resumed run redoes after its checkpoint
        # and had logged before the interruption keep their first values, which a resumed run
        # reproduces anyway
        self.run = wandb.init(
            project=project,
            name=out.name,
            dir=out,
            id=run_id,
            resume="allow",
            mode=wandb_mode(wandb),
            config=config,
        )

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(scalars(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


def check_logger(logger: str) -> None:
    """ConfigError, in one line, for a logger whose package is not installed."""
    if logger == "wandb" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"--logger wandb needs the wandb package: {WANDB_INSTALL}")


def open_logger(
    logger: str, out: Path, start_step: int, config: dict, wandb_project: str
) -> MetricsLogger:
    """The chosen logger for a run in `out` starting after `start_step` (0: a fresh start);
    `config` is the run's saved config, which wandb shows as the run's config."""
    check_logger(logger)
    if logger == "tensorboard":
        return TensorBoardLogger(out, start_step)
    if logger == "wandb":
        return WandbLogger(out, start_step, config, wandb_project)
    return NoLogger()
