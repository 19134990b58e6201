"""Peak memory as the benchmarks measure it: CUDA's allocator peak on a GPU; on a CPU the process's
resident high-water mark (resource.getrusage), which cannot be reset, so a CPU figure is the peak
since the process began (benchmarks that compare CPU peaks run each case in a fresh process)."""

from __future__ import annotations

import resource

import torch


def _resident_high_water() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def reset_peak(device: torch.device) -> None:
    """Start a new peak on a GPU (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def in_use(device: torch.device) -> int:
    """Bytes held now: allocated on a GPU; the high-water mark so far on a CPU."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else _resident_high_water()


def peak_memory(device: torch.device) -> int:
    """Bytes at the peak since `reset_peak` (a GPU) or since the process began (a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return _resident_high_water()
