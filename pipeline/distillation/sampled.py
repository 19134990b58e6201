"""Full-vocabulary distillation terms from K ids drawn from the teacher's distribution
(docs/distillation.md: "Sampled targets"; the idea of Anshumann et al., "Sparse Logit Sampling",
ACL 2025, arXiv 2503.16870: ids sampled from the teacher estimate the full term without bias,
where a top-k cache estimates a coarsened one).

The draws x_1..x_K are independent, each from the teacher's t at temperature 1 (the proposal is
t itself). For any f, (1/K) sum_i f(x_i) is an unbiased estimate of sum_v t(v) f(v), and
(1/K) sum_i f(x_i) / t(x_i) one of sum_v f(v), so

  KL(t || s) = sum_v t(v) (log t(v) - log s(v))
             ~ (1/K) sum_i (log t(x_i) - log s(x_i))

  ULD        = sum_r |s_(r) - t_(r)|   (both sorted descending, the shorter padded with zeros)
             = sum_v |s_(rank_t(v)) - t(v)|  +  sum_{r >= V_t} s_(r)
             ~ (1/K) sum_i |s_(rank_i) - t(x_i)| / t(x_i)  +  sum_{r >= V_t} s_(r)

where rank_t(v) is v's rank in the teacher's descending order (ties by the lower id, the top-k
rule of pipeline.scoring.head_kernels). The KL is the forward one, Sparse Logit Sampling's
(their RS-KD with the teacher as its own proposal): it needs no importance weight, so its
gradient, -(1/K) sum_i grad log s(x_i), is the cross-entropy against the draws, bounded, and
equal in expectation to the full forward KL's. Eq. 5's reverse KL(s || t) would need the weights
s(x)/t(x), unbounded where the student puts mass the teacher seldom draws: trained that way, the
student did not learn (docs/distillation.md). So a sampled position stores, per draw, the id, the
teacher's log-probability of it and its rank; the student side is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.cache.schema import SAMPLE_IDS, SAMPLE_LOGPROBS, SAMPLE_RANKS
from pipeline.cross_entropy import IGNORE_INDEX
from pipeline.distillation import AlignedRead, fill_value
from pipeline.head_outputs import HeadOutputs, HeadReads, valid_ids


def sampled_forward_kl(
    student_logprob: torch.Tensor, teacher_logprob: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """Per position [n], the estimate of KL(teacher || student) from the draws'
    log-probabilities under each [n, K], over the draws that are `valid` [n, K] (an id the
    student's head lacks adds 0: only a padded teacher head has one, with next to no mass)."""
    return torch.where(valid, teacher_logprob - student_logprob, 0.0).mean(-1)


def sampled_uld(
    student_top: torch.Tensor,
    log_z: torch.Tensor,
    teacher_logprob: torch.Tensor,
    teacher_ranks: torch.Tensor,
    teacher_vocab: int,
) -> torch.Tensor:
    """Per position [n], the estimate of the sorted-distribution distance from the student's
    largest logits in descending order [n, min(V_s, V_t)] with its log normalizer [n], and the
    draws' teacher log-probabilities [n, K] and ranks [n, K], for a teacher of `teacher_vocab`
    (V_t) outputs. A student rank the draws reach beyond V_s has probability 0 (ULD's padding);
    a student of more than V_t ids adds its mass beyond rank V_t exactly."""
    student = torch.exp(student_top - log_z[..., None])
    width = student.shape[-1]
    at_rank = student.gather(-1, teacher_ranks.clamp(0, width - 1))
    at_rank = torch.where(teacher_ranks < width, at_rank, 0.0)
    teacher = teacher_logprob.exp()
    estimate = ((at_rank - teacher).abs() / teacher).mean(-1)
    if width < teacher_vocab:  # the student's whole distribution is in `student_top`
        return estimate
    return estimate + (1 - student.sum(-1)).clamp(min=0)  # its ranks the teacher has no id for


# the extras' keys in a micro-batch: per student token, the paired teacher position's draws
DRAWN_IDS = "teacher_sample_ids"  # (tokens, K) int32; -1 where no paired distribution
DRAWN_LOGPROBS = "teacher_sample_logprobs"  # (tokens, K) float32: log t of each draw; NaN: none
DRAWN_RANKS = "teacher_sample_ranks"  # (tokens, K) int32: each draw's rank in t; -1: none
_DRAWN = {  # each extra's cache column and dtype
    DRAWN_IDS: (SAMPLE_IDS, np.int32),
    DRAWN_LOGPROBS: (SAMPLE_LOGPROBS, np.float32),
    DRAWN_RANKS: (SAMPLE_RANKS, np.int32),
}


def paired_draws(read: AlignedRead, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Per student token, the draws of the teacher position paired with it (the pairing of
    pipeline.distillation.topk: the first teacher token of its span; its own token under the
    identity alignment); -1 / NaN where the token is unmapped or that position unscored."""
    first = read.map_start
    mapped = np.flatnonzero(first >= 0)
    out = {}
    for name in names:
        column, dtype = _DRAWN[name]
        values = read.teacher_columns[column]
        out[name] = np.full((first.size, values.shape[1]), fill_value(dtype), dtype=dtype)
        out[name][mapped] = values[first[mapped]]
    return out


def drawn(labels: torch.Tensor, extras: dict[str, torch.Tensor]) -> torch.Tensor:
    """Where a sampled term is computed: valid targets with a paired teacher position's draws."""
    return (labels != IGNORE_INDEX) & ~extras[DRAWN_LOGPROBS][..., 0].isnan()


@dataclass(frozen=True)
class SampledTerm:
    """What the sampled KLD and ULD share (pipeline.distillation.Distillation): their extras are
    the paired draws, their units the paired targets, their loss a per-token estimate summed
    over those units; each defines `per_token` from the draws' log-probabilities (0 off the
    units, so that no NaN reaches the arithmetic)."""

    vocabulary_subset = None  # (a class attribute, not a field) neither reads a subset's mass

    def extras(self, read: AlignedRead) -> dict[str, np.ndarray]:
        return paired_draws(read, self.extra_names)

    def units(self, labels: torch.Tensor, extras: dict[str, torch.Tensor]) -> torch.Tensor:
        return drawn(labels, extras).sum()

    def loss_sum(
        self, student: HeadOutputs, labels: torch.Tensor, extras: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        where = drawn(labels, extras)
        teacher_logprob = torch.where(where[..., None], extras[DRAWN_LOGPROBS].float(), 0.0)
        per_token = self.per_token(student, teacher_logprob, where, extras)
        return torch.where(where, per_token, 0.0).sum()

    def per_token(
        self,
        student: HeadOutputs,
        teacher_logprob: torch.Tensor,
        where: torch.Tensor,
        extras: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class SampledKLDistillation(SampledTerm):
    """`--guidance kld-sampled`: the cross-entropy plus, with KLD's equal weight (VocAgnoLM
    appendix B eq. 5), the estimate above of the full-vocabulary forward KL(teacher || student)
    from a `--topk-mode sampled` cache, as Sparse Logit Sampling trains (eq. 5 writes the
    reverse KL, whose estimate from teacher draws did not train). Like KLD it needs the cache's
    own tokenizer (the identity alignment)."""

    weight: float = 1.0
    name: str = "kld-sampled"
    cache_columns: tuple[str, ...] = (SAMPLE_IDS, SAMPLE_LOGPROBS)
    extra_names: tuple[str, ...] = (DRAWN_IDS, DRAWN_LOGPROBS)

    def reads(self, extras, subset) -> HeadReads:
        return HeadReads(ids=extras[DRAWN_IDS])

    def per_token(self, student, teacher_logprob, where, extras):
        valid = valid_ids(extras[DRAWN_IDS], student.vocabulary) & where[..., None]
        student_logprob = student.at_ids - student.log_z[..., None]
        return sampled_forward_kl(student_logprob, teacher_logprob, valid)


@dataclass(frozen=True)
class SampledULDistillation(SampledTerm):
    """`--guidance uld-sampled`: the cross-entropy plus --uld-lambda times the estimate above of
    the full-vocabulary ULD distance (VocAgnoLM appendix B eq. 6, Boizard et al. 2025) from a
    `--topk-mode sampled` cache, with any student tokenizer. It reads the student's largest
    min(V_s, V_t) logits, sorted: the cost of the full term, which the top-k ULD avoids by
    reading K (docs/distillation.md)."""

    weight: float = 0.5  # lambda, the paper's (appendix B, Figure 7b), as --guidance uld
    teacher_vocab: int = 0  # V_t: the cache's sample_head_size
    name: str = "uld-sampled"
    cache_columns: tuple[str, ...] = (SAMPLE_LOGPROBS, SAMPLE_RANKS)  # no ids: ranks need none
    extra_names: tuple[str, ...] = (DRAWN_LOGPROBS, DRAWN_RANKS)

    def reads(self, extras, subset) -> HeadReads:
        return HeadReads(top=self.teacher_vocab)

    def per_token(self, student, teacher_logprob, where, extras):
        ranks = torch.where(where[..., None], extras[DRAWN_RANKS], 0).long()
        return sampled_uld(student.top, student.log_z, teacher_logprob, ranks, self.teacher_vocab)
