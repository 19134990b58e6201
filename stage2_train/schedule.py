"""The optimizer and its learning-rate schedule (stage 2's; the paper's TinyLlama continual
pretraining uses AdamW with a cosine decay, section 4)."""

from __future__ import annotations

import math

import torch
from torch import nn

from stage2_train.options import OptimizerOptions


def lr_at(step: int, options: OptimizerOptions) -> float:
    """Learning rate of optimizer step `step` (1-based): linear warmup, then cosine to min_lr."""
    warmup, lr, min_lr = options.warmup_steps, options.lr, options.min_lr
    if step <= warmup:
        return lr * step / warmup
    progress = (step - 1 - warmup) / max(1, options.max_steps - 1 - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def make_optimizer(model: nn.Module, options: OptimizerOptions, kernel: str) -> torch.optim.AdamW:
    """AdamW; matrices decay, norms and biases do not. `kernel` (stage2_train.resolve): fused is
    torch's one-launch kernel; plain leaves torch its default."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": options.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups,
        lr=options.lr,
        betas=(options.adam_beta1, options.adam_beta2),
        fused=True if kernel == "fused" else None,
    )
