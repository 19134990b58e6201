"""Optional views of the teacher's next-token distribution, computed from the logits chunk the
loss is computed from (pipeline.scoring.hf): no second forward pass, no extra full-vocabulary
tensor beyond one chunk, no per-token Python loop. Columns and conventions: docs/cache-columns.md.

For a scored position t (the distribution p = softmax(logits) that predicts token t, the one whose
-log p(token t) is `loss[t]`), in fp32 from the same logits as the loss:
  - topk_probs[t]: the K largest p(v), descending (torch.topk, so ties keep the lower id first);
  - topk_ids[t]:   their token ids;
  - topk_rest[t]:  1 - sum(topk_probs[t]), the mass outside the K (clamped at 0);
  - space_logprob[t]: log sum_{v in S} p(v) with S the space mask (pipeline.space_mask).
Unscored positions (token 0, and a one-token document) hold NaN probabilities and id -1 here; the
writer stores their top-k entries as nulls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.cache.schema import SPACE_LOGPROB, TOPK_IDS, TOPK_PROBS, TOPK_REST
from pipeline.cross_entropy import token_log_probs_and_loss

MAX_TOPK = 128


@dataclass(frozen=True)
class HeadExtras:
    """What to compute besides the loss: K (0: no top-k), whether to keep the ids, the space
    mask (bool numpy array over the head's outputs, or None)."""

    topk: int = 0
    topk_ids: bool = True
    space_mask: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.topk <= MAX_TOPK:
            raise ValueError(f"topk must be in 0..{MAX_TOPK}, not {self.topk}")

    @property
    def active(self) -> bool:
        return self.topk > 0 or self.space_mask is not None

    def columns(self) -> tuple[str, ...]:
        names = ()
        if self.topk:
            names = (TOPK_PROBS, TOPK_IDS, TOPK_REST) if self.topk_ids else (TOPK_PROBS, TOPK_REST)
        return names + ((SPACE_LOGPROB,) if self.space_mask is not None else ())


class ExtrasBuffer:
    """Device tensors of one batch's scored positions, filled a logits chunk at a time."""

    def __init__(self, extras: HeadExtras, rows: int, vocab_size: int, device: torch.device):
        self.extras = extras
        k = extras.topk
        self.out: dict[str, torch.Tensor] = {}
        if k:
            if k > vocab_size:
                raise ValueError(f"topk {k} exceeds the teacher's {vocab_size} outputs")
            self.out[TOPK_PROBS] = torch.empty(rows, k, dtype=torch.float32, device=device)
            self.out[TOPK_REST] = torch.empty(rows, dtype=torch.float32, device=device)
            if extras.topk_ids:
                self.out[TOPK_IDS] = torch.empty(rows, k, dtype=torch.int64, device=device)
        self.space = None
        if extras.space_mask is not None:
            if len(extras.space_mask) != vocab_size:
                raise ValueError(
                    f"space mask of {len(extras.space_mask)} ids for a head of {vocab_size}"
                )
            self.space = torch.from_numpy(extras.space_mask.astype(np.float32)).to(device)
            self.out[SPACE_LOGPROB] = torch.empty(rows, dtype=torch.float32, device=device)

    def fill(self, chunk: slice, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The chunk's extras from its logits; returns its loss against `targets`, bit for bit
        token_loss's, read from the same log-softmax (so no view adds a log-sum-exp)."""
        log_probs, loss = token_log_probs_and_loss(logits, targets)
        if self.extras.topk:
            values, ids = torch.topk(log_probs, self.extras.topk, dim=-1, sorted=True)
            probs = values.exp()
            self.out[TOPK_PROBS][chunk] = probs
            self.out[TOPK_REST][chunk] = (1.0 - probs.sum(dim=-1)).clamp_(min=0.0)
            if self.extras.topk_ids:
                self.out[TOPK_IDS][chunk] = ids
        if self.space is not None:
            # the mask's mass as one product with its indicator; a mass under fp32's smallest
            # normal (log p < -87.3) reads as that bound (docs/cache-columns.md)
            mass = log_probs.exp_() @ self.space
            tiny = torch.finfo(mass.dtype).tiny
            self.out[SPACE_LOGPROB][chunk] = mass.clamp_(tiny, 1.0).log_()
        return loss

    def numpy(self) -> dict[str, np.ndarray]:
        return {name: value.cpu().numpy() for name, value in self.out.items()}


def empty_columns(extras: HeadExtras, lengths: list[int]) -> dict[str, list[np.ndarray]]:
    """Per-document arrays of the extra columns, all unscored (NaN, id -1) to start with."""
    k = extras.topk
    shapes = {TOPK_PROBS: (k,), TOPK_IDS: (k,), TOPK_REST: (), SPACE_LOGPROB: ()}
    columns = {}
    for name in extras.columns():
        fill, dtype = (-1, np.int64) if name == TOPK_IDS else (np.nan, np.float32)
        columns[name] = [np.full((n, *shapes[name]), fill, dtype=dtype) for n in lengths]
    return columns
