"""Causal attention within documents only, for rows that hold several documents: the mask both
stages build from a row's segment ids (one id per document piece, 0 = padding).

- `document_mask`: a block-diagonal causal boolean mask [B, 1, T, T] (True = may attend), which
  transformers hands to SDPA as is; SDPA then leaves its flash kernel and computes the whole square.
- `document_block_mask`: the same mask as flex_attention's `BlockMask`; blocks outside every
  document are skipped and nothing of size T² is kept.

Both are built on the device from the segment ids, with no host sync. Stage 1 scores packed rows
with them (pipeline.scoring.hf, `--row-packing`), stage 2 trains on them (`--packing documents`).
"""

from __future__ import annotations

import torch

from pipeline.choices import compiles_on

FLEX = "flex_attention"  # transformers' name of the flex implementation


def document_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool: query i may attend to key j <= i of the same segment."""
    length = segment_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (same & causal)[:, None]


def document_block_mask(segment_ids: torch.Tensor):
    """The same mask as `document_mask`, as flex_attention's BlockMask. On a GPU its builder is
    compiled (`compiles_on`), which never materializes the T x T grid; like any compiled
    function, it compiles again for a new batch size until it has seen a size of 1 and two
    others."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(batch, head, query, key):
        return (segment_ids[batch, query] == segment_ids[batch, key]) & (key <= query)

    size, length = segment_ids.shape
    return create_block_mask(
        same_document_causal, size, None, length, length, segment_ids.device,
        _compile=compiles_on(segment_ids.device),
    )  # fmt: skip


def packed_inputs(
    model, ids: torch.Tensor, segments: torch.Tensor, positions: torch.Tensor
) -> dict[str, torch.Tensor]:
    """A transformers model's inputs for packed rows `ids`: each segment attends to itself only,
    from position 0, through the mask of the attention `model` is set to (flex or dense)."""
    flex = model.config._attn_implementation == FLEX
    mask = document_block_mask(segments) if flex else document_mask(segments)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
