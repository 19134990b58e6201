"""Progress of a stage-1 run on the driver: documents and tokens per second, ETA, per worker."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

from pipeline.log import get_logger
from stage1_score.units import WorkUnit
from stage1_score.worker import UnitResult

_log = get_logger("stage1")


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class Progress:
    """Counts planned, resumed and scored units; prints a line at most every `every` seconds.

    The ETA extrapolates the corpus size from the share of its bytes read so far (exact for
    tables, close for JSON lines and text) and divides what is left by this run's document rate.
    """

    def __init__(self, fraction_read: Callable[[], float], every: float, emit=None):
        self.fraction_read = fraction_read
        self.every = every
        self.emit = emit or _log.info
        self.started = time.monotonic()
        self.last = self.started
        self.planned_docs = 0
        self.done_docs = 0
        self.resumed_units = 0
        self.run_docs = 0
        self.run_tokens = 0
        self.units_done = 0
        self.worker_tokens: dict[int, int] = defaultdict(int)
        self.worker_seconds: dict[int, float] = defaultdict(float)

    def planned(self, unit: WorkUnit) -> None:
        self.planned_docs += len(unit)

    def resumed(self, unit: WorkUnit) -> None:
        self.resumed_units += 1
        self.units_done += 1
        self.done_docs += len(unit)

    def scored(self, result: UnitResult) -> None:
        self.units_done += 1
        self.done_docs += result.shard.rows
        self.run_docs += result.shard.rows
        self.run_tokens += result.shard.teacher_tokens
        self.worker_tokens[result.worker] += result.shard.teacher_tokens
        self.worker_seconds[result.worker] += result.seconds
        if time.monotonic() - self.last >= self.every:
            self.report()

    def report(self, final: bool = False) -> None:
        now = time.monotonic()
        self.last = now
        elapsed = max(now - self.started, 1e-9)
        fraction = self.fraction_read()
        estimated_docs = self.planned_docs / fraction if fraction > 0 else float("nan")
        doc_rate = self.run_docs / elapsed
        eta = (estimated_docs - self.done_docs) / doc_rate if doc_rate > 0 else float("nan")
        workers = ", ".join(
            f"w{w} {self.worker_tokens[w] / max(self.worker_seconds[w], 1e-9):,.0f} tok/s"
            for w in sorted(self.worker_tokens)
        )
        parts = [
            f"{self.units_done} units done ({self.resumed_units} from an earlier run)",
            f"{self.done_docs:,} docs",
            f"{self.run_tokens / elapsed:,.0f} tok/s, {doc_rate:,.1f} docs/s this run",
        ]
        if final:
            parts.append(f"finished in {_duration(elapsed)}")
        else:
            parts.append(f"{fraction:.0%} of corpus read")
            if eta == eta:  # not NaN
                parts.append(f"ETA {_duration(eta)}")
        if workers:
            parts.append(f"workers: {workers}")
        self.emit(" | ".join(parts))
