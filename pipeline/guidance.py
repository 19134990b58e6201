"""Teacher-guided selective loss (paper section 3.2, eq. 3-4, and the ablations of section 6).

Every student target token t has a per-token student loss L_S(t) and, from the data path, the
aggregated loss of the teacher tokens it is aligned to, L_T(t) (NaN = unmapped: no teacher token
covers it, or none of them was scored). The weight W(t) of eq. 4 is 1 for the kept tokens and 0
otherwise; the loss is the mean student loss over the kept tokens.

Modes (`GuidanceSettings.mode`):
  token   the method: candidates are the mapped tokens, ranked by excess = L_S - L_T.
  chunk   the paper's Table 2 baseline: the same selection; only the data path differs (L_T comes
          from equal-chunk alignment instead of token alignment).
  random  the control: the same candidates and the same number kept, ranked by seeded uniform
          noise instead of excess.
  none    plain continual pretraining: every valid token is kept.
Same-vocabulary guidance (Rho-1) is `token` with the same tokenizer on both sides: alignment is
then the identity and L_T is the teacher's own per-token loss.

Unmapped tokens (`unmapped`, paper 6.2): `include` keeps all of them beside the top-k of the mapped
tokens; `exclude` drops them; `mean` gives them the mean L_T of the mapped tokens in the selection
scope and lets them compete in the top-k with everyone else (with no mapped token in scope the
constant is 0: any constant ranks them among themselves by L_S alone).

How many are kept, and ties: out of n candidates exactly k = ceil(topk * n) are kept (so any
candidate set keeps at least one, and the kept count is known from the masks alone, before the
forward pass). The k highest scores win; tokens tied at the threshold are taken in position
order (earlier first), with positions in (rank, row, column) order for the global scope. Hence
the selection is deterministic and never keeps more than k.

Scope (`scope`): `microbatch` ranks each rank's micro-batch on its own; `global` ranks the union of
the same micro-step on all ranks (one threshold across the data-parallel group, via all_gather).

No host sync: k, the selection and the counts are device tensors (k = ceil(topk * n) is computed
from the candidate count on the device), so a training loop can queue micro-batch after
micro-batch and read the counts once per logged step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.choices import GUIDANCE_MODES, SELECTION_SCOPES, UNMAPPED_STRATEGIES
from pipeline.collectives import all_gather, rank_and_world


@dataclass(frozen=True)
class GuidanceSettings:
    """The one declaration of the guidance defaults (paper: top 40% by excess loss, unmapped
    tokens included): stage 2's options, `vocagno cache inspect` and the demo read them here."""

    mode: str = "token"
    topk: float = 0.4
    unmapped: str = "include"
    scope: str = "microbatch"

    def __post_init__(self) -> None:
        if self.mode not in GUIDANCE_MODES:
            raise ValueError(f"guidance must be one of {GUIDANCE_MODES}, not {self.mode!r}")
        if not 0.0 < self.topk <= 1.0:
            raise ValueError(f"topk must be in (0, 1], not {self.topk}")
        if self.unmapped not in UNMAPPED_STRATEGIES:
            raise ValueError(
                f"unmapped must be one of {UNMAPPED_STRATEGIES}, not {self.unmapped!r}"
            )
        if self.scope not in SELECTION_SCOPES:
            raise ValueError(
                f"selection scope must be one of {SELECTION_SCOPES}, not {self.scope!r}"
            )


DEFAULT_GUIDANCE = GuidanceSettings()


@dataclass(frozen=True)
class GuidedLoss:
    """One micro-batch's selective loss and the counts behind the logged statistics, all 0-dim
    tensors on the loss's device (reading one on the host waits for the device)."""

    kept_loss_sum: torch.Tensor  # sum of student loss over kept tokens; carries the gradient
    loss_sum: torch.Tensor  # sum of student loss over all valid tokens (detached)
    kept: torch.Tensor  # int64 token counts
    mapped: torch.Tensor
    valid: torch.Tensor

    @property
    def loss(self) -> torch.Tensor:
        """Mean over kept tokens (0 with a gradient path when nothing is kept)."""
        return self.kept_loss_sum / self.kept.clamp(min=1)

    @property
    def loss_all(self) -> torch.Tensor:
        """Mean over all valid tokens (detached)."""
        return self.loss_sum / self.valid.clamp(min=1)


def mapped_tokens(teacher_loss: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Valid tokens that have a teacher loss (the candidates of token/chunk/random selection)."""
    return valid & ~torch.isnan(teacher_loss)


def selection_size(num_candidates: int | torch.Tensor, topk: float) -> int | torch.Tensor:
    """k = ceil(topk * n), rounded to 9 decimals first so that 0.7 * 10 is 7, not 8 (float error).

    For an int n, an int; for a tensor of counts, a tensor on its device (no host sync).
    """
    count = torch.as_tensor(num_candidates)
    size = torch.ceil(torch.round(count.double() * topk, decimals=9)).long()
    return size if isinstance(num_candidates, torch.Tensor) else int(size)


def planned_kept(
    mapped: int | torch.Tensor, valid: int | torch.Tensor, settings: GuidanceSettings
) -> int | torch.Tensor:
    """How many tokens one selection keeps, from the counts alone (no student loss needed);
    ints or tensors of counts, elementwise."""
    if settings.mode == "none":
        return valid
    if settings.unmapped == "mean":
        return selection_size(valid, settings.topk)
    kept = selection_size(mapped, settings.topk)
    return kept + (valid - mapped) if settings.unmapped == "include" else kept


def kept_in_step(counts: torch.Tensor, settings: GuidanceSettings) -> torch.Tensor:
    """Tokens one optimizer step keeps over all ranks, from counts [world, micro_steps, 2] of
    (mapped, valid): the denominator that makes the step's loss a mean over its kept tokens.
    A 0-dim int64 tensor on the counts' device."""
    counts = counts.long()
    if settings.scope == "global":
        counts = counts.sum(dim=0, keepdim=True)  # one selection per micro-step across ranks
    return planned_kept(counts[..., 0], counts[..., 1], settings).sum()


def top_k_mask(score: torch.Tensor, candidate: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
    """The min(k, #candidates) highest-scoring candidates; ties go to earlier positions.

    `k` may be a 0-dim tensor: ranks are compared with it on the device.
    """
    flat_candidate = candidate.flatten()
    # Two stable sorts: by score (ties stay in position order), then candidates before the rest,
    # which keeps the candidates' score order. A candidate's place in the result is its rank.
    by_score = torch.sort(score.flatten(), descending=True, stable=True).indices
    candidates_first = torch.sort(
        flat_candidate[by_score].to(torch.uint8), descending=True, stable=True
    ).indices
    order = by_score[candidates_first]
    in_top_k = torch.empty_like(flat_candidate)
    in_top_k[order] = torch.arange(order.numel(), device=order.device) < k
    return (in_top_k & flat_candidate).view(candidate.shape)


def _select(
    student_loss: torch.Tensor,
    teacher_loss: torch.Tensor,
    valid: torch.Tensor,
    settings: GuidanceSettings,
    noise: torch.Tensor | None,
) -> torch.Tensor:
    mapped = mapped_tokens(teacher_loss, valid)
    if settings.unmapped == "mean":
        candidate = valid
        # The mapped tokens' mean teacher loss, 0 when none is mapped (float64: the sum does not
        # depend on where the unmapped zeros fall).
        mapped_sum = torch.where(mapped, teacher_loss.double(), 0.0).sum()
        mean = (mapped_sum / mapped.sum().clamp(min=1)).to(teacher_loss.dtype)
        teacher_loss = torch.where(mapped, teacher_loss, mean)
    else:
        candidate = mapped
    score = noise if settings.mode == "random" else student_loss - teacher_loss
    keep = top_k_mask(score, candidate, selection_size(candidate.sum(), settings.topk))
    if settings.unmapped == "include":
        keep |= valid & ~mapped
    return keep


def select_tokens(
    student_loss: torch.Tensor,
    teacher_loss: torch.Tensor,
    valid: torch.Tensor,
    settings: GuidanceSettings,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The keep mask W of eq. 4 for one micro-batch ([B, T] bool).

    `student_loss` is detached here: selection decides which tokens count, it is not trained.
    With the global scope every rank must call this at the same micro-step with the same shape.
    """
    if settings.mode == "none":
        return valid
    student_loss = student_loss.detach().float()
    teacher_loss = teacher_loss.float()
    noise = None
    if settings.mode == "random":
        # Drawn on the CPU generator (the same noise on any device); copied without waiting.
        noise = torch.rand(student_loss.shape, generator=generator, dtype=torch.float32)
        noise = noise.to(student_loss.device, non_blocking=True)
    rank, world = rank_and_world()
    if settings.scope == "microbatch" or world == 1:
        return _select(student_loss, teacher_loss, valid, settings, noise)
    # One all_gather of the stacked inputs; every rank then makes the same global selection and
    # keeps its own rows, so the threshold and the tie order are shared.
    local = torch.stack(
        [student_loss, teacher_loss, valid.float(), noise if noise is not None else student_loss]
    )
    gathered = all_gather(local)  # [world, 4, B, T]
    joined = gathered.transpose(0, 1).reshape(4, -1, local.shape[-1])  # ranks' rows in order
    keep = _select(joined[0], joined[1], joined[2].bool(), settings, joined[3])
    rows = student_loss.shape[0]
    return keep[rank * rows : (rank + 1) * rows]


def guided_loss(
    student_loss: torch.Tensor,
    teacher_loss: torch.Tensor,
    valid: torch.Tensor,
    settings: GuidanceSettings,
    generator: torch.Generator | None = None,
) -> GuidedLoss:
    """Select (eq. 4) and reduce (eq. 3): the student loss summed over kept tokens, with counts."""
    keep = select_tokens(student_loss, teacher_loss, valid, settings, generator)
    mapped = mapped_tokens(teacher_loss, valid)
    zero = student_loss.new_zeros(())
    return GuidedLoss(
        kept_loss_sum=torch.where(keep, student_loss, zero).sum(),
        loss_sum=torch.where(valid, student_loss.detach(), zero).sum(),
        kept=keep.sum(),
        mapped=mapped.sum(),
        valid=valid.sum(),
    )
