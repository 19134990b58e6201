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


def diverged(kept: list, step: int, loss: float, grad_norm: float) -> str:
    """The line a run stops with once its loss or gradient norm is NaN or infinite (`kept`: its
    complete checkpoints, (step, folder) oldest first)."""
    said = f"its checkpoints up to step {kept[-1][0]} are kept" if kept else "no checkpoint is kept"
    return (
        f"step {step}'s loss ({loss:.4g}) or gradient norm ({grad_norm:.4g}) is not finite: "
        f"stopped before saving it; {said} and no final/ is written. A lower --lr or a "
        "--grad-clip (in a new --out) may keep it finite"
    )


def no_target(step: int) -> str:
    """A completion-only step may hold no answer token: no loss to log, not a loss of 0."""
    return (
        f"stage 2: step {step} held no target token (--completion-only: no answer fell in its "
        "sequences); no loss logged for it"
    )


def step_record(step: int, tokens: int, lr: float, grad_norm: float, sums: tuple) -> dict:
    """A step's metrics from its sums (kept loss, all loss, kept, mapped, valid targets): a
    completion-only step may hold no answer token, which has no loss to log (None), not 0."""
    kept_loss, all_loss, kept, mapped, valid = sums
    targets = valid > 0
    return {
        "step": step,
        "loss": kept_loss / max(kept, 1) if targets else None,
        "loss_all": all_loss / valid if targets else None,
        "kept_fraction": kept / valid if targets else None,
        "mapped_fraction": mapped / valid if targets else None,
        "tokens": tokens,
        "lr": lr,
        "grad_norm": grad_norm,
    }
