"""Timing of work queued on a device: the host waits for the device before each clock read, so a
pass's time is the device's, not its launches'."""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(one_pass, repeats: int, device: torch.device) -> float:
    """Seconds of the fastest of `repeats` synchronized calls of `one_pass()`, after one warm-up
    call (what compiles on first use does so there), under inference mode."""
    with torch.inference_mode():
        one_pass()
        best = float("inf")
        for _ in range(repeats):
            synchronize(device)
            started = time.perf_counter()
            one_pass()
            synchronize(device)
            best = min(best, time.perf_counter() - started)
    return best
