"""Where a traced unit's device waited, and for what: the gaps between the device's work in a
torch.profiler trace (Chrome's format, as `--profile-unit` and `bench_gpu.py --profile-dir` write
them), each put down to what the host thread that launched the work ending it was doing.

    python benchmarks/trace_gaps.py TRACE.json [TRACE.json ...] [--min-gap-ms MS] [--longest N]

The device's work is its kernels, copies and memsets on every stream, merged into one busy
timeline over the span from the first to the last. Each gap of at least `--min-gap-ms` in it ends
with some work, whose CUDA runtime or driver call (the launch) carries the same correlation id.
A gap is put down to the first of:

- the launch itself, where it began before the gap and returned after it began: the call
  blocked across it (a copy from pageable memory waits for its stream);
- `queued before the gap`: the launch had returned before the device went idle, so the host was
  not late; the work waited on the device (another stream, an event);
- a runtime or driver call on the launching thread covering at least half the time from the
  gap's start to the launch: the host waited there (a synchronize, an allocation);
- the innermost operator (cpu_op, user_annotation) on that thread covering at least half of it:
  the host was computing that;
- `untraced`: Python the profiler does not record, on the launching thread, or another thread
  holding the interpreter's lock.

A trace without device work (a CPU's) says so in one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
HOST_CATEGORIES = frozenset({"cpu_op", "user_annotation"})
QUEUED = "queued before the gap"
UNTRACED = "untraced (Python, or the interpreter's lock)"
UNLAUNCHED = "launch not in the trace"
MIN_GAP_MS = 0.1
# the share of the host's lateness a call or operator must cover to be named its cause
COVERED = 0.5


@dataclass(frozen=True)
class Gap:
    start: float  # microseconds, the trace's clock
    end: float
    cause: str


@dataclass(frozen=True)
class DeviceGaps:
    start: float  # the first device work's start, microseconds
    span: float  # from it to the last work's end
    busy: float  # the union of the device's work within the span
    gaps: list[Gap]

    def by_cause(self) -> list[tuple[str, int, float, float]]:
        """(cause, gaps, their total microseconds, the longest), the largest total first."""
        grouped: dict[str, list[float]] = defaultdict(list)
        for gap in self.gaps:
            grouped[gap.cause].append(gap.end - gap.start)
        rows = [(c, len(d), sum(d), max(d)) for c, d in grouped.items()]
        return sorted(rows, key=lambda row: -row[2])


class _Thread:
    """One host thread's timed events, as arrays for the interval queries a gap makes."""

    def __init__(self, events: list[dict]):
        self.names = [str(event.get("name")) for event in events]
        self.launch = np.array([event.get("cat") in LAUNCH_CATEGORIES for event in events], bool)
        self.start = np.array([event["ts"] for event in events], float)
        self.end = self.start + np.array([event["dur"] for event in events], float)

    def cause(self, begin: float, launched: float) -> str:
        """What covered [begin, launched) on this thread: a runtime call, else the innermost
        operator, else nothing the profiler records."""
        overlap = np.minimum(self.end, launched) - np.maximum(self.start, begin)
        covering = overlap >= COVERED * (launched - begin)
        for kind in (covering & self.launch, covering & ~self.launch):
            if kind.any():
                inner = np.flatnonzero(kind)[np.argmin((self.end - self.start)[kind])]
                return self.names[inner]
        return UNTRACED


def timed_events(trace: dict) -> list[dict]:
    """The trace's complete events (`ph` X) with a start and a duration."""
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ValueError("not a Chrome trace: no traceEvents list")
    return [
        e for e in events
        if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e and "dur" in e
    ]  # fmt: skip


def device_gaps(trace: dict, min_gap_ms: float = MIN_GAP_MS) -> DeviceGaps | None:
    """The device's gaps of at least `min_gap_ms` and their causes; None without device work."""
    events = timed_events(trace)
    work = sorted(
        (e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: float(e["ts"])
    )
    if not work:
        return None
    launches = {
        _correlation(e): e
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and _correlation(e) is not None
    }
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for event in events:
        if event.get("cat") in LAUNCH_CATEGORIES | HOST_CATEGORIES:
            by_thread[(event.get("pid"), event.get("tid"))].append(event)
    threads: dict[tuple, _Thread] = {}
    first, busy, gaps = float(work[0]["ts"]), 0.0, []
    run_start = run_end = first
    for event in work:
        start, end = float(event["ts"]), float(event["ts"]) + float(event["dur"])
        if start - run_end >= min_gap_ms * 1e3:
            gaps.append(Gap(run_end, start, _cause(run_end, event, launches, by_thread, threads)))
        if start > run_end:
            busy += run_end - run_start
            run_start = start
        run_end = max(run_end, end)
    busy += run_end - run_start
    return DeviceGaps(first, run_end - first, busy, gaps)


def _correlation(event: dict):
    args = event.get("args")
    return args.get("correlation") if isinstance(args, dict) else None


def _cause(begin: float, work: dict, launches: dict, by_thread: dict, threads: dict) -> str:
    launch = launches.get(_correlation(work))
    if launch is None:
        return UNLAUNCHED
    launched = float(launch["ts"])
    if launched < begin:
        return str(launch.get("name")) if launched + float(launch["dur"]) > begin else QUEUED
    key = (launch.get("pid"), launch.get("tid"))
    if key not in threads:
        threads[key] = _Thread(by_thread[key])
    return threads[key].cause(begin, launched)


def summary(gaps: DeviceGaps | None, causes: int = 4) -> str:
    """One line: the device's busy share of its span, its gaps, and their largest causes."""
    if gaps is None:
        return "no device work in the trace (traced on a CPU?)"
    total = sum(gap.end - gap.start for gap in gaps.gaps)
    line = (
        f"device busy {gaps.busy / max(gaps.span, 1e-9):.1%} of {gaps.span / 1e3:,.1f} ms; "
        f"{len(gaps.gaps)} gaps, {total / 1e3:,.1f} ms"
    )
    rows = gaps.by_cause()
    parts = [
        f"{cause} {count} ({seconds / 1e3:,.1f} ms, longest {longest / 1e3:,.2f})"
        for cause, count, seconds, longest in rows[:causes]
    ]
    if len(rows) > causes:
        parts.append(f"{len(rows) - causes} other causes")
    return line + (": " + "; ".join(parts) if parts else "")


def read_trace(path: Path) -> dict:
    with open(path, "rb") as handle:
        return json.load(handle)


def describe_trace(path: Path, min_gap_ms: float = MIN_GAP_MS) -> str:
    """`summary` of the trace at `path`."""
    return summary(device_gaps(read_trace(path), min_gap_ms))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path, help="Chrome-trace JSON files")
    parser.add_argument(
        "--min-gap-ms", type=float, default=MIN_GAP_MS,
        help=f"the shortest idle time counted as a gap (default {MIN_GAP_MS})",
    )  # fmt: skip
    parser.add_argument(
        "--longest", type=int, default=0,
        help="also list this many longest gaps, in ms from the first device work",
    )  # fmt: skip
    args = parser.parse_args(argv)
    for path in args.traces:
        try:
            gaps = device_gaps(read_trace(path), args.min_gap_ms)
        except (OSError, ValueError) as exc:  # json's errors are ValueErrors
            print(f"trace_gaps: {path}: {exc}", file=sys.stderr)
            return 2
        print(f"{path.name}: {summary(gaps)}")
        longest = sorted(gaps.gaps if gaps else [], key=lambda g: g.start - g.end)
        for gap in longest[: args.longest]:
            at = (gap.start - gaps.start) / 1e3
            print(f"  at {at:,.2f} ms: {(gap.end - gap.start) / 1e3:,.2f} ms, {gap.cause}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
