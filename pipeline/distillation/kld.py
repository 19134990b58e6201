"""KL distillation from the cache (`--guidance kld`; VocAgnoLM Table 1 "KLD", appendix B eq. 5,
after Song et al., 2020 and Gu et al., 2024): the cross-entropy on every token plus, with equal
weight, KL(p_S || p_T) between the student's and the same-vocabulary teacher's next-token
distributions, in the order eq. 5 writes them.

The cache holds the teacher's top K ids and probabilities and the mass outside them, so the KL is
taken over K + 1 buckets (docs/distillation.md): the teacher's K ids, where both sides have their
own probability, and "every other id", where the teacher has its cached rest and the student
1 - (its mass on the K ids). This is the KL between the two distributions coarsened to those
buckets, a lower bound of the full-vocabulary KL (the log-sum inequality) that misses only how
each side spreads its rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.cache.schema import TOPK_IDS, TOPK_PROBS, TOPK_REST
from pipeline.distillation.topk import IDS, PROBS, REST, PairedTopkTerm
from pipeline.head_outputs import HeadReads, valid_ids

# A teacher bucket below float16's smallest step (the cache's resolution) reads as this, so that
# a bucket stored as 0 costs a large but finite log-ratio.
TEACHER_FLOOR = 2.0**-24
STUDENT_FLOOR = 1e-30  # the student's rest when its top ids hold all its mass, within float32


def topk_kl(
    student_at_ids: torch.Tensor,
    log_z: torch.Tensor,
    valid: torch.Tensor,
    teacher_probs: torch.Tensor,
    teacher_rest: torch.Tensor,
) -> torch.Tensor:
    """Per position [...], KL(student || teacher) over the buckets above, in float32: the
    student's logits of the teacher's top-K ids [..., K] and its log normalizer [...], where
    those ids are among the student's logits [..., K] (an id outside them, a padded teacher head
    or -1, is no bucket of its own: its teacher mass joins the rest), and the teacher's top-K
    probabilities [..., K] and rest [...]. The teacher's buckets are floored at TEACHER_FLOOR
    and renormalized."""
    student_log = student_at_ids - log_z[..., None]
    student = torch.where(valid, student_log.exp(), 0.0)
    student_rest = (1 - student.sum(-1)).clamp(min=STUDENT_FLOOR)
    teacher = torch.where(valid, teacher_probs, 0.0)
    teacher_rest = (teacher_rest + (teacher_probs - teacher).sum(-1)).clamp(min=TEACHER_FLOOR)
    teacher = torch.where(valid, teacher.clamp(min=TEACHER_FLOOR), 0.0)
    log_total = torch.log(teacher.sum(-1) + teacher_rest)
    teacher_log = torch.log(torch.where(valid, teacher, 1.0)) - log_total[..., None]
    ids_term = torch.where(valid, student * (student_log - teacher_log), 0.0).sum(-1)
    rest_term = student_rest * (student_rest.log() - teacher_rest.log() + log_total)
    return ids_term + rest_term


@dataclass(frozen=True)
class TopkKLDistillation(PairedTopkTerm):
    """KLD over the cached top-k (pipeline.distillation.Distillation): the student's tokenizer is
    the cache's (stage 2 refuses any other before training), so the alignment is the identity
    and each student token meets the teacher distribution at its own position."""

    weight: float = 1.0  # eq. 5: cross-entropy and KL summed with equal weights
    name: str = "kld"
    cache_columns: tuple[str, ...] = (TOPK_PROBS, TOPK_IDS, TOPK_REST)
    extra_names: tuple[str, ...] = (PROBS, IDS, REST)

    def reads(self, extras, subset):
        return HeadReads(ids=extras[IDS])

    def per_token(self, student, probs, rest, extras):
        valid = valid_ids(extras[IDS], student.vocabulary)
        return topk_kl(student.at_ids, student.log_z, valid, probs, rest)
