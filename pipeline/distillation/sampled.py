"""Unbiased estimates of the full-vocabulary KLD and ULD terms from K ids drawn from the teacher's
distribution (docs/distillation.md: "Sampled targets"; the idea of Anshumann et al., "Sparse Logit
Sampling", ACL 2025, arXiv 2503.16870: ids sampled from the teacher, weighted by importance,
estimate the full term without bias, where a top-k cache estimates a coarsened one).

The draws x_1..x_K are independent, each from the teacher's t at temperature 1 (the proposal is
t itself). For any f, (1/K) sum_i f(x_i) / t(x_i) is an unbiased estimate of sum_v f(v), so

  KL(s || t) = sum_v s(v) (log s(v) - log t(v))
             ~ (1/K) sum_i w_i (log s(x_i) - log t(x_i)),       w_i = s(x_i) / t(x_i)

  ULD        = sum_r |s_(r) - t_(r)|   (both sorted descending, the shorter padded with zeros)
             = sum_v |s_(rank_t(v)) - t(v)|  +  sum_{r >= V_t} s_(r)
             ~ (1/K) sum_i |s_(rank_i) - t(x_i)| / t(x_i)  +  sum_{r >= V_t} s_(r)

where rank_t(v) is v's rank in the teacher's descending order (ties by the lower id, the top-k
rule of pipeline.scoring.head_kernels). So a sampled position stores, per draw, the id, the
teacher's log-probability of it and its rank; the student side is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.cache.schema import SAMPLE_IDS, SAMPLE_LOGPROBS
from pipeline.cross_entropy import IGNORE_INDEX
from pipeline.distillation import AlignedRead
from pipeline.head_outputs import HeadOutputs, HeadReads, valid_ids


def sampled_kl(student_logprob: torch.Tensor, teacher_logprob: torch.Tensor) -> torch.Tensor:
    """Per position [n], the estimate of KL(student || teacher) from the draws' log-probabilities
    under each [n, K]."""
    log_ratio = student_logprob - teacher_logprob
    return (log_ratio.exp() * log_ratio).mean(-1)


def sampled_uld(
    student_sorted: torch.Tensor,
    teacher_logprob: torch.Tensor,
    teacher_ranks: torch.Tensor,
    teacher_vocab: int,
) -> torch.Tensor:
    """Per position [n], the estimate of the sorted-distribution distance from the student's whole
    distribution sorted descending [n, V_s], the draws' teacher log-probabilities [n, K] and
    their teacher ranks [n, K], for a teacher of `teacher_vocab` ids."""
    width = max(student_sorted.shape[-1], teacher_vocab)
    padded = torch.nn.functional.pad(student_sorted, (0, width - student_sorted.shape[-1]))
    teacher = teacher_logprob.exp()
    at_rank = padded.gather(-1, teacher_ranks)
    beyond = padded[..., teacher_vocab:].sum(-1)  # student ranks the teacher has no id for
    return ((at_rank - teacher).abs() / teacher).mean(-1) + beyond


# the extras' keys in a micro-batch: per student token, the paired teacher position's draws
DRAWN_IDS = "teacher_sample_ids"  # (tokens, K) int32; -1 where no paired distribution
DRAWN_LOGPROBS = "teacher_sample_logprobs"  # (tokens, K) float32: log t of each draw; NaN: none


@dataclass(frozen=True)
class SampledKLDistillation:
    """`--guidance kld-sampled` (pipeline.distillation.Distillation): the cross-entropy plus, with
    KLD's equal weight (VocAgnoLM appendix B eq. 5), the estimate above of the full-vocabulary
    KL(student || teacher) from a `--topk-mode sampled` cache. Like KLD it needs the cache's own
    tokenizer (the identity alignment); unlike the top-k KLD it estimates the full term, not a
    coarsened one (docs/distillation.md)."""

    weight: float = 1.0
    name: str = "kld-sampled"
    cache_columns: tuple[str, ...] = (SAMPLE_IDS, SAMPLE_LOGPROBS)
    extra_names: tuple[str, ...] = (DRAWN_IDS, DRAWN_LOGPROBS)
    vocabulary_subset = None  # (a class attribute, not a field) it reads no subset's mass

    def extras(self, read: AlignedRead) -> dict[str, np.ndarray]:
        """Per student token, the draws of the teacher position paired with it (its own, under
        the identity alignment); none where unmapped or unscored."""
        first = read.map_start
        mapped = np.flatnonzero(first >= 0)
        ids, logprobs = read.teacher_columns[SAMPLE_IDS], read.teacher_columns[SAMPLE_LOGPROBS]
        out = {
            DRAWN_IDS: np.full((first.size, ids.shape[1]), -1, dtype=np.int32),
            DRAWN_LOGPROBS: np.full((first.size, ids.shape[1]), np.nan, dtype=np.float32),
        }
        out[DRAWN_IDS][mapped] = ids[first[mapped]]
        out[DRAWN_LOGPROBS][mapped] = logprobs[first[mapped]]
        return out

    def _paired(self, labels: torch.Tensor, extras: dict[str, torch.Tensor]) -> torch.Tensor:
        return (labels != IGNORE_INDEX) & (extras[DRAWN_IDS][..., 0] >= 0)

    def units(self, labels: torch.Tensor, extras: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._paired(labels, extras).sum()

    def reads(self, extras, subset) -> HeadReads:
        return HeadReads(ids=extras[DRAWN_IDS])

    def loss_sum(
        self, student: HeadOutputs, labels: torch.Tensor, extras: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        where = self._paired(labels, extras)
        valid = valid_ids(extras[DRAWN_IDS], student.vocabulary) & where[..., None]
        student_logprob = student.at_ids - student.log_z[..., None]
        teacher_logprob = torch.where(valid, extras[DRAWN_LOGPROBS].float(), 0.0)
        # a teacher id the student's head lacks has student probability 0: no contribution
        per_token = sampled_kl(
            torch.where(valid, student_logprob, teacher_logprob), teacher_logprob
        )
        return torch.where(where, per_token, 0.0).sum()
