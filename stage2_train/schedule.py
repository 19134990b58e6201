"""The optimizer and its learning-rate schedule (stage 2's; the paper's TinyLlama continual
pretraining uses AdamW with a cosine decay, section 4)."""

from __future__ import annotations

import math

import torch
from torch import nn

from stage2_train.config import TrainConfig


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (1-based): linear warmup, then cosine to min_lr."""
    if step <= config.warmup_steps:
        return config.lr * step / config.warmup_steps
    progress = (step - 1 - config.warmup_steps) / max(1, config.max_steps - 1 - config.warmup_steps)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * progress))


def make_optimizer(model: nn.Module, config: TrainConfig, kernel: str) -> torch.optim.AdamW:
    """AdamW; matrices decay, norms and biases do not. `kernel` (stage2_train.resolve): fused is
    torch's one-launch kernel; plain leaves torch its default."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups,
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        fused=True if kernel == "fused" else None,
    )
