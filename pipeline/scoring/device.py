"""A scorer's traffic with its device: inputs copied in from pinned memory without a wait,
columns copied out behind one event and read back when asked for, where the device's time went
(events on its stream), and the free memory that sizes head chunks."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

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


class HostEvent:
    """A timing event's stand-in on a CPU, whose work runs as it is launched: the host's clock
    when it is recorded."""

    def __init__(self):
        self.time = time.monotonic()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: HostEvent) -> float:
        return (end.time - self.time) * 1000


def device_event(device: torch.device) -> torch.cuda.Event | HostEvent:
    """A timing event behind the work queued on `device` so far (on a GPU, its current stream's).
    Waiting for it or reading its time is the host's business: recording it waits for nothing."""
    if device.type != "cuda":
        return HostEvent()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class QueuedBatch:
    """A batch on its way through the device, made before its first input copy and given its
    columns by `copy`: on a GPU every column's copy to host memory is started at once (into
    pinned memory) and waited for once, by `arrays()`, on an event recorded behind them (`done`),
    so that the device may already run the next batch's work. Its events time it
    (`DeviceTime.add`): `started`, recorded when it is made, and `previous`, the one behind the
    batch queued before it (None: none yet)."""

    def __init__(self, device: torch.device, previous: torch.cuda.Event | HostEvent | None):
        self.device, self.previous = device, previous
        self.started = device_event(device)
        self.copies: dict[str, torch.Tensor] = {}
        self.done = None

    def copy(self, columns: dict[str, torch.Tensor]) -> None:
        self.copies = {
            name: values.to("cpu", non_blocking=True) for name, values in columns.items()
        }
        self.done = device_event(self.device)

    def arrays(self) -> dict[str, np.ndarray]:
        self.done.synchronize()
        return {name: values.numpy() for name, values in self.copies.items()}


@dataclass
class DeviceTime:
    """Where a scoring call's time on its device went, from events on the device's stream: the
    seconds from each batch's first input copy to its columns' copies (`in_batches`: the work,
    and any wait for the host's launches inside a batch), the seconds the device idled between
    the call's batches, waiting for the host to queue the next one (`between_batches`), and
    before its first batch since the previous call's last (`before_first`: a unit's edge; None
    for the first call after the scorer's warm-up)."""

    batches: int = 0
    in_batches: float = 0.0
    between_batches: float = 0.0
    before_first: float | None = None

    def add(self, batch: QueuedBatch) -> None:
        """A batch read back (its events done)."""
        previous, started = batch.previous, batch.started
        idle = None if previous is None else previous.elapsed_time(started) / 1000
        if self.batches:
            self.between_batches += idle
        else:
            self.before_first = idle
        self.in_batches += started.elapsed_time(batch.done) / 1000
        self.batches += 1

    def record(self) -> dict:
        """As stage1-run.json records it, a unit's `device`."""
        before = None if self.before_first is None else round(self.before_first, 4)
        return {
            "batches": self.batches,
            "in_batches_s": round(self.in_batches, 4),
            "between_batches_s": round(self.between_batches, 4),
            "before_first_s": before,
        }


class QueuedColumns:
    """A scoring call's columns while its last batches may still be on the device: `collect()`
    waits for each batch in flight, `place`s its columns, and returns them all. A backend that
    returns only once it is done (vLLM's engine) has nothing in flight."""

    def __init__(
        self,
        columns: dict,
        in_flight: deque | None = None,
        place: Callable[..., None] | None = None,
        device_time: DeviceTime | None = None,
    ):
        self.columns, self.in_flight, self.place = columns, in_flight or deque(), place
        self.device_time = device_time  # complete once collected; None from vLLM's engine

    def collect(self) -> dict:
        while self.in_flight:
            self.place(*self.in_flight.popleft())
        return self.columns
