"""The run's append-only logs (metrics.jsonl, the per-rank document logs), cut back on resume."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pipeline.io import atomic_write_text
from pipeline.metrics import read_json_lines


class JsonLines:
    """An append-only JSON-lines log that a resumed run cuts back to the checkpoint's step."""

    def __init__(self, path: Path, keep_up_to_step: int):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if path.exists():  # a torn last line (the run was killed mid-write) is dropped too
            log = read_json_lines(path)
            kept = [r for r in log.records if r["step"] <= keep_up_to_step]
            if log.warning:
                print(f"stage 2: {repair_note(path, kept, keep_up_to_step)}", file=sys.stderr)
        atomic_write_text(path, "".join(json.dumps(record) + "\n" for record in kept))
        self.handle = path.open("a")

    def append(self, record: dict) -> None:
        self.handle.write(json.dumps(record) + "\n")
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


def repair_note(path: Path, kept: list[dict], up_to_step: int) -> str:
    """What a resume says of a log whose last line was cut off: what it keeps, what is lost."""
    steps = {record["step"] for record in kept}
    lost = [step for step in range(1, up_to_step + 1) if step not in steps]
    said = f"{path}: its last line was cut off and is dropped; kept the records of steps up to "
    said += f"{max(steps, default=0)}"
    if lost:
        shown = ", ".join(map(str, lost[:5])) + (" ..." if len(lost) > 5 else "")
        said += f"; no record of step {shown} (trained, not logged)"
    return said
