"""A checkpoint is trusted only when it is whole: its COMPLETE marker, written last, records every
other file's size and digest, and a resume (or an export) checks them before any state is read.

The cache earns trust the same way (every shard hashed and verified before stage 2 reads it). A
bit flipped on disk, a bad copy between machines or an object store's partial object would
otherwise load without an error and train on for hours. Each rank hashes and checks an equal
share of the files (files[rank::world]) and the ranks exchange what they found, so the cost is
split across them. A marker from before digests were recorded holds only `step N`: such a
checkpoint is resumed unverified, with a warning.

The digest is XXH3-128 (`DIGEST`): the damage it guards against is accidental (a flipped bit, a
cut-off or bad copy), which a 128-bit hash catches with certainty for practical purposes, and it
reads at ~10 GB/s where SHA-256 reads at ~1 (benchmarks/bench_checkpoint_digest.py: resuming
reads every byte twice, so the hash's speed is the cost). The cache's shards keep SHA-256: their
digest is also their identity in the manifest's fingerprint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import xxhash

MARKER = "COMPLETE"
DIGEST = "xxh3_128"
READ_BYTES = 8 << 20  # per read while hashing


def checkpoint_files(folder: Path) -> list[str]:
    """The checkpoint's files other than its marker, as sorted paths relative to it."""
    names = [
        os.path.relpath(os.path.join(root, name), folder)
        for root, _, files in os.walk(folder)
        for name in files
    ]
    return sorted(name for name in names if name != MARKER)


def file_digest(path: Path) -> dict:
    digest, size = xxhash.xxh3_128(), 0
    buffer = memoryview(bytearray(READ_BYTES))  # one buffer read into, not a new one per read
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            digest.update(buffer[:count])
            size += count
    return {"bytes": size, DIGEST: digest.hexdigest()}


def digest_share(folder: Path, names: list[str], rank: int, world: int) -> dict[str, dict]:
    """Size and digest of this rank's share of `names`."""
    return {name: file_digest(folder / name) for name in names[rank::world]}


def marker_text(step: int, digests: dict[str, dict]) -> str:
    record = {"step": step, "digest": DIGEST, "files": dict(sorted(digests.items()))}
    return json.dumps(record, indent=1) + "\n"


def recorded_digests(folder: Path) -> dict[str, dict] | None:
    """The digests the marker records; None for a marker from before they were recorded."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except ValueError:
        return None
    return marker["files"] if isinstance(marker, dict) and "files" in marker else None


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


def damage_summary(problems: list[str]) -> str:
    """The first problem, and how many more there are."""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return problems[0] + more
