"""`--guidance alm`: Approximate Likelihood Matching trained from the cache (docs/alm.md).

Minixhofer, Vulić and Ponti, "Universal Cross-Tokenizer Distillation via Approximate Likelihood
Matching" (arXiv:2503.20083); reference implementation bminixhofer/tokenkit
(`tokenkit/training/losses.py: compute_alm_loss`, defaults of `tokenkit/scripts/cross_tokenizer_distill.py`:
`alm_mode = merge_by_space_prob+append_space`, `tokenizer_pair_bias_threshold = 0.1`,
`alm_diff_fn = binary_ce`, `binarization_temp = 100`, ε = 1e-6, the main path averaged over
chunks, trained as `losses = [sft, alm_unconstrained]`: cross-entropy + weight x ALM).

The data path (pipeline.distillation.alm_chunks) gives every student token, target-aligned, its
index within its (merged) chunk and, at the chunk's last token, the teacher's chunk
log-probability. Here the student's side: the sum of its own log-probabilities over the chunk's
tokens (a difference of a per-row cumulative sum) plus, with `append_space`, log Σ_{v∈S} p(v)
after the chunk's last token, S the student tokenizer's space mask (pipeline.space_mask), which
the trainer computes in the cross-entropy's pass over the vocabulary (`vocabulary_subset`): the
distribution after reading the token at target slot s is the one at slot s + 1 of the same row.
A chunk counts (a unit of the mean) only when all of its tokens are targets of this micro-batch
in one unbroken run of its row, and, with `append_space`, when slot s + 1 is in the row too; so a
chunk cut by a row's or a split document's boundary is left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.cache.schema import SPACE_LOGPROB
from pipeline.cross_entropy import IGNORE_INDEX
from pipeline.distillation import AlignedRead
from pipeline.distillation.alm_chunks import teacher_chunks
from pipeline.head_outputs import HeadOutputs, HeadReads

INDEX = "alm_chunk_index"  # int32 per token: its index within its chunk, -1 outside a kept one
TEACHER = "alm_teacher_logprob"  # float32 at a chunk's last token: the teacher's chunk log-prob
EPSILON = 1e-6  # tokenkit's binary_ce epsilon


def mode_parts(mode: str) -> tuple[bool, bool]:
    """(merge by space probability, append the space log-probability) of an --alm-mode."""
    return "merge_by_space_prob" in mode, "append_space" in mode


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of log(1/2)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def binary_ce(teacher: torch.Tensor, student: torch.Tensor, temperature: float) -> torch.Tensor:
    """tokenkit's `binary_ce`: the cross-entropy of the Bernoulli variables with log-probability
    logp / temperature - ε of the teacher (target) and the student, per chunk."""
    log_t = teacher / temperature - EPSILON
    log_s = student / temperature - EPSILON
    return -(torch.exp(log_t) * log_s - torch.expm1(log_t) * log1mexp(log_s))


def closing_slots(labels: torch.Tensor, index: torch.Tensor, teacher: torch.Tensor,
                  need_next: bool) -> torch.Tensor:  # fmt: skip
    """[B, W] bool: the slots where a chunk this micro-batch trains on closes: a teacher value
    there, every slot back to the chunk's first a target with the index one less than the next,
    and (need_next) a target in the slot after it (in a packed row only the EOS chunk, which
    never counts, is followed by a non-target). From the data alone (`units` counts these)."""
    width = labels.shape[-1]
    target = (labels != IGNORE_INDEX) & (index >= 0)
    previous = torch.nn.functional.pad(index[..., :-1], (1, 0), value=-2)
    unbroken = target & ((index == 0) | (previous == index - 1))
    slot = torch.arange(width, device=labels.device).expand_as(index)
    last_break = torch.cummax(torch.where(unbroken, -1, slot), dim=-1).values
    closes = ~torch.isnan(teacher) & (last_break < slot - index)
    if need_next:  # the next slot's distribution is read, normalized by its cross-entropy
        closes &= torch.nn.functional.pad(labels[..., 1:] != IGNORE_INDEX, (0, 1), value=False)
    return closes


def student_chunk_logprobs(student_loss: torch.Tensor, labels: torch.Tensor, index: torch.Tensor,
                           space_logprob: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """[B, W] float64: at a chunk's last slot s, the student's chunk log-probability: its
    log-probabilities of slots s - index[s] .. s, plus (space_logprob given) its space
    log-probability after slot s's token, at slot s + 1 (0 past the row). Meaningless elsewhere.

    The log-probabilities are -student_loss, the trainer's cross-entropy, and the space
    log-probability comes from the same pass over the vocabulary
    (pipeline.head_outputs).
    """
    target = labels != IGNORE_INDEX
    token = torch.where(target, -student_loss, 0.0).double()
    running = torch.nn.functional.pad(token.cumsum(dim=-1), (1, 0))  # running[s] = sum before s
    width = labels.shape[-1]
    slot = torch.arange(width, device=labels.device).expand_as(index)
    begin = (slot - index.long()).clamp(0, width)
    chunk = running[..., 1:] - running.gather(-1, begin)
    if space_logprob is not None:  # a closing chunk's next slot
        chunk = chunk + torch.nn.functional.pad(space_logprob[..., 1:], (0, 1)).double()
    return chunk


@dataclass(frozen=True)
class AlmDistillation:
    """ALM as a pipeline.distillation.Distillation (frozen: it travels to data-loader workers)."""

    weight: float
    temperature: float
    merge_threshold: float
    mode: str
    # the student tokenizer's space mask S, bool [V] (append_space only)
    space_mask: np.ndarray | None = field(default=None, compare=False, repr=False)
    name: str = "alm"
    extra_names: tuple[str, ...] = (INDEX, TEACHER)

    @property
    def vocabulary_subset(self) -> np.ndarray | None:
        return self.space_mask if mode_parts(self.mode)[1] else None

    @property
    def cache_columns(self) -> tuple[str, ...]:
        return (SPACE_LOGPROB,) if any(mode_parts(self.mode)) else ()

    def extras(self, read: AlignedRead) -> dict[str, np.ndarray]:
        merge, append = mode_parts(self.mode)
        index, teacher = teacher_chunks(
            read.student_end,
            read.student_lengths,
            read.teacher_end,
            read.teacher_lengths,
            read.teacher_loss,
            read.text_lengths,
            read.teacher_columns.get(SPACE_LOGPROB),
            merge_threshold=self.merge_threshold if merge else None,
            append_space=append,
        )
        return {INDEX: index, TEACHER: teacher}

    def units(self, labels: torch.Tensor, extras: dict[str, torch.Tensor]) -> torch.Tensor:
        closes = closing_slots(labels, extras[INDEX], extras[TEACHER], mode_parts(self.mode)[1])
        return closes.sum()

    def reads(self, extras: dict[str, torch.Tensor], subset: torch.Tensor | None) -> HeadReads:
        return HeadReads(subset=subset)

    def loss_sum(
        self, student: HeadOutputs, labels: torch.Tensor, extras: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        index, teacher = extras[INDEX], extras[TEACHER]
        closes = closing_slots(labels, index, teacher, mode_parts(self.mode)[1])
        chunk = student_chunk_logprobs(student.loss, labels, index, student.subset_logprob)
        # Unused slots get a harmless -1 on both sides, so no NaN reaches the gradient.
        chunk = torch.where(closes, chunk, -1.0)
        teacher = torch.where(closes, teacher.double(), -1.0)
        per_chunk = binary_ce(teacher, chunk, self.temperature)
        return torch.where(closes, per_chunk, 0.0).sum().float()


def alm_distillation(options, student) -> AlmDistillation:
    """The ALM term of a stage-2 run (its GuidanceOptions' --alm-* options); the student's space
    mask comes from its own tokenizer (`student`: the run's ModelOptions)."""
    from pipeline.space_mask import space_mask
    from pipeline.tokenizer import load_tokenizer

    mask = None
    if mode_parts(options.alm_mode)[1]:
        mask = space_mask(load_tokenizer(student.tokenizer_spec()))[0]
    return AlmDistillation(
        weight=options.alm_weight,
        temperature=options.alm_temperature,
        merge_threshold=options.alm_merge_threshold,
        mode=options.alm_mode,
        space_mask=mask,
    )
