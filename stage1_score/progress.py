"""Progress of a stage-1 run on the driver: documents and tokens per second, ETA, per worker."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

from pipeline.log import counted, get_logger
from stage1_score.units import WorkUnit
from stage1_score.worker import UnitResult

_log = get_logger("stage1")
UNSCORED_SHOWN = 5  # document ids a unit's warning names


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class Progress:
    """Counts planned, resumed and scored units; prints a line at most every `every` seconds.

    One rate: what this run scored over the time since scoring began (the first unit's start,
    not the process's: joining Ray and loading teachers would make it look slow), split by
    worker, so the workers' rates add up to the run's. The ETA extrapolates the corpus size from
    the share of its bytes read so far (exact for tables, close for JSON lines and text) and
    divides the documents left by that rate.

    Each line also says where the workers' devices spent the scoring so far (each unit's `device`,
    pipeline.scoring.device: DeviceTime): the share in batches, and the shares idle between a
    unit's batches and at units' edges (a worker's first unit has none). A device that idles
    waits for its host: for its work of a batch between batches; at the edges, for tokenizing,
    writing or the corpus's reading.

    A document with no scored teacher token is warned of by its unit and counted in the lines
    (this run's units; `vocagno cache stats` counts the whole cache's).
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
        self.run_unscored = 0  # documents this run scored that have no scored teacher token
        self.units_done = 0
        self.scoring_since: float | None = None  # when the first unit scored began
        self.worker_tokens: dict[int, int] = defaultdict(int)
        self.device_seconds: dict[str, float] = defaultdict(float)

    def planned(self, unit: WorkUnit) -> None:
        self.planned_docs += len(unit)

    def resumed(self, unit: WorkUnit) -> None:
        self.resumed_units += 1
        self.units_done += 1
        self.done_docs += len(unit)

    def scored(self, result: UnitResult) -> None:
        if self.scoring_since is None:
            self.scoring_since = time.monotonic() - result.seconds
        self.units_done += 1
        self.done_docs += result.shard.rows
        self.run_docs += result.shard.rows
        self.run_tokens += result.shard.teacher_tokens
        self.worker_tokens[result.worker] += result.shard.teacher_tokens
        if result.unscored:
            self.run_unscored += len(result.unscored)
            shown = ", ".join(map(repr, result.unscored[:UNSCORED_SHOWN]))
            more = len(result.unscored) - UNSCORED_SHOWN
            _log.warning(
                f"unit {result.shard.index}: {counted(len(result.unscored), 'document')} with no "
                f"scored teacher token ({shown}{f' and {more:,} more' if more > 0 else ''}): "
                "fewer than two teacher tokens, as the first has no prediction; stage 2 leaves "
                "their student tokens unmapped (--unmapped)"
            )
        device = result.device
        if device is not None:
            self.device_seconds["in batches"] += device["in_batches_s"]
            self.device_seconds["idle between batches"] += device["between_batches_s"]
            self.device_seconds["idle at units' edges"] += device["before_first_s"] or 0.0
        if time.monotonic() - self.last >= self.every:
            self.report()

    def report(self, final: bool = False) -> None:
        now = time.monotonic()
        self.last = now
        done = f"{counted(self.units_done, 'unit')} done"
        if self.resumed_units:
            done += f" ({self.resumed_units:,} from an earlier run)"
        parts = [done, counted(self.done_docs, "doc")]
        if self.run_unscored:
            parts[-1] += f" ({self.run_unscored:,} with no scored teacher token)"
        scoring = now - self.scoring_since if self.scoring_since is not None else 0.0
        if scoring:
            doc_rate = self.run_docs / scoring
            parts.append(f"{self.run_tokens / scoring:,.0f} tok/s, {doc_rate:,.1f} docs/s")
        if final:
            parts.append(f"finished in {_duration(now - self.started)}")
        else:
            fraction = self.fraction_read()
            parts.append(f"{fraction:.0%} of corpus read")
            if scoring and fraction > 0:
                left = self.planned_docs / fraction - self.done_docs
                parts.append(f"ETA {_duration(left / doc_rate)}")
        if scoring:
            rates = (
                f"w{w} {t / scoring:,.0f} tok/s" for w, t in sorted(self.worker_tokens.items())
            )
            parts.append(f"workers: {', '.join(rates)}")
        total = sum(self.device_seconds.values())
        if total > 0:
            shares = ", ".join(f"{t / total:.1%} {w}" for w, t in self.device_seconds.items())
            parts.append(f"device time: {shares}")
        self.emit(" | ".join(parts))
