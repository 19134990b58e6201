"""Which checkpoint a resume may trust: the newest whose files all match the digests its marker
records (stage2_train.checkpoint_digests), each damaged one named in one line on the way."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from pipeline.errors import CacheError
from pipeline.file_digests import damage_summary, share_problems
from stage2_train.checkpoint import checkpoints_dir, complete_checkpoints
from stage2_train.checkpoint_digests import recorded_digests
from stage2_train.distributed import Runtime
from stage2_train.options import CheckpointingOptions


def trusted_checkpoint(
    options: CheckpointingOptions, newest: Path | None, runtime: Runtime
) -> Path | None:
    """The checkpoint to resume from: `newest` when every file matches the digest its marker
    records, else (--resume auto) the newest older one that does, each damage said in one line.
    CacheError when none is whole; nothing is deleted. Every rank checks a share of the files."""
    if newest is None:
        return None
    candidates = [newest]
    if options.resume == "auto":
        candidates = [folder for _, folder in reversed(complete_checkpoints(options.out))]
    for folder in candidates:
        try:
            recorded = recorded_digests(folder)
        except CacheError as exc:  # a damaged marker: damage, as a damaged file is
            problems = [str(exc)]
        else:
            if recorded is None:
                warnings.warn(
                    f"checkpoint {folder} records no digests (written before they were): "
                    "resuming from it unverified",
                    stacklevel=2,
                )
                return folder
            shares = runtime.all_gather_objects(
                share_problems(folder, recorded, runtime.rank, runtime.world_size)
            )
            problems = sorted(problem for share in shares for problem in share)
        if not problems:
            if folder != newest and runtime.is_main:
                print(f"stage 2: resuming from {folder}, the newest whole checkpoint",
                      file=sys.stderr)  # fmt: skip
            return folder
        said = damage_summary(problems)
        if options.resume != "auto":
            raise CacheError(f"--resume {folder}: {said}; choose a whole checkpoint")
        if runtime.is_main:
            print(f"stage 2: checkpoint {folder} is damaged: {said}", file=sys.stderr)
    raise CacheError(
        f"no checkpoint in {checkpoints_dir(options.out)} is whole (each is damaged, said above); "
        "nothing was deleted: restore their files, or start a new --out"
    )
