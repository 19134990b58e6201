"""Distillation objectives trained from the cache: cross-entropy on every token plus a term that
needs more of the teacher than one loss per token (the paper's logit-distillation baselines,
Table 1 and appendix B, and ALM). Each is a `Distillation`: which cache columns it reads, what it
gives every student token from one read (`extras`, built in the data path with the alignment
already computed), what it reads of the student's distribution (`reads`: never the whole logits,
so that `--loss-kernel chunked` can serve it), and its loss from those and the extras.

The data path carries each extra beside the teacher loss: extras are *target-aligned* (value i
belongs to student token i as a prediction target, like `teacher_loss`), so in a micro-batch the
extra at slot s sits beside the logits at slot s that predict that token. Padding slots hold
`fill_value(dtype)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from pipeline.head_outputs import HeadOutputs, HeadReads


@dataclass(frozen=True)
class AlignedRead:
    """One read of the cache, tokenized by the student and aligned, documents concatenated: what
    a distillation builds its per-student-token extras from (no per-token Python loop)."""

    student_ids: np.ndarray  # int32
    student_start: np.ndarray  # int64 character offsets within each document's text
    student_end: np.ndarray
    student_lengths: np.ndarray  # int64 tokens per document
    teacher_start: np.ndarray
    teacher_end: np.ndarray
    teacher_lengths: np.ndarray
    teacher_loss: np.ndarray  # float32 per teacher token (NaN = unscored: a document's first)
    text_lengths: np.ndarray  # int64 characters per document
    map_start: np.ndarray  # per student token, inclusive teacher range (-1 = unmapped)
    map_end: np.ndarray
    # the distillation's cache_columns, per teacher token: (tokens,) or (tokens, K)
    # (pipeline.cache.rows.token_values)
    teacher_columns: dict[str, np.ndarray]


class Distillation(Protocol):
    """One distillation objective (frozen dataclass: it travels to data-loader workers)."""

    name: str
    cache_columns: tuple[str, ...]  # list columns read beside the loss path's columns
    extra_names: tuple[str, ...]  # the keys `extras` returns (each a key of the micro-batch)
    weight: float  # the term's weight beside the cross-entropy (its mean over units is logged)
    # bool [V] or None: the vocabulary subset whose log-probability the term reads at every slot
    # (ALM's student space mask); on the device once per run (`vocabulary_subset_on`)
    vocabulary_subset: np.ndarray | None

    def extras(self, read: AlignedRead) -> dict[str, np.ndarray]:
        """Per student token (first axis = read.student_ids.size), target-aligned."""

    def units(self, labels: torch.Tensor, extras: dict[str, torch.Tensor]) -> torch.Tensor:
        """How many terms this micro-batch adds to the step's distillation mean (0-dim int64;
        float64 for several teachers' weighted units, pipeline.distillation.teachers), from the
        data alone, so a step's denominator is known before any forward pass."""

    def reads(self, extras: dict[str, torch.Tensor], subset: torch.Tensor | None) -> HeadReads:
        """What `loss_sum` reads of the student's distribution in this micro-batch; `subset` is
        `vocabulary_subset_on(self)`."""

    def loss_sum(
        self, student: HeadOutputs, labels: torch.Tensor, extras: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The distillation term summed over this micro-batch's units (0-dim, with gradient),
        before `weight`; the trainer divides the step's sum by the step's units (all ranks).
        `student` holds the trainer's per-token cross-entropy and what `reads` asked for, from
        the one pass over the vocabulary that computes the cross-entropy."""


def fill_value(dtype: np.dtype):
    """What a padding slot of an extra holds: NaN for floats, -1 for integers, False for bools."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return np.nan
    if dtype.kind == "b":
        return False
    return -1


def vocabulary_subset_on(
    distillation: Distillation | None, device: torch.device
) -> torch.Tensor | None:
    """The distillation's vocabulary subset as a float32 indicator on `device` (None: it reads
    none), made once per run rather than copied to the device at every micro-batch."""
    subset = None if distillation is None else distillation.vocabulary_subset
    if subset is None:
        return None
    return torch.from_numpy(subset.astype(np.float32)).to(device)
