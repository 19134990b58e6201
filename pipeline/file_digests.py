"""Files trusted only when whole: a record of every file's size and digest, written last, and the
check of the files against it before any of them is read.

A stage-2 checkpoint records its files in its COMPLETE marker, a model folder (a run's final/, an
export) in its vocagno.json. A bit flipped on disk, a bad copy between machines or an object
store's partial object would otherwise load without an error.

The digest is XXH3-128 (`DIGEST`): the damage it guards against is accidental (a flipped bit, a
cut-off or bad copy), which a 128-bit hash catches with certainty for practical purposes, and it
reads at ~10 GB/s where SHA-256 reads at ~1 (benchmarks/bench_checkpoint_digest.py: a resume
reads every byte twice, so the hash's speed is the cost). The cache's shards keep SHA-256: their
digest is also their identity in the manifest's fingerprint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import xxhash

from pipeline.errors import CacheError

DIGEST = "xxh3_128"
READ_BYTES = 8 << 20  # per read while hashing


def folder_files(folder: Path, *, leave_out: str) -> list[str]:
    """Every file under `folder` but its record `leave_out`, as sorted relative paths."""
    names = [
        os.path.relpath(os.path.join(root, name), folder)
        for root, _, files in os.walk(folder)
        for name in files
    ]
    return sorted(name for name in names if name != leave_out)


def file_digest(path: Path) -> dict:
    digest, size = xxhash.xxh3_128(), 0
    buffer = memoryview(bytearray(READ_BYTES))  # one buffer read into, not a new one per read
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            digest.update(buffer[:count])
            size += count
    return {"bytes": size, DIGEST: digest.hexdigest()}


def digest_share(folder: Path, names: list[str], rank: int, world: int) -> dict[str, dict]:
    """Size and digest of this rank's share of `names` (all of them for rank 0 of 1)."""
    return {name: file_digest(folder / name) for name in names[rank::world]}


def share_problems(folder: Path, recorded: dict[str, dict], rank: int, world: int) -> list[str]:
    """What is wrong with this rank's share of the recorded files: missing, of another size,
    unreadable, or not matching its digest."""
    problems = []
    for name in sorted(recorded)[rank::world]:
        expected, path = recorded[name], folder / name
        try:
            size = path.stat().st_size
            if size != expected["bytes"]:
                cut = "truncated: " if size < expected["bytes"] else ""
                problems.append(f"{path} is {cut}{size:,} bytes, recorded {expected['bytes']:,}")
            elif file_digest(path)[DIGEST] != expected[DIGEST]:
                problems.append(f"{path} does not match its recorded digest (damaged since saved)")
        except FileNotFoundError:
            problems.append(f"{path} is missing")
        except OSError as exc:
            problems.append(f"{path} cannot be read ({exc.strerror or exc})")
    return problems


def parse_record(path: Path) -> object:
    """A record's JSON; CacheError naming it where it does not parse (cut off, overwritten): a
    damaged record is damage, never a record from before digests."""
    try:
        return json.loads(path.read_bytes())
    except ValueError as exc:
        raise CacheError(f"{path} is damaged: it does not parse ({exc})") from None


def recorded_files(record: object, path: Path) -> dict[str, dict]:
    """The files a parsed record (at `path`) lists, each with its size and digest; CacheError
    naming `path` where any is not so."""
    files = record.get("files") if isinstance(record, dict) else None
    whole = (
        isinstance(files, dict)
        and record.get("digest") == DIGEST
        and all(
            isinstance(entry, dict)
            and isinstance(entry.get("bytes"), int)
            and isinstance(entry.get(DIGEST), str)
            for entry in files.values()
        )
    )
    if not whole:
        raise CacheError(f"{path} is damaged: it does not record each file's size and {DIGEST}")
    return files


def damage_summary(problems: list[str]) -> str:
    """The first problem, and how many more there are."""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return problems[0] + more
