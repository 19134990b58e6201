"""The switches whose `auto` depends on the device (and the student), resolved once per run into
one frozen record: what the trainer builds and steps with, what is saved with the run
(config.json, every checkpoint's checkpoint.json) and what a resume must match.

Each switch keeps its own `resolve_*` beside the component that reads it (attention, optimizer,
compile, loss, FSDP); this record only gathers their answers, so no resolved value is looked up
by a string key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from pipeline.models.layers import resolve_compile
from stage2_train.attention import resolve_attention
from stage2_train.config import TrainConfig
from stage2_train.forward import resolve_loss_kernel
from stage2_train.parallel import resolve_fsdp_param_dtype
from stage2_train.schedule import resolve_adamw_kernel

SAVED_PREFIX = "resolved_"  # each switch is saved as resolved_<option>


@dataclass(frozen=True)
class ResolvedKernels:
    attention: str
    adamw_kernel: str
    compile: str
    loss_kernel: str
    fsdp_param_dtype: str

    @classmethod
    def on(cls, config: TrainConfig, student: nn.Module, device: torch.device) -> ResolvedKernels:
        return cls(
            attention=resolve_attention(config.attention, device),
            adamw_kernel=resolve_adamw_kernel(config.adamw_kernel, device),
            compile=resolve_compile(config.compile, device),
            loss_kernel=resolve_loss_kernel(config, student, device),
            fsdp_param_dtype=resolve_fsdp_param_dtype(config, device),
        )

    def saved(self) -> dict[str, str]:
        """{"resolved_attention": "flex", ...}, as config.json and checkpoint.json hold it."""
        return {SAVED_PREFIX + name: value for name, value in dataclasses.asdict(self).items()}

    @classmethod
    def from_saved(cls, saved: dict) -> ResolvedKernels:
        """The record a run saved; a switch it predates counts as what every run used before."""
        return cls(**{name: saved.get(SAVED_PREFIX + name, BEFORE[name]) for name in BEFORE})

    def first_difference(self, other: ResolvedKernels) -> tuple[str, str, str] | None:
        """(option, ours, theirs) of the first switch that differs, or None."""
        for name, ours in dataclasses.asdict(self).items():
            if ours != getattr(other, name):
                return name, ours, getattr(other, name)
        return None


# What every run used before each switch existed: a checkpoint that lacks one was trained so.
BEFORE = {
    "attention": "dense",
    "adamw_kernel": "plain",
    "compile": "off",
    "loss_kernel": "plain",
    "fsdp_param_dtype": "float32",
}
