"""A checkpoint is trusted only when it is whole: its COMPLETE marker, written last, records every
other file's size and digest (pipeline.file_digests), and a resume (or an export) checks them
before any state is read.

Each rank hashes and checks an equal share of the files (files[rank::world]) and the ranks
exchange what they found, so the cost is split across them. A marker from before digests were
recorded holds only `step N` and a newline: such a checkpoint is resumed unverified, with a
warning. Any other marker that does not parse, or does not list every file's digest, is damage (a
marker cut in half must not turn the check off).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pipeline.file_digests import DIGEST, folder_files, parse_record, recorded_files

MARKER = "COMPLETE"
PRE_DIGEST_MARKER = re.compile(rb"step [0-9]+\n")  # all a marker held before digests


def checkpoint_files(folder: Path) -> list[str]:
    """The checkpoint's files other than its marker, as sorted paths relative to it."""
    return folder_files(folder, leave_out=MARKER)


def marker_text(step: int, digests: dict[str, dict]) -> str:
    record = {"step": step, "digest": DIGEST, "files": dict(sorted(digests.items()))}
    return json.dumps(record, indent=1) + "\n"


def recorded_digests(folder: Path) -> dict[str, dict] | None:
    """The digests the marker records; None for a marker from before they were recorded;
    CacheError naming the marker where it is damaged."""
    marker = folder / MARKER
    if PRE_DIGEST_MARKER.fullmatch(marker.read_bytes()):
        return None
    return recorded_files(parse_record(marker), marker)
