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
- auto (default): flex on a GPU, dense elsewhere (stage2_train.resolve). The resolved choice is
  saved with the run.

Both are built on the device from the segment ids: no host sync. A batch without segment ids
(`--packing stream`) attends causally over the whole window either way.

Either kernel is reached through `CAST`'s wrapper, which hands it q, k and v in the autocast
dtype. Under bf16 autocast with float32 weights, q and k leave RoPE in float32 (its cos and sin
are float32) while v leaves its projection in bf16: SDPA is cast by autocast itself, flex only
where torch has an autocast rule for it (2.13 has, older ones may not: then float32 kernels or a
dtype error). The wrapper makes both kernels see what autocast would give them, on any version.

The student runs with `use_cache=False`: a DynamicCache built in a training forward makes each
compiled decoder layer guard on its own cache entry, one graph per layer until torch's
recompile limit leaves the rest eager.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.document_attention import FLEX, document_block_mask, document_mask
from pipeline.errors import ConfigError
from stage2_train.parallel import unwrapped

# transformers' kernel -> the same kernel behind the cast (registered by `use_attention`)
CAST = {FLEX: "vocagno_flex_attention", "sdpa": "vocagno_sdpa"}


def in_autocast_dtype(kernel):
    """transformers' attention function `kernel`, handed q, k and v in the autocast dtype."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        device = query.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        return kernel(module, query, key, value, attention_mask, **kwargs)

    return attention


def register_cast_kernels() -> None:
    """Register CAST's names with transformers: each kernel behind the cast, with its own masks."""
    from transformers.integrations.flex_attention import flex_attention_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import (
        AttentionMaskInterface,
        flex_attention_mask,
        sdpa_mask,
    )
    from transformers.modeling_utils import AttentionInterface

    kernels = {FLEX: (flex_attention_forward, flex_attention_mask),
               "sdpa": (sdpa_attention_forward, sdpa_mask)}  # fmt: skip
    for name, (kernel, mask) in kernels.items():
        AttentionInterface.register(CAST[name], in_autocast_dtype(kernel))
        AttentionMaskInterface.register(CAST[name], mask)


def use_attention(model: nn.Module, attention: str) -> None:
    """Switch the student to `attention`'s kernel behind the cast (before it is wrapped or
    compiled); a student on another kernel than SDPA (eager) keeps it for dense."""
    register_cast_kernels()
    current = model.config._attn_implementation
    if attention == "dense":
        if current == "sdpa":
            model.set_attn_implementation(CAST["sdpa"])
        return
    try:
        model.set_attn_implementation(CAST[FLEX])
    except (ValueError, ImportError) as exc:  # an architecture transformers has no flex path for
        raise ConfigError(f"--attention flex: {exc}; use --attention dense") from None


def model_inputs(model: nn.Module, batch: dict, device: torch.device) -> dict:
    """The student's inputs for a micro-batch on `device`, no cache: with the document mask its
    attention takes, and restarted positions, when the batch has segment ids."""
    inputs = {"input_ids": batch["input_ids"].to(device, non_blocking=True), "use_cache": False}
    if "segment_ids" not in batch:
        return inputs
    segments = batch["segment_ids"].to(device, non_blocking=True)
    flex = unwrapped(model).config._attn_implementation in (FLEX, CAST[FLEX])
    return {
        **inputs,
        "position_ids": batch["position_ids"].to(device, non_blocking=True),
        "attention_mask": document_block_mask(segments) if flex else document_mask(segments),
    }


def student_logits(model: nn.Module, batch: dict, device: torch.device) -> torch.Tensor:
    """The student's logits for a micro-batch."""
    return model(**model_inputs(model, batch, device)).logits
