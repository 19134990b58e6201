"""Held-out evaluation during training (`--eval-every N`): the student's plain next-token
cross-entropy on documents it never trains on (stage2_train.data.heldout), as the mean over the
scored tokens (`eval_loss`, nats) and in bits per character (`eval_bits_per_char`, as
pipeline.bits_per_character defines it for `vocagno eval` too).

It runs under torch.no_grad with the model in eval mode (then back in train mode), through the
training forward pass (the same autocast and --loss-kernel), and consumes no random numbers, so a
resumed run measures what the uninterrupted one did.

The same on every world size, to the bit: batch b (fixed by the held-out set alone) runs on rank
b % world size; each rank writes its batches' loss sums (float64) into a vector of one slot per
batch, zeros elsewhere, and the ranks' vectors are summed (a value plus zeros is exact), then
summed over the batches in batch order on every rank. A rank with no batch in the last round runs
batch 0 again and discards it, so that every rank takes part in each forward pass's collectives
(FSDP's gathers). One host sync per evaluation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from pipeline.bits_per_character import bits_per_character
from pipeline.head_outputs import HeadReads
from stage2_train.data.heldout import HeldOut
from stage2_train.distributed import Runtime
from stage2_train.forward import student_forward


@dataclass(frozen=True)
class Evaluation:
    loss: float  # nats per scored token
    bits_per_char: float
    seconds: float  # wall time of the evaluation on this rank

    def fields(self) -> dict:
        """Its fields in the step's metrics record."""
        return {"eval_loss": self.loss, "eval_bits_per_char": self.bits_per_char,
                "eval_seconds": round(self.seconds, 3)}  # fmt: skip


def evaluate(
    model: nn.Module, heldout: HeldOut, runtime: Runtime, autocast, loss_kernel: str
) -> Evaluation:
    """The held-out loss of `model` (wrapped as it trains); `autocast()`: the training forward
    pass's compute context."""
    started = time.monotonic()
    count, world, device = len(heldout.batches), runtime.world_size, runtime.device
    nats = torch.zeros(count, dtype=torch.float64, device=device)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for first in range(0, count, world):
                index = first + runtime.rank
                batch = heldout.batches[index if index < count else 0]
                labels = batch["labels"].to(device, non_blocking=True)
                outputs = student_forward(
                    model, batch, labels, HeadReads(), autocast(), loss_kernel, device
                )
                if index < count:
                    nats[index] = outputs.loss.double().sum()
    finally:
        model.train(training)
    total = runtime.all_reduce_sum(nats).sum().item()
    return Evaluation(
        loss=total / heldout.tokens,
        bits_per_char=bits_per_character(total, heldout.characters),
        seconds=time.monotonic() - started,
    )
