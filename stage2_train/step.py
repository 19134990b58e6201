"""One optimizer step of stage 2, in the order the loop calls it: take the step's micro-batches,
scale their losses by counts known before any forward pass, run each micro-batch's forward and
backward (summing what the step logs on the device), step the optimizer, then read the step's
sums in its one host sync.

Loss normalization (--loss-normalization, pipeline.guidance.loss_denominator): a step's loss is
its kept tokens' summed student loss over N, all its valid target tokens across its micro-batches
and ranks (paper eq. 3; `all`), or over the tokens it keeps (`kept`). Either is known from the
data before any forward pass, so each micro-batch backpropagates its kept-loss sum divided by
that total (times the world size, which DDP/FSDP gradient averaging divides out again).

Distillation modes (pipeline.distillation) add weight x their term's mean over the step's units
(tokens or chunks, counted from the data on every rank before the forward pass, the same way).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeline.cross_entropy import IGNORE_INDEX
from pipeline.guidance import guided_loss, loss_denominator, mapped_tokens
from pipeline.head_outputs import HeadReads
from stage2_train.distributed import Runtime
from stage2_train.forward import extras_of, student_forward
from stage2_train.parallel import gradient_sync

if TYPE_CHECKING:
    from stage2_train.run_setup import Run


@dataclass
class StepSums:
    """What a step sums on the device across its micro-batches: the kept and all tokens' loss,
    the kept, mapped and valid target tokens, the ranks' stop votes, the distillation term and
    its units. Each field is a view of `buffer` (added to in place), so the step reads all of
    them in one sync."""

    kept_loss: torch.Tensor
    all_loss: torch.Tensor
    kept: torch.Tensor
    mapped: torch.Tensor
    valid: torch.Tensor
    stop_votes: torch.Tensor
    distill_loss: torch.Tensor
    distill_units: torch.Tensor
    buffer: torch.Tensor = dataclasses.field(repr=False)

    @classmethod
    def zeros(cls, device: torch.device) -> StepSums:
        names = cls.names()
        buffer = torch.zeros(len(names), dtype=torch.float64, device=device)
        return cls(**{name: buffer[index] for index, name in enumerate(names)}, buffer=buffer)

    @classmethod
    def names(cls) -> list[str]:
        """The summed fields, in the buffer's order."""
        return [field.name for field in dataclasses.fields(cls) if field.name != "buffer"]

    def read(self, runtime: Runtime, grad_norm: torch.Tensor) -> StepTotals:
        """Summed over ranks and brought to the host with the gradient norm: the step's one sync."""
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
            grad_norm = grad_norm.full_tensor()
        both = torch.cat((runtime.all_reduce_sum(self.buffer), grad_norm.detach().double().view(1)))
        return StepTotals(**dict(zip([*self.names(), "grad_norm"], both.tolist(), strict=True)))


@dataclass(frozen=True)
class StepTotals:
    """A step's sums over every rank, on the host (StepSums' fields), and its gradient norm."""

    kept_loss: float
    all_loss: float
    kept: float
    mapped: float
    valid: float
    stop_votes: float
    distill_loss: float
    distill_units: float
    grad_norm: float


@dataclass(frozen=True)
class StepScales:
    """What each micro-batch's summed losses are multiplied by before backward, from the whole
    step's counts; `units`: each micro-batch's distillation units (None without distillation)."""

    loss: torch.Tensor
    distillation: torch.Tensor
    units: list[torch.Tensor] | None


def selection_generator(seed: int, step: int, micro: int, rank: int) -> torch.Generator:
    """Seeded per (seed, step, micro-batch, rank): random selection replays exactly on resume."""
    state = np.random.SeedSequence([seed, step, micro, rank]).generate_state(1)[0]
    return torch.Generator().manual_seed(int(state))


def take_micro_batches(run: Run, stream: Iterator[dict]) -> list[dict]:
    """This rank's micro-batches of the step, each observed by the data position it advances."""
    micro_batches = [next(stream) for _ in range(run.accumulation)]
    for batch in micro_batches:
        run.data_state.observe(batch)
    return micro_batches


def step_scales(run: Run, micro_batches: list[dict]) -> StepScales:
    """The loss and distillation scales of a step, from every rank's counts (counted on the host
    copies; the totals stay on the device)."""
    runtime, distillation = run.runtime, run.distillation
    step_valid = torch.stack([batch["labels"] for batch in micro_batches]) != IGNORE_INDEX
    step_teacher_loss = torch.stack([batch["teacher_loss"] for batch in micro_batches])
    mapped = mapped_tokens(step_teacher_loss, step_valid).sum(dim=(1, 2))
    counts = torch.stack([mapped, step_valid.sum(dim=(1, 2))], dim=1)  # [micro, (mapped, valid)]
    units = None
    if distillation is not None:  # the distillation term's units, counted like the tokens
        units = [distillation.units(b["labels"], extras_of(b, distillation)) for b in micro_batches]
        counts = torch.cat((counts, torch.stack(units).view(-1, 1)), dim=1)
    counts = runtime.all_gather(counts.to(runtime.device, non_blocking=True))
    denominator = loss_denominator(counts[..., :2], run.settings)
    # the float64 quotients rounded once to the loss's float32
    scale = (runtime.world_size / denominator.clamp(min=1).double()).float()
    distill_scale = (runtime.world_size / counts[..., 2:].sum().clamp(min=1).double()).float()
    return StepScales(loss=scale, distillation=distill_scale, units=units)


def forward_backward(run: Run, step: int, micro_batches: list[dict]) -> StepSums:
    """Every micro-batch's forward and backward pass; the gradients sync on the last one."""
    scales = step_scales(run, micro_batches)
    sums = StepSums.zeros(run.runtime.device)
    for micro, batch in enumerate(micro_batches):
        with gradient_sync(run.model, micro == len(micro_batches) - 1):
            micro_forward_backward(run, step, micro, batch, scales, sums)
    return sums


def micro_forward_backward(
    run: Run, step: int, micro: int, batch: dict, scales: StepScales, sums: StepSums
) -> None:
    """One micro-batch's guided loss (and distillation term) backpropagated, added to `sums`."""
    device, distillation = run.runtime.device, run.distillation
    labels = batch["labels"].to(device, non_blocking=True)
    teacher = batch["teacher_loss"].to(device, non_blocking=True)
    extras = reads = None
    if distillation is not None:
        extras = extras_of(batch, distillation, device)
        reads = distillation.reads(extras, run.subset)
    compute, loss_kernel = run.resolved.autocast(), run.resolved.loss_kernel
    student = student_forward(
        run.model, batch, labels, reads or HeadReads(), compute, loss_kernel, device
    )
    result = guided_loss(
        student.loss,
        teacher,
        labels != IGNORE_INDEX,
        run.settings,
        generator=selection_generator(run.config.optimizer.seed, step, micro, run.runtime.rank),
        chunk_start=batch.get("chunk_start"),
    )
    objective = result.kept_loss_sum * scales.loss
    if distillation is not None:
        term = distillation.loss_sum(student, labels, extras)
        objective = objective + distillation.weight * term * scales.distillation
        sums.distill_loss += term.detach().double()
        sums.distill_units += scales.units[micro]
    objective.backward()
    sums.kept_loss += result.kept_loss_sum.detach().double()
    sums.all_loss += result.loss_sum.double()
    sums.kept += result.kept.double()
    sums.mapped += result.mapped.double()
    sums.valid += result.valid.double()


def optimizer_step(run: Run) -> tuple[float, torch.Tensor]:
    """Clip, step and schedule; returns the step's learning rate and (device) gradient norm."""
    lr = run.scheduler.get_last_lr()[0]
    grad_norm = torch.nn.utils.clip_grad_norm_(
        run.model.parameters(), run.config.optimizer.grad_clip or float("inf")
    )
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return lr, grad_norm
