"""Every device-dependent decision of a stage 2 run, made once by `resolve` before the student is
wrapped: what each switch's `auto` means on this device for this student, the refusals of a
choice the device or student cannot take, and the compute dtype. The record is what the run
builds and steps with, what is saved with it (config.json and every checkpoint's
checkpoint.json, as `resolved_<option>`) and what a resume must match
(stage2_train.checkpoint.check_resumable).

Decided elsewhere, because they follow the device and change nothing that is computed: the device
itself (stage2_train.distributed: the rank's GPU where there is one, with NCCL, else the CPU with
gloo), and the flex block mask's builder compiled on a GPU (pipeline.document_attention, both
stages' one mask).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from pipeline.choices import on_device
from pipeline.errors import ConfigError
from pipeline.models.layers import resolve_compile
from stage2_train.config import TrainConfig
from stage2_train.forward import chunked_loss_blocker
from stage2_train.options import ModelOptions

SAVED_PREFIX = "resolved_"  # each saved decision is resolved_<option>


@dataclass(frozen=True)
class Resolved:
    """One run's decisions; each but `pin_memory` is saved as resolved_<option>."""

    attention: str  # flex or dense (stage2_train.attention)
    adamw_kernel: str  # fused or plain (stage2_train.schedule)
    compile: str  # layers or off (pipeline.models.layers)
    loss_kernel: str  # chunked or plain (stage2_train.forward)
    fsdp_param_dtype: str  # bfloat16 or float32: what --fsdp gathers the parameters in
    dtype: str  # the forward pass's compute dtype: bfloat16 (autocast) or float32
    # page-locked batches for asynchronous copies to a GPU: how batches arrive, not what is
    # computed, so neither saved nor compared
    pin_memory: bool

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward pass's compute context: bfloat16 autocast on a GPU, or nothing."""
        if self.dtype == "bfloat16":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def saved(self) -> dict[str, str]:
        """{"resolved_attention": "flex", ...}, as config.json and checkpoint.json hold it."""
        return {SAVED_PREFIX + name: getattr(self, name) for name in SAVED}


def resolve(config: TrainConfig, device: torch.device, model: nn.Module) -> Resolved:
    """The run's decisions on `device` for the student `model` (before it is wrapped)."""
    kernels = config.kernels
    return Resolved(
        attention=resolve_attention(kernels.attention, device),
        adamw_kernel=on_device(kernels.adamw_kernel, device, gpu="fused", cpu="plain"),
        compile=resolve_compile(kernels.compile, device),
        loss_kernel=resolve_loss_kernel(kernels.loss_kernel, model, device),
        fsdp_param_dtype=resolve_fsdp_param_dtype(config.model, device),
        dtype=resolve_dtype(config.model.dtype, device),
        pin_memory=device.type == "cuda",
    )


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """What `--dtype` computes in on `device`: bfloat16 (autocast) or float32."""
    if dtype == "bfloat16" and device.type != "cuda":
        raise ConfigError("--dtype bfloat16 needs a GPU; on CPU use --dtype float32 (or auto)")
    return on_device(dtype, device, gpu="bfloat16", cpu="float32")


def resolve_attention(choice: str, device: torch.device) -> str:
    """`flex` or `dense` for `--attention` on `device`; flex training on a CPU is refused."""
    attention = on_device(choice, device, gpu="flex", cpu="dense")
    if attention == "flex" and device.type != "cuda":
        raise ConfigError(
            "--attention flex trains on a GPU only (PyTorch's flex_attention has no backward pass "
            "on the CPU): use --attention dense, or auto"
        )
    return attention


def resolve_loss_kernel(choice: str, student: nn.Module, device: torch.device) -> str:
    """`chunked` or `plain` for `--loss-kernel`; a chunked that cannot apply is refused."""
    blocker = chunked_loss_blocker(student)
    if choice == "chunked" and blocker:
        raise ConfigError(f"--loss-kernel chunked: {blocker}; use --loss-kernel plain")
    return on_device(choice, device, gpu="plain" if blocker else "chunked", cpu="plain")


def resolve_fsdp_param_dtype(options: ModelOptions, device: torch.device) -> str:
    """`bfloat16` or `float32` for `--fsdp-param-dtype`: auto follows the compute dtype (float32
    without --fsdp: the parameters as they are); an explicit bfloat16 without --fsdp is refused."""
    if not options.fsdp:
        if options.fsdp_param_dtype == "bfloat16":
            raise ConfigError(
                "--fsdp-param-dtype bfloat16 applies to --fsdp; add --fsdp or drop it"
            )
        return "float32"
    return on_device(
        options.fsdp_param_dtype, device, gpu=resolve_dtype(options.dtype, device), cpu="float32"
    )


SAVED = ("attention", "adamw_kernel", "compile", "loss_kernel", "fsdp_param_dtype", "dtype")
# What every run used before each switch existed: a checkpoint that lacks one was trained so. A
# checkpoint that does not record its compute dtype could have used either: not compared.
BEFORE = {
    "attention": "dense",
    "adamw_kernel": "plain",
    "compile": "off",
    "loss_kernel": "plain",
    "fsdp_param_dtype": "float32",
}


def first_difference(saved: dict, ours: dict) -> tuple[str, str, str] | None:
    """(option, saved value, ours) of the first decision a checkpoint's record (`saved`) took
    otherwise than this run's (`ours`, Resolved.saved() among the run's meta), or None."""
    for name in SAVED:
        used, now = (record.get(SAVED_PREFIX + name, BEFORE.get(name)) for record in (saved, ours))
        if used is not None and now is not None and used != now:
            return name, used, now
    return None
