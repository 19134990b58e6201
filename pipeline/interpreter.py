"""The Python interpreter's lock hand-over in a process whose one thread feeds a GPU while its
other threads work in Python beside it (stage 1's worker under `--unit-overlap`: one unit scored
while another is tokenized and a third's shard is built).

Every kernel launch (a torch operator, a Triton kernel) releases the interpreter's lock (the GIL)
and takes it back. A thread waiting for the lock asks its holder to drop it only after
`sys.getswitchinterval()` (5 ms by default), so while another thread runs Python the launching
thread gets about one launch per interval (the convoy effect, CPython issue bpo-7946).
`--interpreter tuned` shortens the interval to `SWITCH_INTERVAL_S`; `default` leaves Python's own.
Neither changes what is computed.

Not a default: on a CPU, `benchmarks/bench_stage1_interpreter.py` found `tuned` shortens a
launching thread's waits beside the worker's real tokenizing and writing without raising its
launch rate, and its longest wait either way far below a GPU batch of the smallest teacher measured
(docs/stage1-gpu-path.md); `benchmarks/bench_gpu.py`'s `stage 1 tuned interpreter` row measures
the job on a GPU.
"""

from __future__ import annotations

import sys

# The lock's hand-over interval under `tuned`: a launching thread waits at most about this long.
SWITCH_INTERVAL_S = 1e-4


def tune_interpreter(mode: str) -> dict:
    """Apply `mode` (`tuned` or `default`) to this process; returns what it now runs with, for
    the run's record."""
    if mode == "tuned":
        sys.setswitchinterval(SWITCH_INTERVAL_S)
    # CPython keeps the interval in whole microseconds (1e-4 reads back as 9.999...e-05)
    return {"interpreter": mode, "switch_interval_s": round(sys.getswitchinterval(), 6)}
