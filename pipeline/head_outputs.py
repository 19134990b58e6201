"""What stage 2's losses read of the student's next-token distribution at every slot, computed in
one pass over the vocabulary: the cross-entropy of the label always, and what a distillation term
asks for besides (`HeadReads`): the log-probability of a vocabulary subset (ALM's space mask),
the logits of given ids (KLD: the teacher's top-k ids), the largest logits (ULD: the student's
top k) and the log normalizer log Z (ULD, KLD).

Two passes give the same `HeadOutputs`: `head_outputs` here from the model's logits [..., V]
(`--loss-kernel plain`), and `pipeline.chunked_loss.chunked_head_outputs` from the hidden states
and the head's weight in row chunks, never holding the whole micro-batch's logits
(`--loss-kernel chunked`). tests/test_chunked_loss.py holds them equal, values and gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.cross_entropy import IGNORE_INDEX, token_loss, token_loss_and_subset_logprob


@dataclass(frozen=True)
class HeadReads:
    """What a loss reads beside the label's cross-entropy (pipeline.distillation.Distillation)."""

    subset: torch.Tensor | None = None  # float indicator [V'] of a vocabulary subset S, V' <= V
    ids: torch.Tensor | None = None  # [..., K] ids whose logits are read; ids outside [0, V) read 0
    top: int = 0  # how many of the largest logits are read, in descending order

    @property
    def normalizer(self) -> bool:
        """Whether log Z is read: logits (of ids or the top) mean nothing without it."""
        return self.ids is not None or self.top > 0


@dataclass(frozen=True)
class HeadOutputs:
    """Per slot [...] in float32, each with its gradient; None where `HeadReads` asked for none."""

    loss: torch.Tensor  # -log p(label), 0 where the label is IGNORE_INDEX
    vocabulary: int  # V, the width of the logits
    subset_logprob: torch.Tensor | None = None  # log p(S)
    log_z: torch.Tensor | None = None  # log Z = logsumexp(logits) (plain: valid at targets only)
    at_ids: torch.Tensor | None = None  # [..., K] logits of the read ids (logit 0's where invalid)
    top: torch.Tensor | None = None  # [..., min(top, V)] the largest logits, descending


def valid_ids(ids: torch.Tensor, vocabulary: int) -> torch.Tensor:
    """Where an id read by `HeadReads.ids` is one of the student's logits."""
    return (ids >= 0) & (ids < vocabulary)


def safe_ids(ids: torch.Tensor, vocabulary: int) -> torch.Tensor:
    """The ids to gather: id 0 where an id is not one of the student's logits."""
    return torch.where(valid_ids(ids, vocabulary), ids, 0).long()


def head_outputs(logits: torch.Tensor, labels: torch.Tensor, reads: HeadReads) -> HeadOutputs:
    """The outputs from the model's logits [..., V] (`--loss-kernel plain`). The cross-entropy and
    the subset's log-probability come from one pass (pipeline.cross_entropy); log Z is the
    cross-entropy plus the label's logit (-log p(label) = log Z - logit[label]) rather than
    another pass over the vocabulary, so it is exact at target slots, where the terms read it,
    and its gradient is the softmax's, through the cross-entropy."""
    if reads.subset is None:
        loss, subset_logprob = token_loss(logits, labels), None
    else:
        loss, subset_logprob = token_loss_and_subset_logprob(logits, labels, reads.subset)
    vocabulary = logits.shape[-1]
    outputs = {}
    if reads.normalizer:
        logits = logits.float()
        target = labels != IGNORE_INDEX
        picked = logits.gather(-1, torch.where(target, labels, 0).unsqueeze(-1)).squeeze(-1)
        outputs["log_z"] = loss + picked
    if reads.ids is not None:
        outputs["at_ids"] = logits.gather(-1, safe_ids(reads.ids, vocabulary))
    if reads.top:
        outputs["top"] = torch.topk(logits, min(reads.top, vocabulary), dim=-1).values
    return HeadOutputs(loss, vocabulary, subset_logprob, **outputs)
