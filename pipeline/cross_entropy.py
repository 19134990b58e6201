"""Per-token cross-entropy: the one definition of a token's loss, for the teacher's losses that
stage 1 caches (pipeline.scoring.hf) and the student's that stage 2 selects and trains on
(pipeline.guidance, stage2_train.trainer).

It is F.cross_entropy in fp32, spelled out as the log-softmax and NLL that torch composes it of:
the same computation as transformers' causal-LM loss, so a run with every token kept trains on
exactly the loss transformers reports, and one code path for the loss alone and the loss with the
log-probabilities it is read from (bit for bit the same, on any device).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # a label that is no target (padding); transformers uses the same value


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """-log softmax(logits)[label] in fp32 for logits [..., V] and labels [...], shaped like
    `labels`; 0 where the label is IGNORE_INDEX."""
    return token_log_probs_and_loss(logits, labels)[1]


def token_log_probs_and_loss(
    logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits) in fp32 [..., V] and `token_loss` of `labels` read from it: for a
    caller that reads more of the distribution than the label's term."""
    log_probs = torch.log_softmax(logits.float().flatten(0, -2), dim=-1)
    per_token = F.nll_loss(log_probs, labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX)
    return log_probs.view(logits.shape), per_token.view(labels.shape)


class _LossAndSubsetLogprob(torch.autograd.Function):
    """One pass over fp32 logits [N, V] for both the cross-entropy and log Σ_{v∈S} p(v): the
    shifted exponentials e = exp(z - max z) give the normalizer (their sum) and the subset's mass
    (their product with S's indicator), and the backward pass builds the gradient of both from e
    alone. Separately, a log-sum-exp over S's logits costs a gather, a second exp pass and a
    scatter in the backward pass."""

    @staticmethod
    def forward(ctx, logits, labels, subset):
        shift = logits.amax(dim=-1, keepdim=True)
        exp = (logits - shift).exp_()
        total, in_subset = exp.sum(dim=-1), exp @ subset
        log_total = total.log()
        target = labels != IGNORE_INDEX
        safe = torch.where(target, labels, 0).unsqueeze(-1)
        picked = logits.gather(-1, safe).squeeze(-1)
        loss = torch.where(target, log_total + shift.squeeze(-1) - picked, 0.0)
        # a subset mass under fp32's smallest normal (log p < -87.3) reads as that bound
        subset_logprob = in_subset.clamp(min=torch.finfo(exp.dtype).tiny).log() - log_total
        ctx.save_for_backward(exp, total, in_subset, safe, target, subset)
        return loss, subset_logprob

    @staticmethod
    def backward(ctx, grad_loss, grad_subset):
        exp, total, in_subset, safe, target, subset = ctx.saved_tensors
        grad_loss = torch.where(target, grad_loss, 0.0)
        # d loss/dz = p - onehot(label); d subset_logprob/dz = p·1_S / p(S) - p
        per_total = ((grad_loss - grad_subset) / total).unsqueeze(-1)
        per_subset = (grad_subset / in_subset.clamp(min=torch.finfo(exp.dtype).tiny)).unsqueeze(-1)
        grad = exp * torch.addcmul(per_total, per_subset, subset)
        grad.scatter_add_(-1, safe, -grad_loss.unsqueeze(-1))
        return grad, None, None


def token_loss_and_subset_logprob(
    logits: torch.Tensor, labels: torch.Tensor, subset: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_loss` and, at every position, the log-probability of the vocabulary subset S,
    log Σ_{v∈S} softmax(logits)[v], both in fp32 from one pass over the vocabulary
    (pipeline.distillation: ALM's space probability). `subset` is S's indicator [V'] (bool or
    float), V' <= V; ids from V' on are outside S. A subset whose summed exp(logit - max logit)
    is under fp32's smallest normal (S's logits all about 87 nats below the largest) reads as
    that bound."""
    flat = logits.float().flatten(0, -2)
    subset = subset.to(flat.dtype)
    if subset.numel() < flat.shape[-1]:
        subset = F.pad(subset, (0, flat.shape[-1] - subset.numel()))
    loss, subset_logprob = _LossAndSubsetLogprob.apply(flat, labels.flatten(), subset)
    return loss.view(labels.shape), subset_logprob.view(labels.shape)
