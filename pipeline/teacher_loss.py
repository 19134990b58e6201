"""The teacher's loss of every student token: map each student token to a range of cached teacher
tokens, then aggregate their losses over that range (paper eq. 2).

One definition for training (stage2_train.data) and for the inspection page
(apps.analysis.guidance_page). It runs over many documents at once, concatenated, with no
per-token Python loop. Alignments:
  token     Token-level Lexical Alignment by character offsets (pipeline.alignment.align);
  chunk     the paper's equal-chunk baseline (pipeline.alignment.equal_chunk_alignment);
  identity  student token i is teacher token i (one tokenizer on both sides).
Several teachers' caches over one corpus give each student token one loss per teacher, which
`combine_teacher_losses` makes one (docs/several-teachers.md; the paper has one teacher).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.alignment import (
    DEFAULT_AGGREGATION,
    UNMAPPED,
    aggregate_teacher_loss,
    align,
    equal_chunk_alignment,
)
from pipeline.choices import TEACHER_COMBINATIONS

ALIGNMENTS = ("token", "chunk", "identity")


@dataclass(frozen=True)
class StudentTeacherLoss:
    """Per student token (documents concatenated): its inclusive teacher range and the
    aggregated teacher loss (NaN: unmapped, or none of its teacher tokens was scored)."""

    map_start: np.ndarray  # int64, index into the concatenated teacher tokens, -1 = unmapped
    map_end: np.ndarray
    teacher_loss: np.ndarray  # float32


def exclusive_cumsum(values: np.ndarray) -> np.ndarray:
    """Where each of consecutive runs of these lengths starts."""
    return np.concatenate(([0], np.cumsum(values)[:-1])).astype(np.int64)


def student_teacher_loss(
    student_start: np.ndarray,
    student_end: np.ndarray,
    student_lengths: np.ndarray,
    teacher_start: np.ndarray,
    teacher_end: np.ndarray,
    teacher_loss: np.ndarray,
    teacher_lengths: np.ndarray,
    text_lengths: np.ndarray,
    *,
    alignment: str = "token",
    num_chunks: int = 1,
    aggregate: str = DEFAULT_AGGREGATION,
) -> StudentTeacherLoss:
    """Map and aggregate for consecutive documents. Offsets are character offsets within each
    document's own text; `*_lengths` are tokens per document and `text_lengths` characters."""
    student_lengths = np.asarray(student_lengths, dtype=np.int64)
    teacher_lengths = np.asarray(teacher_lengths, dtype=np.int64)
    if alignment == "token":
        # Shift each document's offsets past the previous one (plus a gap, so that zero-width
        # spans at a boundary touch neither side): one align call serves every document.
        text_lengths = np.asarray(text_lengths, dtype=np.int64)
        base = exclusive_cumsum(text_lengths + 1)
        # int32 offsets halve the merges' memory traffic; only a read of 2**31 characters
        # needs int64.
        large = base.size and base[-1] + text_lengths[-1] >= np.iinfo(np.int32).max
        offset = np.int64 if large else np.int32
        student_shift = np.repeat(base.astype(offset), student_lengths)
        teacher_shift = np.repeat(base.astype(offset), teacher_lengths)
        map_start, map_end = align(
            np.asarray(student_start, dtype=offset) + student_shift,
            np.asarray(student_end, dtype=offset) + student_shift,
            np.asarray(teacher_start, dtype=offset) + teacher_shift,
            np.asarray(teacher_end, dtype=offset) + teacher_shift,
        )
    elif alignment == "chunk":
        map_start, map_end = equal_chunk_alignment(student_lengths, teacher_lengths, num_chunks)
    elif alignment == "identity":
        # Student token i is teacher token i; the student's trailing EOS has no teacher token.
        total = int(student_lengths.sum())
        position = np.arange(total) - np.repeat(exclusive_cumsum(student_lengths), student_lengths)
        mapped = position < np.repeat(teacher_lengths, student_lengths)
        first_teacher = np.repeat(exclusive_cumsum(teacher_lengths), student_lengths)
        map_start = np.where(mapped, position + first_teacher, UNMAPPED)
        map_end = map_start
    else:
        raise ValueError(f"alignment must be 'token', 'chunk' or 'identity', not {alignment!r}")
    per_token = aggregate_teacher_loss(teacher_loss, map_start, map_end, aggregate)
    return StudentTeacherLoss(map_start, map_end, per_token)


def combine_teacher_losses(
    losses: list[np.ndarray], rule: str, chosen: np.ndarray | None = None
) -> np.ndarray:
    """One teacher loss per student token from several teachers' (each aligned on its own): the
    smallest (`min`: the token counts as learnable if any teacher finds it easy) or the `mean`,
    over the teachers that give the token a loss, NaN where none does; or (`source`) the loss of
    the teacher `chosen` names for each token (an index into `losses`), NaN where that teacher
    gives none. One teacher's losses are returned as they are."""
    if rule not in TEACHER_COMBINATIONS:
        raise ValueError(f"rule must be one of {TEACHER_COMBINATIONS}, not {rule!r}")
    if len(losses) == 1:
        return losses[0]
    stacked = np.stack(losses)
    if rule == "source":
        return stacked[chosen, np.arange(stacked.shape[1])]
    given = ~np.isnan(stacked)
    count = given.sum(0)
    if rule == "min":
        combined = np.where(given, stacked, np.inf).min(0)
    else:
        combined = np.where(given, stacked, 0).sum(0, dtype=np.float64) / np.maximum(count, 1)
    return np.where(count > 0, combined, np.nan).astype(np.float32)
