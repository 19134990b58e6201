"""A scorer's traffic with its device: inputs copied in from pinned memory without a wait,
columns copied out behind one event and read back when asked for, and the free memory that sizes
head chunks."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable

import numpy as np
import torch


def free_memory(device: torch.device) -> int:
    """Bytes free now: CUDA's free device memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device`: from pinned memory without a wait on a GPU."""
    tensor = torch.from_numpy(values)
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


class HostCopies:
    """A batch's columns on their way to host memory: on a GPU every copy is started at once (into
    pinned memory) and waited for once, by `arrays()`, on an event recorded behind them, so that
    the device may already run the next batch's work."""

    def __init__(self, columns: dict[str, torch.Tensor]):
        self.copies = {
            name: values.to("cpu", non_blocking=True) for name, values in columns.items()
        }
        self.done = None
        if any(values.is_cuda for values in columns.values()):
            self.done = torch.cuda.Event()
            self.done.record()

    def arrays(self) -> dict[str, np.ndarray]:
        if self.done is not None:
            self.done.synchronize()
        return {name: values.numpy() for name, values in self.copies.items()}


class QueuedColumns:
    """A scoring call's columns while its last batches may still be on the device: `collect()`
    waits for each batch in flight, `place`s its columns, and returns them all. A backend that
    returns only once it is done (vLLM's engine) has nothing in flight."""

    def __init__(
        self,
        columns: dict,
        in_flight: deque | None = None,
        place: Callable[..., None] | None = None,
    ):
        self.columns, self.in_flight, self.place = columns, in_flight or deque(), place

    def collect(self) -> dict:
        while self.in_flight:
            self.place(*self.in_flight.popleft())
        return self.columns
