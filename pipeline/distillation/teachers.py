"""Several teachers' distillation terms in one run (`--more-caches` under a distillation mode,
docs/several-teachers.md; the paper has one teacher).

Teacher i's term is the mode's own objective built from its cache (its settings, columns and
alignment), and the run trains on their weighted sum with the stated weights w_i (normalized to
sum to 1), over the units each teacher pairs:

    D = sum_i w_i S_i / sum_i w_i U_i

S_i is teacher i's term summed over its units in the step and U_i how many there are. Where the
teachers pair the same units (one student tokenizer against teachers of one tokenizer, or one
teacher twice) this is sum_i w_i mean_i exactly; where they pair different ones, each unit of
teacher i counts with weight w_i. The weighted unit count is a float64 count.

The student's distribution is read once for every teacher: the reads are merged (the ids of every
teacher in one gather, the largest top any asks for) and each teacher is handed its own part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.distillation import AlignedRead, Distillation
from pipeline.head_outputs import HeadOutputs, HeadReads


def teacher_key(name: str, teacher: int) -> str:
    """Teacher `teacher`'s key for an extra: the first teacher keeps the mode's own keys."""
    return name if teacher == 0 else f"{name}@teacher{teacher}"


@dataclass(frozen=True)
class TeacherMixture:
    """The weighted sum above of one distillation objective over several teachers' caches
    (pipeline.distillation.Distillation; its `extras` take every teacher's read)."""

    terms: tuple[Distillation, ...]  # teacher i's objective, from its cache's settings
    weights: tuple[float, ...]  # w_i, summing to 1

    @property
    def name(self) -> str:
        return self.terms[0].name

    @property
    def weight(self) -> float:
        return self.terms[0].weight

    @property
    def cache_columns(self) -> tuple[str, ...]:
        """The columns each cache must hold (every teacher's term reads the same ones)."""
        return self.terms[0].cache_columns

    @property
    def vocabulary_subset(self) -> np.ndarray | None:
        return self.terms[0].vocabulary_subset  # the student's: one for every teacher

    @property
    def extra_names(self) -> tuple[str, ...]:
        return tuple(
            teacher_key(name, i) for i, term in enumerate(self.terms) for name in term.extra_names
        )

    def extras(self, read: AlignedRead) -> dict[str, np.ndarray]:
        raise TypeError("a mixture of teachers builds its extras from every teacher's read")

    def teacher_extras(self, reads: Sequence[AlignedRead]) -> dict[str, np.ndarray]:
        """Every teacher's extras (reads[i]: the documents aligned to teacher i), under its keys."""
        return {
            teacher_key(name, i): values
            for i, (term, read) in enumerate(zip(self.terms, reads, strict=True))
            for name, values in term.extras(read).items()
        }

    def _own(self, extras: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
        return {name: extras[teacher_key(name, i)] for name in self.terms[i].extra_names}

    def units(self, labels: torch.Tensor, extras: dict[str, torch.Tensor]) -> torch.Tensor:
        counts = [term.units(labels, self._own(extras, i)) for i, term in enumerate(self.terms)]
        return sum(w * c.double() for w, c in zip(self.weights, counts, strict=True))

    def _reads(self, extras, subset) -> list[HeadReads]:
        return [term.reads(self._own(extras, i), subset) for i, term in enumerate(self.terms)]

    def reads(self, extras: dict[str, torch.Tensor], subset: torch.Tensor | None) -> HeadReads:
        each = self._reads(extras, subset)
        ids = [r.ids for r in each if r.ids is not None]
        return HeadReads(
            subset=subset if any(r.subset is not None for r in each) else None,
            ids=torch.cat(ids, dim=-1) if ids else None,
            top=max(r.top for r in each),
        )

    def loss_sum(
        self, student: HeadOutputs, labels: torch.Tensor, extras: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        total, offset = 0.0, 0
        for i, (term, reads) in enumerate(zip(self.terms, self._reads(extras, None), strict=True)):
            width = 0 if reads.ids is None else reads.ids.shape[-1]
            top = min(reads.top, student.vocabulary)
            own = HeadOutputs(
                loss=student.loss,
                vocabulary=student.vocabulary,
                subset_logprob=student.subset_logprob,
                log_z=student.log_z,
                at_ids=None if reads.ids is None else student.at_ids[..., offset : offset + width],
                top=None if not reads.top else student.top[..., :top],
            )
            offset += width
            total = total + self.weights[i] * term.loss_sum(own, labels, self._own(extras, i))
        return total


def mixture(terms: Sequence[Distillation], weights: Sequence[float] = ()) -> Distillation:
    """The one term itself, or the weighted sum of several teachers' (equal weights unless
    given: one per teacher, positive)."""
    if len(terms) == 1:
        return terms[0]
    weights = np.asarray(weights or [1.0] * len(terms), dtype=np.float64)
    if weights.shape != (len(terms),) or not (weights > 0).all():
        raise ValueError(f"need {len(terms)} positive teacher weights, not {weights.tolist()}")
    return TeacherMixture(tuple(terms), tuple((weights / weights.sum()).tolist()))
