"""Both stages' `--compile layers`: each decoder layer of a transformers causal LM compiled in
place, so that its norms, RoPE and MLP fuse while the model's mask and head code around the
layers stays eager (no graph break per batch), and the state dict keeps its names."""

from __future__ import annotations

import torch
from torch import nn

from pipeline.choices import on_device
from pipeline.errors import ConfigError


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """A transformers causal LM's decoder layers (model.model.layers), or [] for another shape."""
    return list(getattr(getattr(model, "model", None), "layers", []))


def resolve_compile(choice: str, device: torch.device) -> str:
    """`layers` or `off` for `--compile` on `device`."""
    return on_device(choice, device, gpu="layers", cpu="off")


def compile_layers(model: nn.Module, choice: str, who: str) -> None:
    """torch.compile each of `who`'s decoder layers in place for `choice` `layers` (nothing for
    `off`); a size is made dynamic once it changes."""
    if choice == "off":
        return
    layers = decoder_layers(model)
    if not layers:
        raise ConfigError(
            f"--compile layers: {who} has no decoder layers at model.layers; use --compile off"
        )
    for layer in layers:
        layer.compile()


def eager_layers(model: nn.Module) -> None:
    """Undo `compile_layers`: each decoder layer runs its own forward again."""
    for layer in decoder_layers(model):
        layer._compiled_call_impl = None  # what nn.Module.compile sets
