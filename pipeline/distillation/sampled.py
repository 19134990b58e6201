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

import torch


def cumulative(teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """Each row's cumulative distribution [n, V] (float64, for the tail's resolution), normalized
    to end at 1: what draw_ids inverts."""
    cdf = torch.cumsum(teacher_logprobs.double().exp(), dim=-1)
    return cdf / cdf[..., -1:]


def draw_ids(cdf: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Ids [n, K] drawn from each row of `cdf` (cumulative) at `uniforms` [n, K] in [0, 1)."""
    ids = torch.searchsorted(cdf, uniforms.double().contiguous(), right=True)
    return ids.clamp_(max=cdf.shape[-1] - 1)


def ranks(teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """Every id's rank [n, V] in its row's descending order, equal values by the lower id."""
    order = torch.sort(teacher_logprobs, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return rank


def sampled_kl(student_logprob: torch.Tensor, teacher_logprob: torch.Tensor) -> torch.Tensor:
    """Per position [n], the estimate of KL(student || teacher) from the draws' log-probabilities
    under each [n, K]."""
    log_ratio = student_logprob - teacher_logprob
    return (log_ratio.exp() * log_ratio).mean(-1)


def sampled_uld(
    student_sorted: torch.Tensor, teacher_logprob: torch.Tensor, ranks: torch.Tensor, teacher_vocab: int
) -> torch.Tensor:
    """Per position [n], the estimate of the sorted-distribution distance from the student's whole
    distribution sorted descending [n, V_s], the draws' teacher log-probabilities [n, K] and
    their teacher ranks [n, K], for a teacher of `teacher_vocab` ids."""
    width = max(student_sorted.shape[-1], teacher_vocab)
    padded = torch.nn.functional.pad(student_sorted, (0, width - student_sorted.shape[-1]))
    teacher = teacher_logprob.exp()
    at_rank = padded.gather(-1, ranks)
    beyond = padded[..., teacher_vocab:].sum(-1)  # student ranks the teacher has no id for
    return ((at_rank - teacher).abs() / teacher).mean(-1) + beyond


def full_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """The exact KL(student || teacher) [n] over one vocabulary [n, V]: what sampled_kl estimates."""
    return (student_logprobs.exp() * (student_logprobs - teacher_logprobs)).sum(-1)


def full_uld(student_probs: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
    """The exact sorted-distribution distance [n] (Boizard et al.): what sampled_uld estimates."""
    width = max(student_probs.shape[-1], teacher_probs.shape[-1])

    def sorted_padded(probs):
        probs = torch.sort(probs, dim=-1, descending=True).values
        return torch.nn.functional.pad(probs, (0, width - probs.shape[-1]))

    return (sorted_padded(student_probs) - sorted_padded(teacher_probs)).abs().sum(-1)
