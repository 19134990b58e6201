"""Reading the JSON-lines logs stage 2 appends to (metrics.jsonl, documents/rank-R.jsonl): one JSON
object per line, written and flushed a line at a time.

A run that stops mid-write (a crash, a kill, a time limit) or is read while it is still writing can
leave a partly written last line: that line is left out, with a warning. Any other unreadable line
means the file is damaged, not merely unfinished, and is an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import VocagnoError

METRICS_NAME = "metrics.jsonl"


@dataclass(frozen=True)
class JsonLinesLog:
    records: list[dict]
    line_numbers: list[int]  # of each record in the file, from 1 (for messages)
    data: bytes  # the bytes the records came from: the file less a partly written last line
    warning: str | None = None


def read_json_lines(path: Path) -> JsonLinesLog:
    """Every complete line of `path` as a dict; VocagnoError for a damaged line."""
    data = Path(path).read_bytes()
    lines = data.split(b"\n")
    records: list[dict] = []
    line_numbers: list[int] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError(f"a JSON {type(record).__name__}, not an object")
        except ValueError as exc:
            if not any(rest.strip() for rest in lines[number:]):
                warning = f"{path}: ignored unfinished last line {number} (run still writing?)"
                used = len(data) - len(b"\n".join(lines[number - 1 :]))
                return JsonLinesLog(records, line_numbers, data[:used], warning)
            raise VocagnoError(f"{path}: line {number} is not a JSON object: {exc}") from None
        records.append(record)
        line_numbers.append(number)
    return JsonLinesLog(records, line_numbers, data)
