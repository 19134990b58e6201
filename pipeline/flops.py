"""Model FLOP utilization (MFU): the one place that knows devices' peak FLOP/s.

MFU = model FLOPs per token x tokens/s / the device's peak dense bf16 FLOP/s, with the usual
approximation of model FLOPs per token: 6 N for a training step (forward 2 N + backward 4 N) and
2 N for a forward pass, N the number of parameters that take part in matrix products
(`flop_parameters`: the input embedding is a table lookup and is left out, unless it is tied to
the output head; the attention's quadratic term is left out). Stage 2's trainer writes it into
metrics.jsonl over the target tokens it trained on, and over every computed slot (padding and
re-read context included) beside it; benchmarks/bench_gpu.py prints it for both stages.

Peak figures are NVIDIA's datasheets, dense (no 2:4 sparsity) bf16 tensor-core FLOP/s: H100 SXM
989.4 TFLOP/s and H100 PCIe 756 (H100 Tensor Core GPU datasheet), H200 989.4 (H200 datasheet,
same compute as H100 SXM), A100 312 (A100 datasheet, SXM and PCIe). A device not listed has no
MFU (None), and neither has a CPU.
"""

from __future__ import annotations

import time

import torch
from torch import nn

# Matched in order against torch.cuda.get_device_name(): the first substring found wins.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100", 989.4e12),
    ("H200", 989.4e12),
    ("A100", 312e12),
)
TRAINING_FLOPS_PER_PARAMETER = 6  # forward + backward, per token
FORWARD_FLOPS_PER_PARAMETER = 2


def peak_flops(device_name: str | None) -> float | None:
    """Peak dense bf16 FLOP/s of a device by its name, or None when unknown."""
    if not device_name:
        return None
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return flops
    return None


def device_name(device: torch.device | str) -> str:
    """The accelerator's name ("NVIDIA H100 80GB HBM3"), or "cpu"."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def device_peak_flops(device: torch.device | str) -> float | None:
    """Peak dense bf16 FLOP/s of `device`; None on a CPU or a device not in the table."""
    device = torch.device(device)
    return peak_flops(device_name(device)) if device.type == "cuda" else None


def mfu(
    parameters: int, tokens_per_second: float, peak: float | None, *, training: bool = True
) -> float | None:
    """Model FLOP utilization: (6 or 2) x parameters x tokens/s over `peak`; None without a peak."""
    if peak is None or peak <= 0:
        return None
    per_token = TRAINING_FLOPS_PER_PARAMETER if training else FORWARD_FLOPS_PER_PARAMETER
    return per_token * parameters * tokens_per_second / peak


def flop_parameters(model: nn.Module) -> int:
    """N of the 6 N rule for a transformers causal LM: its parameters less the input embedding,
    whose lookup costs no FLOPs; a tied embedding is the output head's matrix and stays in."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    return total if head is not None and head.weight is embedding else total - embedding.numel()


# What `StepRate.fields` adds to a metrics record: wall-clock figures, which a resumed run
# cannot reproduce, unlike every other field.
RATE_FIELDS = ("tokens_per_second", "mfu", "slot_tokens_per_second", "slot_mfu")


class StepRate:
    """Tokens/s and MFU of each logged training step, by wall time since the previous call (or
    since construction): host arithmetic on numbers the caller already has, never a device sync."""

    def __init__(self, parameters: int, device: torch.device | str):
        self.parameters = parameters
        self.peak = device_peak_flops(device)
        self.last = time.monotonic()

    def leave_out(self, seconds: float) -> None:
        """Time spent between two steps on something else (a held-out evaluation) is no step's."""
        self.last += seconds

    def fields(self, tokens: int, slots: int) -> dict:
        """Per second since the previous call, with its MFU: `tokens`, the target tokens trained
        on (`tokens_per_second`, `mfu`), and `slots`, every position computed, padding and
        re-read context included (`slot_tokens_per_second`, `slot_mfu`)."""
        now = time.monotonic()
        seconds = max(now - self.last, 1e-9)
        self.last = now
        rate, slot_rate = tokens / seconds, slots / seconds
        values = (rate, mfu(self.parameters, rate, self.peak))
        values += (slot_rate, mfu(self.parameters, slot_rate, self.peak))
        return dict(zip(RATE_FIELDS, values, strict=True))
