"""OUT belongs to stage 2 alone, and to one run of it at a time.

A run writes only into an empty or new folder, or one holding an earlier stage-2 run (to continue
it, or start it over when it saved no checkpoint): it refuses, before writing a byte, a folder
holding anything else (a model, a cache, someone's files), which its config.json, checkpoints and
final/ would overwrite or mix with. The student's folder and its parents are refused by path too.

While it runs, rank 0 holds `.stage2.lock` in OUT (pipeline.storage.lock: an flock the kernel
releases when the process dies, even by SIGKILL); a second run on the same OUT is refused, naming
the holder. The other ranks write only their own files into OUT, after rank 0 has the lock.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from pipeline.cache.manifest import MANIFEST_NAME
from pipeline.errors import CacheError, ConfigError
from pipeline.io import temporary_affixes
from pipeline.loggers import TENSORBOARD_FOLDER, WANDB_FOLDER
from pipeline.metrics import METRICS_NAME
from pipeline.models.student import WEIGHT_FILES
from pipeline.storage.lock import FolderLock
from stage2_train.checkpoint import CHECKPOINTS, resume_from
from stage2_train.distributed import Runtime
from stage2_train.options import CheckpointingOptions

LOCK_NAME = ".stage2.lock"
RUN_CONFIG = "config.json"
# Everything a run writes into OUT: its logs, checkpoints and model, a final model being staged
# (pipeline.io.staged_folder), the temporaries of its atomic writes, and the lock.
RUN_ENTRIES = (
    RUN_CONFIG,
    METRICS_NAME,
    TENSORBOARD_FOLDER,
    WANDB_FOLDER,
    CHECKPOINTS,
    "final",
    ".final.partial",
    "documents",
    LOCK_NAME,
    "*".join(temporary_affixes(RUN_CONFIG)),
    "*".join(temporary_affixes(METRICS_NAME)),
)
# A stage-2 config.json holds every option without a default; a model's configuration none.
RUN_CONFIG_KEYS = {"cache", "student", "out", "max_steps"}


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def is_run_config(path: Path) -> bool:
    saved = _read_json(path)
    return isinstance(saved, dict) and RUN_CONFIG_KEYS <= saved.keys()


def foreign_entries(out: Path) -> list[str]:
    """The names in OUT that no stage-2 run wrote, in order."""
    names = sorted(entry.name for entry in out.iterdir())
    foreign = [n for n in names if not any(fnmatch.fnmatchcase(n, p) for p in RUN_ENTRIES)]
    if RUN_CONFIG in names and not is_run_config(out / RUN_CONFIG):
        foreign.insert(0, RUN_CONFIG)
    return foreign


def _what(out: Path, foreign: list[str]) -> str:
    """What OUT seems to hold, for the refusal."""
    if MANIFEST_NAME in foreign or any(name.endswith(".parquet") for name in foreign):
        return "a teacher-loss cache"
    if RUN_CONFIG in foreign:
        config = _read_json(out / RUN_CONFIG)
        if any(name in WEIGHT_FILES for name in foreign) or (
            isinstance(config, dict) and "model_type" in config
        ):
            return "a model"
    return "files stage 2 did not write"


def check_output_is_a_run(given: Path, student_spec: str) -> None:
    """ConfigError unless OUT (`given`) is new, empty, or an earlier stage-2 run, and apart from
    the student's folder (the cache's is preflight.check_output_and_cache's)."""
    out = Path(given).expanduser().resolve()
    student = Path(student_spec).expanduser()
    if student.exists():  # a local folder or config.json, not a preset or hub id
        folder = student.resolve() if student.is_dir() else student.resolve().parent
        if out == folder or out in folder.parents:
            holds = "is" if out == folder else "holds"
            raise ConfigError(
                f"--out {given} {holds} the student's folder (--student {student_spec}): "
                "the run's config.json and final/ would overwrite the model; choose another --out"
            )
    if out.is_file():
        raise ConfigError(f"--out {given} is a file; give a folder for the run")
    if not out.is_dir():
        return
    foreign = foreign_entries(out)
    if foreign:
        more = len(foreign) - 4
        shown = ", ".join(foreign[:4]) + (f" and {more} more" if more > 0 else "")
        raise ConfigError(
            f"--out {given} holds {_what(out, foreign)} ({shown}), not an earlier stage-2 run: "
            "the run would write over it; choose a new or empty --out (or the --out of an "
            "earlier run of this command, to continue it)"
        )


@contextlib.contextmanager
def hold_output(
    options: CheckpointingOptions, runtime: Runtime, checkpoint: Path | None
) -> Iterator[None]:
    """Rank 0 holds OUT's lock for the block; every rank enters it only once rank 0 has it, and
    leaves with rank 0's refusal otherwise (the ranks agree through one all-reduce). `checkpoint`
    is what the run decided to resume from before it had the lock: a run that held the lock until
    now may have saved a newer one."""
    out = options.out
    with contextlib.ExitStack() as held:
        refusal = None
        if runtime.is_main:
            try:
                held.enter_context(FolderLock(out, LOCK_NAME, "stage-2 run"))
            except (CacheError, OSError) as exc:
                refusal = exc
        refused = runtime.all_reduce_sum(torch.tensor([float(refusal is not None)]))
        if refusal is not None:
            raise refusal
        if refused.item():
            raise CacheError(f"rank 0 could not lock {out}; its message says why")
        if resume_from(options) != checkpoint:
            raise ConfigError(
                f"another run saved a checkpoint in {out} while this one was starting; "
                "run the same command again to continue from it"
            )
        yield
        runtime.barrier()  # every rank's last write is done before the lock goes
