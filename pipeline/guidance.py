"""Teacher-guided selective loss (paper section 3.2, eq. 3-4; Table 2's chunk baseline; the
ablations of section 6).

Every student target token t has a per-token student loss L_S(t) (eq. 1) and, from the data path,
the aggregated loss of the teacher tokens it is aligned to, L_T(t) (eq. 2; NaN = unmapped: no
teacher token covers it, or none of them was scored). The weight W(t) of eq. 4 is 1 for the kept
tokens and 0 otherwise.

The loss (eq. 3, `LOSS_NORMALIZATIONS`): L = -E_{i~[1,N]}[W(x_i) log P(x_i)], the expectation over
all N target tokens, i.e. the sum of the student loss over the kept tokens divided by the number
of target tokens (`all`, the default). `kept` divides by the number kept instead (a mean over
kept tokens, not in the paper: at top-k 40% its gradients are about 2.4x larger, which changes
the effective learning rate and how often clipping bites). For a step, N is counted over all
its micro-batches and ranks (`loss_denominator`).

Modes (`GuidanceSettings.mode`), each declared once in `MODES` (what it ranks by, what unit it
selects, which alignment the data path must give it):
  token         the method: candidates are the mapped tokens, ranked by excess = L_S - L_T.
  random        the control: the same candidates and the same number kept, ranked by seeded
                uniform noise instead of excess.
  chunk         the paper's Table 2 baseline ("Chunking Alignment / Teacher"): each document's
                student and teacher tokens are cut into `num_chunks` equal chunks, student chunk c
                maps to teacher chunk c, and CHUNKS are selected (see "Chunks" below).
  random-chunk  Table 2's control ("Chunking Alignment / Random"): the same chunks, the same
                number of chunks kept, ranked by seeded noise.
  none          plain continual pretraining: every valid token is kept.
Same-vocabulary guidance (Rho-1) is `token` with the same tokenizer on both sides: alignment is
then the identity and L_T is the teacher's own per-token loss.

Unmapped tokens (`unmapped`, paper 6.2): `include` keeps all of them beside the top-k of the mapped
tokens; `exclude` drops them; `mean` gives them the mean L_T of the mapped tokens in the selection
scope and lets them compete in the top-k with everyone else (with no mapped token in scope the
constant is 0: any constant ranks them among themselves by L_S alone).

How many are kept, and ties: out of n candidates exactly k = ceil(topk * n) are kept (so any
candidate set keeps at least one). The k highest scores win; tied candidates are taken in position
order (earlier first), with positions in (rank, row, column) order for the global scope. Hence
the selection is deterministic and never keeps more than k.

Chunks (`chunk`, `random-chunk`): the data path marks where each chunk starts; the selection
reduces tokens to chunks (pipeline.chunk_selection: chunk student loss, chunk teacher loss),
ranks chunks exactly as `token` ranks tokens (k = ceil(topk * n) chunks) and keeps every valid
token of a kept chunk. Token selection is chunk selection with one-token chunks. The definitions
the paper leaves open are in pipeline.chunk_selection and docs/guidance.md.

Scope (`scope`): `microbatch` ranks each rank's micro-batch on its own; `global` ranks the union of
the same micro-step on all ranks (one threshold across the data-parallel group, via all_gather).

No host sync: k, the selection and the counts are device tensors (k = ceil(topk * n) is computed
from the candidate count on the device; chunk reductions use scatter and cumulative sums, never
`nonzero`), so a training loop can queue micro-batch after micro-batch and read the counts once
per logged step. Every reduction is deterministic (scatter max/min and cumulative sums; no atomic
float additions), so a resumed run selects bit for bit what the uninterrupted one did.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.choices import (
    CHUNK_STUDENT_AGGREGATES,
    LOSS_NORMALIZATIONS,
    SELECTION_SCOPES,
    UNMAPPED_STRATEGIES,
)
from pipeline.chunk_selection import chunk_ids, reduce_to_chunks
from pipeline.collectives import all_gather, rank_and_world
from pipeline.guidance_modes import GUIDANCE_MODES, MODES, ModeDeclaration


@dataclass(frozen=True)
class GuidanceSettings:
    """The one declaration of the guidance defaults (paper: top 40% by excess loss, unmapped
    tokens included, eq. 3's expectation over all target tokens): stage 2's options,
    `vocagno cache inspect` and the demo read them here."""

    mode: str = "token"
    topk: float = 0.4
    unmapped: str = "include"
    scope: str = "microbatch"
    normalization: str = "all"
    chunk_student_aggregate: str = "mean"

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
        if self.normalization not in LOSS_NORMALIZATIONS:
            raise ValueError(
                f"loss normalization must be one of {LOSS_NORMALIZATIONS}, "
                f"not {self.normalization!r}"
            )
        if self.chunk_student_aggregate not in CHUNK_STUDENT_AGGREGATES:
            raise ValueError(
                f"chunk student aggregate must be one of {CHUNK_STUDENT_AGGREGATES}, "
                f"not {self.chunk_student_aggregate!r}"
            )
        if self.normalization == "kept" and self.declared.needs_chunks:
            raise ValueError(
                f"--loss-normalization kept cannot serve --guidance {self.mode}: how many tokens "
                "a chunk selection keeps depends on which chunks win, so it is not known before "
                "the forward pass (use --loss-normalization all, the paper's eq. 3)"
            )

    @property
    def declared(self) -> ModeDeclaration:
        return MODES[self.mode]


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
    """How many tokens one token-unit selection keeps, from the counts alone (no student loss
    needed); ints or tensors of counts, elementwise. A chunk selection's kept count depends on
    which chunks win, so it has no plan (ValueError)."""
    declared = settings.declared
    if declared.needs_chunks:
        raise ValueError(f"--guidance {settings.mode} keeps a number of tokens known only after it")
    if declared.rank_by == "nothing":
        return valid
    if settings.unmapped == "mean":
        return selection_size(valid, settings.topk)
    kept = selection_size(mapped, settings.topk)
    return kept + (valid - mapped) if settings.unmapped == "include" else kept


def kept_in_step(counts: torch.Tensor, settings: GuidanceSettings) -> torch.Tensor:
    """Tokens one optimizer step keeps over all ranks, from counts [world, micro_steps, 2] of
    (mapped, valid). A 0-dim int64 tensor on the counts' device."""
    counts = counts.long()
    if settings.scope == "global":
        counts = counts.sum(dim=0, keepdim=True)  # one selection per micro-step across ranks
    return planned_kept(counts[..., 0], counts[..., 1], settings).sum()


def loss_denominator(counts: torch.Tensor, settings: GuidanceSettings) -> torch.Tensor:
    """What a step's summed kept loss is divided by, from counts [world, micro_steps, 2] of
    (mapped, valid): N, the step's valid target tokens (eq. 3, `all`), or the tokens it keeps
    (`kept`). A 0-dim int64 tensor on the counts' device, known before any forward pass."""
    if settings.normalization == "all":
        return counts[..., 1].long().sum()
    return kept_in_step(counts, settings)


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
    """Eq. 4 over units (tokens, or chunks reduced to one value each)."""
    mapped = mapped_tokens(teacher_loss, valid)
    if settings.unmapped == "mean":
        candidate = valid
        # The mapped units' mean teacher loss, 0 when none is mapped (float64: the sum does not
        # depend on where the unmapped zeros fall).
        mapped_sum = torch.where(mapped, teacher_loss.double(), 0.0).sum()
        mean = (mapped_sum / mapped.sum().clamp(min=1)).to(teacher_loss.dtype)
        teacher_loss = torch.where(mapped, teacher_loss, mean)
    else:
        candidate = mapped
    score = noise if settings.declared.rank_by == "noise" else student_loss - teacher_loss
    keep = top_k_mask(score, candidate, selection_size(candidate.sum(), settings.topk))
    if settings.unmapped == "include":
        keep |= valid & ~mapped
    return keep


def _select_chunks(
    student_loss: torch.Tensor,
    teacher_loss: torch.Tensor,
    valid: torch.Tensor,
    settings: GuidanceSettings,
    noise: torch.Tensor | None,
    chunk_start: torch.Tensor,
) -> torch.Tensor:
    """Reduce tokens to chunks, select chunks with `_select`, keep every valid token of a kept
    chunk."""
    chunk = chunk_ids(chunk_start)
    chunk_student, chunk_teacher, has_valid = reduce_to_chunks(
        chunk, student_loss, teacher_loss, valid, settings.chunk_student_aggregate
    )
    chunk_noise = None if noise is None else noise.flatten()
    keep_chunk = _select(chunk_student, chunk_teacher, has_valid, settings, chunk_noise)
    return (keep_chunk[chunk] & valid.flatten()).view(valid.shape)


def _select_units(student_loss, teacher_loss, valid, settings, noise, chunk_start):
    if settings.declared.needs_chunks:
        return _select_chunks(student_loss, teacher_loss, valid, settings, noise, chunk_start)
    return _select(student_loss, teacher_loss, valid, settings, noise)


def select_tokens(
    student_loss: torch.Tensor,
    teacher_loss: torch.Tensor,
    valid: torch.Tensor,
    settings: GuidanceSettings,
    generator: torch.Generator | None = None,
    chunk_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """The keep mask W of eq. 4 for one micro-batch ([B, T] bool).

    `student_loss` is detached here: selection decides which tokens count, it is not trained.
    `chunk_start` ([B, T] bool, from the data path) marks the first target token of each chunk;
    chunk modes need it. With the global scope every rank must call this at the same micro-step
    with the same shape.
    """
    declared = settings.declared
    if declared.rank_by == "nothing":
        return valid
    if declared.needs_chunks:
        if chunk_start is None:
            raise ValueError(f"--guidance {settings.mode} needs the chunk starts of the data path")
        chunk_start = chunk_start.to(valid.device, non_blocking=True).clone()
        chunk_start.view(-1)[0] = True  # a micro-batch's first token starts a chunk (piece)
    student_loss = student_loss.detach().float()
    teacher_loss = teacher_loss.float()
    noise = None
    if declared.rank_by == "noise":
        # Drawn on the CPU generator (the same noise on any device); copied without waiting.
        noise = torch.rand(student_loss.shape, generator=generator, dtype=torch.float32)
        noise = noise.to(student_loss.device, non_blocking=True)
    rank, world = rank_and_world()
    if settings.scope == "microbatch" or world == 1:
        return _select_units(student_loss, teacher_loss, valid, settings, noise, chunk_start)
    # One all_gather of the stacked inputs; every rank then makes the same global selection and
    # keeps its own rows, so the threshold and the tie order are shared.
    starts = chunk_start.float() if chunk_start is not None else valid.float()
    local = torch.stack(
        [
            student_loss,
            teacher_loss,
            valid.float(),
            noise if noise is not None else student_loss,
            starts,
        ]
    )
    gathered = all_gather(local)  # [world, 5, B, T]
    joined = gathered.transpose(0, 1).reshape(5, -1, local.shape[-1])  # ranks' rows in order
    keep = _select_units(
        joined[0], joined[1], joined[2].bool(), settings, joined[3], joined[4].bool()
    )
    rows = student_loss.shape[0]
    return keep[rank * rows : (rank + 1) * rows]


def guided_loss(
    student_loss: torch.Tensor,
    teacher_loss: torch.Tensor,
    valid: torch.Tensor,
    settings: GuidanceSettings,
    generator: torch.Generator | None = None,
    chunk_start: torch.Tensor | None = None,
) -> GuidedLoss:
    """Select (eq. 4) and reduce (eq. 3): the student loss summed over kept tokens, with counts."""
    keep = select_tokens(student_loss, teacher_loss, valid, settings, generator, chunk_start)
    mapped = mapped_tokens(teacher_loss, valid)
    zero = student_loss.new_zeros(())
    return GuidedLoss(
        kept_loss_sum=torch.where(keep, student_loss, zero).sum(),
        loss_sum=torch.where(valid, student_loss.detach(), zero).sum(),
        kept=keep.sum(),
        mapped=mapped.sum(),
        valid=valid.sum(),
    )
