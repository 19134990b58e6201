"""A trace of a block's work in Chrome's trace format (torch.profiler: the host's ops and, on a
GPU, the device's kernels and copies), to see where the device waits for the host; open it in
Perfetto (ui.perfetto.dev) or chrome://tracing. Stage 1 traces one unit's scoring with it
(`--profile-unit`)."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Trace:
    """The trace's bytes once the block has ended; None where tracing was off."""

    data: bytes | None = None


@contextlib.contextmanager
def traced(enabled: bool) -> Iterator[Trace]:
    """Trace the block where `enabled` (else run it as it is)."""
    trace = Trace()
    if not enabled:
        yield trace
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as profiler:
        yield trace
    with tempfile.TemporaryDirectory() as folder:  # the exporter writes only to a path
        path = Path(folder) / "trace.json"
        profiler.export_chrome_trace(str(path))
        trace.data = path.read_bytes()
