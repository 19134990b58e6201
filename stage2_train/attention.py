"""Document-masked attention for context-true packing. A batch from `--packing documents` carries
`segment_ids` (one id per document piece, 0 = padding) and `position_ids` (restarting at 0 per
piece); the student then attends causally within a piece only, through a block-diagonal boolean
mask [B, 1, T, T] (True = may attend) that transformers passes to SDPA / eager attention as is.
The mask is built on the device from the segment ids: no host sync. A batch without segment ids
(`--packing stream`) runs as before: causal attention over the whole window.
"""

from __future__ import annotations

import torch
from torch import nn


def document_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool: query i may attend to key j <= i of the same segment."""
    length = segment_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (same & causal)[:, None]


def student_logits(model: nn.Module, batch: dict, device: torch.device) -> torch.Tensor:
    """The student's logits for a micro-batch, with the document mask when the batch has one."""
    inputs = batch["input_ids"].to(device, non_blocking=True)
    if "segment_ids" not in batch:
        return model(input_ids=inputs).logits
    segments = batch["segment_ids"].to(device, non_blocking=True)
    positions = batch["position_ids"].to(device, non_blocking=True)
    return model(
        input_ids=inputs, position_ids=positions, attention_mask=document_mask(segments)
    ).logits
