"""The stage 2 training loop: build the run, then per step its micro-batches' forward and backward,
the optimizer step, the log and the save. It reads the teacher's losses from the cache; no teacher
model is ever loaded. The run is built in stage2_train.run_setup, a step's work is in
stage2_train.step (with the loss normalization it follows), its logs in stage2_train.run_log.

Outputs in OUT: config.json, metrics.jsonl (one JSON object per optimizer step), tensorboard/ or
wandb/ (--logger), checkpoints/step-N/, and final/ (the student via save_pretrained, safetensors,
with its tokenizer and vocagno.json saying what produced it); .stage2.lock while a run writes
(stage2_train.output).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch

from pipeline.config import to_dict
from pipeline.errors import StoppedBySignal, TrainingDiverged
from pipeline.io import space_checked
from pipeline.models.model_folder import write_model_folder
from pipeline.versions import software_versions
from stage2_train.checkpoint import complete_checkpoints, save_checkpoint
from stage2_train.config import TrainConfig
from stage2_train.distributed import Runtime
from stage2_train.evaluation import Evaluation, evaluate
from stage2_train.parallel import full_state_dict, unwrapped
from stage2_train.run_log import RunLogs, diverged
from stage2_train.run_setup import Run, build_run
from stage2_train.step import StepTotals, forward_backward, optimizer_step, take_micro_batches
from stage2_train.stop_request import StopRequest


def train(config: TrainConfig) -> Path | None:
    """Run (or continue) the schedule up to --stop-at-step or --max-steps; returns OUT/final when
    the schedule is complete and saved (on rank 0; None on the others, or --no-save-at-end)."""
    runtime = Runtime.start()
    try:
        with StopRequest() as stop, contextlib.ExitStack() as output:
            final = _train(config, runtime, stop, output)
        return final if runtime.is_main else None
    finally:
        runtime.stop()


def _train(
    config: TrainConfig, runtime: Runtime, stop: StopRequest, output: contextlib.ExitStack
) -> Path | None:
    """`output` holds OUT's lock (taken once every check has passed) until the run ends."""
    torch.manual_seed(config.optimizer.seed)
    run = build_run(config, runtime, output)
    stream = run.batches()
    logs = RunLogs(run)
    step, stopping = run.start_step, False
    for step in range(run.start_step + 1, run.stop_step + 1):
        micro_batches = take_micro_batches(run, stream)
        sums = forward_backward(run, step, micro_batches)
        lr, grad_norm = optimizer_step(run)
        sums.stop_votes.fill_(stop.vote)  # every rank learns of a stop request at the same step
        totals = sums.read(runtime, grad_norm)  # the step's one host sync
        refuse_divergence(run, step, totals)
        logs.log_step(step, lr, totals, micro_batches, evaluate_at(run, step))
        stopping = totals.stop_votes > 0
        at_end = step == run.stop_step and config.checkpointing.save_at_end
        if stopping or step % config.checkpointing.save_every == 0 or at_end:
            saved = save(run, step)
        if stopping:
            break
    logs.close()
    if stopping:
        raise StoppedBySignal(
            f"stopped by request after step {step}, saved in {saved}; run the same command "
            "to resume from it",
            stop.exit_signal,
        )
    if run.stop_step < config.optimizer.max_steps or not config.checkpointing.save_at_end:
        return None
    return save_final(run)


def refuse_divergence(run: Run, step: int, totals: StepTotals) -> None:
    """Stop before saving a step whose loss or gradient norm is NaN or infinite."""
    sums = (totals.kept_loss, totals.all_loss, totals.distill_loss, totals.grad_norm)
    if not all(map(math.isfinite, sums)):
        kept_at = complete_checkpoints(run.config.checkpointing.out)
        loss = totals.kept_loss / max(totals.kept, 1)
        raise TrainingDiverged(diverged(kept_at, step, loss, totals.grad_norm))


def evaluate_at(run: Run, step: int) -> Evaluation | None:
    """The held-out evaluation at every --eval-every-th step and the schedule's last."""
    every = run.config.logging.eval_every
    if run.heldout is None or (step % every and step != run.config.optimizer.max_steps):
        return None
    return evaluate(
        run.model, run.heldout, run.runtime, run.resolved.autocast, run.resolved.loss_kernel
    )


def save(run: Run, step: int) -> Path:
    """Checkpoint `step` (model, optimizer, schedule, data positions, RNG)."""
    return save_checkpoint(
        run.config, step, run.model, run.optimizer, run.scheduler, run.data_state, run.meta,
        run.runtime,
    )  # fmt: skip


def save_final(run: Run) -> Path:
    """The student as a model folder, OUT/final (write_model_folder), with what produced it."""
    config, runtime = run.config, run.runtime
    provenance = {
        "config": to_dict(config),
        **run.meta,
        "steps": config.optimizer.max_steps,
        "teacher": run.manifest.teacher,
        "cache_producer_fingerprint": run.manifest.producer_fingerprint,
        "software": software_versions(),
    }
    state = full_state_dict(run.model)  # collective under FSDP: every rank takes part
    out = config.checkpointing.out
    final = out / "final"
    if runtime.is_main:
        with space_checked(out, "final/", "the checkpoints and metrics.jsonl are kept"):
            write_model_folder(final, unwrapped(run.model), run.tokenizer, provenance, state)
    runtime.barrier()
    return final
