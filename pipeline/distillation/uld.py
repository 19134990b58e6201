"""Universal Logit Distillation from the cache (`--guidance uld`; VocAgnoLM Table 1 "ULD", appendix
B eq. 6; Boizard et al., 2025): the cross-entropy on every token plus --uld-lambda times the
Wasserstein-1 distance between the student's and the teacher's next-token distributions, each
sorted by probability so that no vocabulary mapping is needed.

Boizard et al. sort both full distributions in descending order, pad the shorter with zeros and
sum |p_S(k) - p_T(k)| over the ranks k. The cache holds the teacher's top K only, so this compares
the K top ranks exactly and the two masses outside them as one more term (docs/distillation.md):

    d = sum_{k<=K} |s_(k) - t_(k)|  +  |s_rest - t_rest|

which is a lower bound of the full-vocabulary distance and equals it when the tails beyond rank K
differ in one direction only (then sum_{k>K} |s_(k) - t_(k)| = |s_rest - t_rest|).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeline.cache.schema import TOPK_PROBS, TOPK_REST
from pipeline.distillation.topk import PROBS, REST, PairedTopkTerm
from pipeline.head_outputs import HeadReads


def uld_distance(
    student_top: torch.Tensor,
    log_z: torch.Tensor,
    teacher_probs: torch.Tensor,
    teacher_rest: torch.Tensor,
) -> torch.Tensor:
    """Per position [...], the sorted-distribution distance above in float32 between the student,
    given as its largest logits in descending order [..., min(K, V)] and its log normalizer
    [...], and the teacher's descending top-K [..., K] with its rest mass [...]. A student
    vocabulary smaller than K is padded with zero probabilities, as ULD pads the shorter
    distribution."""
    k = teacher_probs.shape[-1]
    student = torch.exp(student_top - log_z[..., None])
    student = F.pad(student, (0, k - student.shape[-1]))
    student_rest = (1 - student.sum(-1)).clamp(min=0)
    return (student - teacher_probs).abs().sum(-1) + (student_rest - teacher_rest).abs()


@dataclass(frozen=True)
class UniversalLogitDistillation(PairedTopkTerm):
    """ULD over the cached top-k (pipeline.distillation.Distillation); its term's mean is over the
    student tokens paired with a scored teacher position (unmapped ones get cross-entropy only)."""

    weight: float = 0.5  # lambda; the paper's choice (appendix B, Figure 7b)
    name: str = "uld"
    cache_columns: tuple[str, ...] = (TOPK_PROBS, TOPK_REST)  # no ids: ranks need none
    extra_names: tuple[str, ...] = (PROBS, REST)

    def reads(self, extras, subset):
        return HeadReads(top=extras[PROBS].shape[-1])  # the student's top K, no sort of V

    def per_token(self, student, probs, rest, extras):
        return uld_distance(student.top, student.log_z, probs, rest)
