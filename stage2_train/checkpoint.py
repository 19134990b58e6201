"""Checkpoints `OUT/checkpoints/step-N/`, counted only once complete.

A step folder holds:
  state/           model and optimizer via torch.distributed.checkpoint (one code path for a
                   single process, DDP and FSDP; sharded per rank under FSDP)
  rank-R.pt        rank R's RNG states and its data consumers' positions (stage2_train.data)
  trainer.pt       the learning-rate scheduler
  config.json      the run's TrainConfig
  checkpoint.json  step, world size, workers per rank, cache and config fingerprints, and what
                   the device-dependent options resolved to (stage2_train.resolve)
  COMPLETE         written last, with every other file's size and digest
                   (stage2_train.checkpoint_digests: verified before a resume reads any state)
Everything is written into `.step-N.partial/`, flushed, and renamed: a crash mid-save leaves no
step-N folder, and the previous checkpoint stays the newest complete one.

Resuming needs the same cache and the same settings except those in `RESUMABLE_CHANGES`; anything
else is refused with a message saying what differs. The world size may change to any that divides
--data-consumers: DCP reshards model and optimizer (a DDP run's full tensors or an FSDP run's
shards) onto the new ranks, and each rank takes its consumers' positions from every saved rank's
file. On the same world size every rank also gets its own RNG states back (bit-identical resume);
on another, RNG states cannot be dealt out, and nothing in the loop draws from them (selection has
its own generator per step).
"""

from __future__ import annotations

import contextlib
import json
import pickle
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pipeline.config import from_dict, to_dict
from pipeline.differences import setting_differences
from pipeline.errors import CacheError, ConfigError
from pipeline.file_digests import digest_share
from pipeline.io import (
    atomic_write_json,
    atomic_write_text,
    fsync_file,
    publish_folder,
    space_checked,
)
from stage2_train.checkpoint_digests import MARKER, checkpoint_files, marker_text
from stage2_train.checkpoint_reader import load_state
from stage2_train.config import RESUMABLE_CHANGES, TrainConfig
from stage2_train.data.plan import DataPlan
from stage2_train.data.position import DataState
from stage2_train.distributed import Runtime
from stage2_train.options import CheckpointingOptions
from stage2_train.resolve import first_difference

CHECKPOINTS = "checkpoints"


def checkpoints_dir(out: Path) -> Path:
    return Path(out) / CHECKPOINTS


def step_dir(out: Path, step: int) -> Path:
    return checkpoints_dir(out) / f"step-{step}"


def complete_checkpoints(out: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint, oldest first."""
    found = []
    for folder in checkpoints_dir(out).glob("step-*"):
        suffix = folder.name.removeprefix("step-")
        if suffix.isdigit() and (folder / MARKER).exists():
            found.append((int(suffix), folder))
    return sorted(found)


def resume_from(options: CheckpointingOptions) -> Path | None:
    """The checkpoint folder to continue from, per --resume; None to start fresh."""
    existing = complete_checkpoints(options.out)
    if options.resume == "never":
        if existing:
            raise ConfigError(
                f"{options.out} already has checkpoints up to step {existing[-1][0]}; "
                "pass --resume auto to continue that run, or choose another --out"
            )
        return None
    if options.resume == "auto":
        return existing[-1][1] if existing else None
    path = Path(options.resume)
    if not (path / MARKER).exists():
        raise ConfigError(f"--resume {path}: not a complete checkpoint folder (no {MARKER} marker)")
    return path


def _rng_state() -> dict:
    """Every generator's state as tensors and plain numbers: what `torch.load(weights_only=True)`
    reads back, so a checkpoint folder from someone else cannot run code on --resume."""
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    version, python_state, python_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "numpy": [
            kind,
            torch.from_numpy(keys.astype(np.int64)),
            position,
            has_gauss,
            cached_gaussian,
        ],
        "python": [version, torch.tensor(python_state, dtype=torch.int64), python_gauss],
    }


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state(
        (kind, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian)
    )
    version, python_state, python_gauss = state["python"]
    random.setstate((version, tuple(python_state.tolist()), python_gauss))


def _save_synced(obj, path: Path) -> None:
    """torch.save and fsync by the rank that wrote it (its node's cache holds the bytes)."""
    torch.save(obj, path)
    fsync_file(path)


@contextlib.contextmanager
def single_process_is_intended():
    """torch.distributed.checkpoint warns on every single-process save/load; that is our design."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _model_and_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def save_checkpoint(
    config: TrainConfig,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    data_state: DataState,
    meta: dict,
    runtime: Runtime,
) -> Path:
    """Write step-N collectively (every rank calls this); returns the folder. A full disk is one
    line that says the earlier checkpoints are kept."""
    import torch.distributed.checkpoint as dcp

    final = step_dir(config.checkpointing.out, step)
    earlier = complete_checkpoints(config.checkpointing.out)
    needed, kept = None, "metrics.jsonl is kept"
    if earlier:
        last_step, last = earlier[-1]
        needed = sum(path.stat().st_size for path in last.rglob("*") if path.is_file())
        kept = f"the checkpoints up to step {last_step} and metrics.jsonl are kept"
    with space_checked(final.parent, f"checkpoint step-{step}", kept, needed):
        partial = final.with_name(f".{final.name}.partial")
        if runtime.is_main:
            shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save
            partial.mkdir(parents=True)
        runtime.barrier()
        with single_process_is_intended():
            dcp.save(
                _model_and_optimizer_state(model, optimizer),
                checkpoint_id=partial / "state",
                no_dist=not runtime.distributed,
            )
        # dcp.save fsyncs its own files; every file below is flushed by the rank that wrote it.
        _save_synced(
            {"rng": _rng_state(), "data": data_state.to_dict()}, partial / f"rank-{runtime.rank}.pt"
        )
        if runtime.is_main:
            _save_synced({"scheduler": scheduler.state_dict()}, partial / "trainer.pt")
            atomic_write_json(partial / "config.json", to_dict(config))
            atomic_write_json(partial / "checkpoint.json", {"step": step, **meta})
        runtime.barrier()
        # every file is written: each rank hashes its share, rank 0 records them all in the marker
        names = checkpoint_files(partial)
        shares = runtime.all_gather_objects(
            digest_share(partial, names, runtime.rank, runtime.world_size)
        )
        if runtime.is_main:
            digests = {name: d for share in shares for name, d in share.items()}
            atomic_write_text(partial / MARKER, marker_text(step, digests))  # last: it is complete
            # Replaces an identical step re-saved after a resume from an older one. Rank 0 cannot
            # flush other nodes' files: each rank flushed its own above.
            publish_folder(partial, final, flush_files=False)
        runtime.barrier()
        return final


# What a run saved before these options existed did: it divided by the kept count and packed the
# document stream without masks.
LEGACY_SETTINGS = {
    "loss_normalization": "kept",
    "chunk_student_aggregate": "mean",
    "packing": "stream",
    "packing_context": 0.5,
    "more_caches": [],
    "combine_teachers": "min",
    "source_teachers": [],
    "teacher_weights": [],
}

def check_resumable(folder: Path, config: TrainConfig, meta: dict) -> int:
    """Refuse a checkpoint this run cannot continue exactly; returns its step."""
    saved = json.loads((folder / "checkpoint.json").read_text())
    saved_config = folder / "config.json"
    raw = json.loads(saved_config.read_text())
    if saved["cache_fingerprint"] != meta["cache_fingerprint"]:
        # the fingerprint covers every cache the run reads: a cache added or dropped is named
        before, now = raw.get("more_caches", []), [str(c) for c in config.data.more_caches]
        if before != now:
            raise ConfigError(
                f"checkpoint {folder} was trained with --more-caches {' '.join(before) or '(none)'}"
                f", this run gives {' '.join(now) or '(none)'}: the caches a run reads cannot "
                "change on resume; resume with the same --more-caches or start a new --out"
            )
        raise CacheError(
            f"checkpoint {folder} was trained on cache {saved['cache_fingerprint']}, but "
            f"{config.data.cache} is cache {meta['cache_fingerprint']}: resume with the same cache "
            "or start a new --out"
        )
    differs = first_difference(saved, meta)
    if differs is not None:
        option, used, ours = differs
        flag = f"--{option.replace('_', '-')}"
        raise ConfigError(
            f"checkpoint {folder} was trained with {flag} {used}, this run would use {ours}: "
            f"resume with {flag} {used}"
        )
    threads = saved.get("torch_threads")
    if threads is not None and threads != meta["torch_threads"]:
        # CPU kernels split reductions by thread: the run continues correctly, not bit for bit.
        warnings.warn(
            f"checkpoint {folder} was written with {threads} torch threads, this run has "
            f"{meta['torch_threads']}: losses continue, but not bit-identical to an "
            f"uninterrupted run (set OMP_NUM_THREADS={threads} for that)",
            stacklevel=2,
        )
    # Read back through the checks a manifest gets: an edited or foreign config.json is refused
    # by name, and values compare in one form (paths, floats) with the current run's.
    if raw.get("guidance") == "chunk" and "loss_normalization" not in raw:
        raise ConfigError(
            f"checkpoint {folder} is a --guidance chunk run from before chunks were selected whole "
            "(paper Table 2): it cannot continue under today's chunk baseline; start a new --out"
        )
    if "data_consumers" not in raw:
        raise ConfigError(
            f"checkpoint {folder} is from before --data-consumers: its data positions are per "
            "rank and worker, which today's partition cannot continue exactly; start a new --out"
        )
    raw = {**LEGACY_SETTINGS, **raw}  # what an option that did not exist yet meant then
    old = to_dict(from_dict(TrainConfig, raw, str(saved_config)))
    new = to_dict(config)
    changed = setting_differences(old, new, ignore=RESUMABLE_CHANGES)
    if changed:
        details = ", ".join(changed)
        raise ConfigError(
            f"checkpoint {folder} was made with other settings ({details}); only "
            f"{', '.join(sorted(RESUMABLE_CHANGES))} may change on resume"
        )
    return int(saved["step"])


def load_checkpoint(
    folder: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    plan: DataPlan,
    runtime: Runtime,
) -> DataState:
    """Restore model, optimizer, scheduler and (same world size) this rank's RNG; returns the
    positions of this rank's consumers."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _model_and_optimizer_state(model, optimizer)
    with single_process_is_intended():
        load_state(state, folder / "state", no_dist=not runtime.distributed)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    scheduler.load_state_dict(_load_tensors(folder / "trainer.pt")["scheduler"])
    saved_world = json.loads((folder / "checkpoint.json").read_text())["world_size"]
    ranks = [_load_tensors(folder / f"rank-{rank}.pt") for rank in range(saved_world)]
    if saved_world == runtime.world_size:
        _set_rng_state(ranks[runtime.rank]["rng"])
    return DataState.take(plan, runtime.rank, [DataState.from_dict(r["data"]) for r in ranks])


def _load_tensors(path: Path) -> dict:
    """A file of tensors and plain data (`rank-R.pt`, `trainer.pt`), read by the unpickler that
    builds nothing else."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        raise CacheError(
            f"{path} holds objects other than tensors and numbers, which could run code "
            "when loaded: not a checkpoint this trainer wrote; refusing to resume from it"
        ) from None
