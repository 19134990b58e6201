"""Document-masked attention for context-true packing. A batch from `--packing documents` carries
`segment_ids` (one id per document piece, 0 = padding) and `position_ids` (restarting at 0 per
piece); the student then attends causally within a piece only (pipeline.document_attention).
`--attention` says how:

- dense: a block-diagonal boolean mask [B, 1, T, T] (True = may attend), which transformers hands
  to SDPA as is. SDPA then leaves its flash kernel, computes the whole square and keeps the mask
  for the backward pass in every layer: memory that grows with T².
- flex: PyTorch's `flex_attention` with a `BlockMask` built once per micro-batch from the segment
  ids: blocks outside every document are skipped, nothing of size T² is kept. PyTorch has no flex
  backward pass on the CPU, so training with it needs a GPU; its forward runs (compiled) on the
  CPU, where tests prove it equal to the dense path.
- auto (default): flex on a GPU, dense elsewhere. The resolved choice is saved with the run.

Both are built on the device from the segment ids: no host sync. A batch without segment ids
(`--packing stream`) attends causally over the whole window either way.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.choices import on_device
from pipeline.document_attention import FLEX, document_block_mask, document_mask
from pipeline.errors import ConfigError
from stage2_train.parallel import unwrapped


def resolve_attention(choice: str, device: torch.device) -> str:
    """`flex` or `dense` for `--attention` on `device`; flex training on a CPU is refused."""
    attention = on_device(choice, device, gpu="flex", cpu="dense")
    if attention == "flex" and device.type != "cuda":
        raise ConfigError(
            "--attention flex trains on a GPU only (PyTorch's flex_attention has no backward pass "
            "on the CPU): use --attention dense, or auto"
        )
    return attention


def use_attention(model: nn.Module, attention: str) -> None:
    """Switch the student to flex attention when asked (before it is wrapped or compiled)."""
    if attention != "flex":
        return
    try:
        model.set_attn_implementation(FLEX)
    except (ValueError, ImportError) as exc:  # an architecture transformers has no flex path for
        raise ConfigError(f"--attention flex: {exc}; use --attention dense") from None


def model_inputs(model: nn.Module, batch: dict, device: torch.device) -> dict:
    """The student's inputs for a micro-batch on `device`: with the document mask its attention
    takes, and restarted positions, when the batch has segment ids."""
    inputs = {"input_ids": batch["input_ids"].to(device, non_blocking=True)}
    if "segment_ids" not in batch:
        return inputs
    segments = batch["segment_ids"].to(device, non_blocking=True)
    flex = unwrapped(model).config._attn_implementation == FLEX
    return {
        **inputs,
        "position_ids": batch["position_ids"].to(device, non_blocking=True),
        "attention_mask": document_block_mask(segments) if flex else document_mask(segments),
    }


def student_logits(model: nn.Module, batch: dict, device: torch.device) -> torch.Tensor:
    """The student's logits for a micro-batch."""
    return model(**model_inputs(model, batch, device)).logits
