"""Timing every benchmark shares: wall and CPU time side by side, the table rule, the load line.

Wall time is what a user waits for; CPU time (all threads of this process) is the steadier figure
on a machine others share, so the benchmarks report both.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class Elapsed:
    wall: float = 0.0
    cpu: float = 0.0


@contextlib.contextmanager
def measure(into: Elapsed | None = None) -> Iterator[Elapsed]:
    """Time the block; its seconds are added to `into` (to sum many blocks) or a fresh Elapsed."""
    elapsed = Elapsed() if into is None else into
    wall_begin, cpu_begin = time.perf_counter(), time.process_time()
    yield elapsed
    elapsed.cpu += time.process_time() - cpu_begin
    elapsed.wall += time.perf_counter() - wall_begin


def interleaved_times(
    repeats: int, tasks: dict[str, tuple[Callable[..., Any], ...]]
) -> dict[str, list[Elapsed]]:
    """Every timing of each task `name: (fn, *args)`, running them in turn so that each round's
    timings saw about the same load."""
    times: dict[str, list[Elapsed]] = {name: [] for name in tasks}
    for _ in range(repeats):
        for name, (fn, *args) in tasks.items():
            with measure() as took:
                fn(*args)
            times[name].append(took)
    return times


def interleaved_best_times(
    repeats: int, tasks: dict[str, tuple[Callable[..., Any], ...]]
) -> tuple[dict[str, float], dict[str, float]]:
    """Best (wall, CPU) time of each task `name: (fn, *args)`, running them in turn so all see
    the same load."""
    return best_times(interleaved_times(repeats, tasks))


def best_times(times: dict[str, list[Elapsed]]) -> tuple[dict[str, float], dict[str, float]]:
    """The best (wall, CPU) time of each task's timings."""
    wall = {name: min(t.wall for t in took) for name, took in times.items()}
    cpu = {name: min(t.cpu for t in took) for name, took in times.items()}
    return wall, cpu


def print_header(header: str) -> None:
    """A table's header and a rule as wide as its first line."""
    print(header)
    print("-" * len(header.splitlines()[0]))


def print_load_average() -> None:
    # Other work on the machine moves the figures; the load says how much to trust them.
    print(
        f"load average (1, 5, 15 min) at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
