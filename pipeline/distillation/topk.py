"""The teacher's cached top-k view (docs/cache-columns.md) given to each student token: the pairing
the logit distillations (ULD, KLD; docs/distillation.md) share.

Student token i is paired with the cached distribution at teacher position j = map_start[i], the
first teacher token of its aligned span, i.e. the teacher's p(. | text before token j). Token j
starts at or before token i (alignment by character offsets), so the teacher's context is the
student's context or a prefix of it: the teacher never saw a character of the text the student
is predicting. Under the identity alignment (one tokenizer, KLD) j is i itself, the exact
distribution the student's logits at i estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.cache.schema import TOPK_IDS, TOPK_PROBS, TOPK_REST
from pipeline.cross_entropy import IGNORE_INDEX
from pipeline.distillation import AlignedRead
from pipeline.head_outputs import HeadOutputs

# the extras' keys in a micro-batch: per student token, the paired teacher position's values
PROBS = "teacher_topk_probs"  # (tokens, K) float16, descending; NaN: no paired distribution
IDS = "teacher_topk_ids"  # (tokens, K) int32; -1 where PROBS is NaN
REST = "teacher_topk_rest"  # (tokens,) float16: the teacher's mass outside its top K


def paired_topk(read: AlignedRead, with_ids: bool) -> dict[str, np.ndarray]:
    """Per student token, the top-k columns of the teacher position that predicts the first
    teacher token of its span; NaN / -1 where the token is unmapped or that position unscored
    (a document's first teacher token): those tokens get the cross-entropy only."""
    first = read.map_start
    mapped = np.flatnonzero(first >= 0)
    probs = read.teacher_columns[TOPK_PROBS]
    out = {
        PROBS: np.full((first.size, probs.shape[1]), np.nan, dtype=np.float16),
        REST: np.full(first.size, np.nan, dtype=np.float16),
    }
    out[PROBS][mapped] = probs[first[mapped]]
    out[REST][mapped] = read.teacher_columns[TOPK_REST][first[mapped]]
    if with_ids:
        out[IDS] = np.full((first.size, probs.shape[1]), -1, dtype=np.int32)
        out[IDS][mapped] = read.teacher_columns[TOPK_IDS][first[mapped]]
    return out


def paired(labels: torch.Tensor, extras: dict[str, torch.Tensor]) -> torch.Tensor:
    """Where a distillation term is computed: valid targets with a paired teacher distribution."""
    return (labels != IGNORE_INDEX) & ~extras[PROBS][..., 0].isnan()


def teacher_side(
    extras: dict[str, torch.Tensor], where: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The paired top-k probabilities and rest in float32, zeros off `where` (so that no NaN
    reaches the arithmetic, whose gradient a later mask could not stop)."""
    probs = torch.where(where[..., None], extras[PROBS].float(), 0.0)
    return probs, torch.where(where, extras[REST].float(), 0.0)


@dataclass(frozen=True)
class PairedTopkTerm:
    """What ULD and KLD share (pipeline.distillation.Distillation): their extras are the paired
    top-k, their units the paired targets, their loss a per-token term summed over those units;
    each defines `per_token` and its cache columns (ids only when it lists them)."""

    vocabulary_subset = None  # (a class attribute, not a field) neither reads a subset's mass

    def extras(self, read: AlignedRead) -> dict[str, np.ndarray]:
        return paired_topk(read, with_ids=TOPK_IDS in self.cache_columns)

    def units(self, labels: torch.Tensor, extras: dict[str, torch.Tensor]) -> torch.Tensor:
        return paired(labels, extras).sum()

    def loss_sum(
        self, student: HeadOutputs, labels: torch.Tensor, extras: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        where = paired(labels, extras)  # paired tokens are targets, where log Z is exact
        probs, rest = teacher_side(extras, where)
        return torch.where(where, self.per_token(student, probs, rest, extras), 0.0).sum()

    def per_token(
        self,
        student: HeadOutputs,
        probs: torch.Tensor,
        rest: torch.Tensor,
        extras: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """The term at every position [...] (finite everywhere; masked by the caller) from what
        `reads` asked of the student."""
        raise NotImplementedError
