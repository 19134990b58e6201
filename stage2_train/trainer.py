"""The stage 2 training loop: one flat loop, split by comments into batch / forward-backward /
step / log / save. It reads the teacher's losses from the cache; no teacher model is ever loaded.

Outputs in OUT: config.json, metrics.jsonl (one JSON object per optimizer step), tensorboard/,
checkpoints/step-N/, and final/ (the student via save_pretrained, safetensors, with its tokenizer
and vocagno.json saying what produced it); .stage2.lock while a run writes (stage2_train.output).

Loss normalization (--loss-normalization, pipeline.guidance.loss_denominator): a step's loss is
its kept tokens' summed student loss over N, all its valid target tokens across its micro-batches
and ranks (paper eq. 3; `all`), or over the tokens it keeps (`kept`). Either is known from the
data before any forward pass, so each micro-batch backpropagates its kept-loss sum divided by
that total (times the world size, which DDP/FSDP gradient averaging divides out again).

Distillation modes (pipeline.distillation) add weight x their term's mean over the step's units
(tokens or chunks, counted from the data on every rank before the forward pass, the same way).
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pipeline.cache.manifest import load_manifest
from pipeline.config import to_dict
from pipeline.cross_entropy import IGNORE_INDEX
from pipeline.distillation import vocabulary_subset_on
from pipeline.errors import StoppedBySignal, TrainingDiverged
from pipeline.flops import StepRate, flop_parameters
from pipeline.guidance import guided_loss, loss_denominator, mapped_tokens
from pipeline.head_outputs import HeadReads
from pipeline.io import atomic_write_json, space_checked
from pipeline.metrics import METRICS_NAME
from pipeline.models.model_folder import write_model_folder
from pipeline.models.student import build_student, student_tokenizer_spec
from pipeline.tokenizer import load_tokenizer
from pipeline.versions import software_versions
from stage2_train.attention import use_attention
from stage2_train.checkpoint import (
    check_resumable,
    complete_checkpoints,
    load_checkpoint,
    resume_from,
    save_checkpoint,
)
from stage2_train.checkpoint_trust import trusted_checkpoint
from stage2_train.config import TrainConfig
from stage2_train.data.documents import choose_alignment
from stage2_train.data.loader import batches, make_loader
from stage2_train.data.more_teachers import run_cache_fingerprint, teacher_settings
from stage2_train.data.plan import DataPlan, has_target_spans
from stage2_train.data.position import DataState
from stage2_train.data.shards import verify_local_shards
from stage2_train.distributed import Runtime
from stage2_train.forward import extras_of, student_forward
from stage2_train.kernels import ResolvedKernels
from stage2_train.output import check_output_is_a_run, hold_output
from stage2_train.parallel import autocast, full_state_dict, gradient_sync, unwrapped, wrap
from stage2_train.preflight import (
    check_distillation_cache,
    check_output_and_cache,
    check_scratch,
    check_student_fits,
    remove_stale_logs,
)
from stage2_train.run_log import JsonLines, diverged, no_target, step_record
from stage2_train.schedule import lr_at, make_optimizer
from stage2_train.stop_request import StopRequest

METRIC_KEYS = ("loss", "loss_all", "kept_fraction", "mapped_fraction")


def selection_generator(config: TrainConfig, step: int, micro: int, rank: int) -> torch.Generator:
    """Seeded per (seed, step, micro-batch, rank): random selection replays exactly on resume."""
    seed = np.random.SeedSequence([config.seed, step, micro, rank]).generate_state(1)[0]
    return torch.Generator().manual_seed(int(seed))


def save_final(
    config: TrainConfig, model: nn.Module, tokenizer, provenance: dict, runtime: Runtime
) -> Path:
    """The student as a model folder, OUT/final (write_model_folder)."""
    state = full_state_dict(model)  # collective under FSDP: every rank takes part
    final = config.out / "final"
    if runtime.is_main:
        with space_checked(config.out, "final/", "the checkpoints and metrics.jsonl are kept"):
            write_model_folder(final, unwrapped(model), tokenizer, provenance, state)
    runtime.barrier()
    return final


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
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

    torch.manual_seed(config.seed)
    settings = config.guidance_settings()
    compute = autocast(runtime, config.dtype)
    manifest = load_manifest(config.cache)
    more = {location: load_manifest(location) for location in config.more_caches}
    # None unless the mode trains one; one term per teacher's cache, summed
    distillation = config.distillation(manifest.settings, *(m.settings for m in more.values()))
    tokenizer = load_tokenizer(student_tokenizer_spec(config.student, config.student_tokenizer))
    check_output_and_cache(config, manifest, more)
    check_output_is_a_run(config)
    check_distillation_cache(config, distillation, {config.cache: manifest, **more}, tokenizer)
    accumulation = config.accumulation_steps(runtime.world_size)
    align = functools.partial(choose_alignment, settings, tokenizer.fingerprint)
    plan = DataPlan(
        cache_dir=config.cache,
        shards=tuple(manifest.shards),
        student_tokenizer=tokenizer.spec,
        alignment=align(manifest.tokenizer),
        num_chunks=config.num_chunks,
        aggregate=config.aggregate,
        packing=config.packing,
        packing_context=config.packing_context,
        seq_len=config.seq_len,
        micro_batch_size=config.micro_batch_size,
        seed=config.seed,
        consumers=config.data_consumers,
        world_size=runtime.world_size,
        num_workers=config.num_workers,
        distillation=distillation,
        target_spans=config.completion_only and has_target_spans(manifest),
        **teacher_settings(config, manifest, more, align),
        shard_cache=config.shard_cache,
        shard_cache_bytes=int(config.shard_cache_gib * (1 << 30)),
        read_ahead=config.read_ahead,
    )
    check_scratch(plan.workers)
    meta = {
        "world_size": runtime.world_size,
        "workers_per_rank": plan.workers,
        "cache_fingerprint": run_cache_fingerprint(manifest, plan.more_caches),
        "config_fingerprint": config.fingerprint,
        "torch_threads": torch.get_num_threads(),
    }
    student = build_student(config.student, tokenizer, config.seed, config.seq_len)
    kernels = ResolvedKernels.on(config, student, runtime.device)
    meta |= kernels.saved()
    use_attention(student, kernels.attention)
    check_student_fits(config, student.config, runtime.device)
    model = wrap(student, runtime, config.fsdp, kernels.compile, kernels.fsdp_param_dtype)
    optimizer = make_optimizer(model, config, kernels.adamw_kernel)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda index: lr_at(index + 1, config) / config.lr
    )
    # Every refusal comes before the lock, which creates OUT: a refused run leaves nothing behind.
    start_step, data_state = 0, DataState.fresh(plan, runtime.rank)
    newest = resume_from(config)
    checkpoint = trusted_checkpoint(config, newest, runtime)
    if checkpoint is not None:
        start_step = check_resumable(checkpoint, config, meta)
    verify_local_shards(plan)
    output.enter_context(hold_output(config, runtime, newest))
    if checkpoint is not None:
        data_state = load_checkpoint(checkpoint, model, optimizer, scheduler, plan, runtime)
    elif runtime.is_main:
        remove_stale_logs(config.out)
    stop_step = config.stop_at_step or config.max_steps

    metrics = documents = writer = None
    if runtime.is_main:
        atomic_write_json(config.out / "config.json", {**to_dict(config), **meta})
        metrics = JsonLines(config.out / METRICS_NAME, start_step)
        writer = SummaryWriter(str(config.out / "tensorboard"), purge_step=start_step + 1)
        parameters = sum(p.numel() for p in unwrapped(model).parameters())
        step_rate = StepRate(flop_parameters(unwrapped(model)), runtime.device)
        print(
            f"stage 2: {parameters / 1e6:.2f}M-parameter student, {runtime.world_size} rank(s) x "
            f"{accumulation} micro-batch(es) of {config.micro_batch_size} x {config.seq_len} "
            f"tokens per step, guidance {config.guidance}; "
            + (f"resuming at step {start_step}" if start_step else "starting at step 0"),
            file=sys.stderr,
        )
    subset = vocabulary_subset_on(distillation, runtime.device)  # e.g. ALM's student space mask
    if config.record_documents:
        documents = JsonLines(config.out / "documents" / f"rank-{runtime.rank}.jsonl", start_step)
    pin = runtime.device.type == "cuda"  # page-locked batches for asynchronous copies
    first = start_step * accumulation  # the rank's micro-batches taken so far
    stream = batches(make_loader(plan, runtime.rank, data_state, first, pin, accumulation))
    progress = tqdm(total=stop_step, initial=start_step, disable=not runtime.is_main, unit="step",
                    dynamic_ncols=True, file=sys.stderr)  # fmt: skip
    started, step_tokens, stop_votes = time.monotonic(), 0, 0.0

    for step in range(start_step + 1, stop_step + 1):
        # batch: this rank's micro-batches, and how many tokens the whole step keeps
        micro_batches = [next(stream) for _ in range(accumulation)]
        for batch in micro_batches:
            data_state.observe(batch)
        # (counted on the host copies; the total stays on the device, like every count below)
        step_valid = torch.stack([batch["labels"] for batch in micro_batches]) != IGNORE_INDEX
        step_teacher_loss = torch.stack([batch["teacher_loss"] for batch in micro_batches])
        counts = torch.stack(
            [
                mapped_tokens(step_teacher_loss, step_valid).sum(dim=(1, 2)),
                step_valid.sum(dim=(1, 2)),
            ],
            dim=1,
        )  # [micro-batch, (mapped, valid)]
        if distillation is not None:  # the distillation term's units, counted like the tokens
            units = [
                distillation.units(b["labels"], extras_of(b, distillation)) for b in micro_batches
            ]
            counts = torch.cat((counts, torch.stack(units).view(-1, 1)), dim=1)
        counts = runtime.all_gather(counts.to(runtime.device, non_blocking=True))
        denominator = loss_denominator(counts[..., :2], settings)
        # the float64 quotients rounded once to the loss's float32
        scale = (runtime.world_size / denominator.clamp(min=1).double()).float()
        distill_scale = (runtime.world_size / counts[..., 2:].sum().clamp(min=1).double()).float()

        # forward-backward
        # kept loss, all loss, kept, mapped, valid, stop votes, distillation term and units:
        # summed on the device, read once
        totals = torch.zeros(8, dtype=torch.float64, device=runtime.device)
        for micro, batch in enumerate(micro_batches):
            labels = batch["labels"].to(runtime.device, non_blocking=True)
            teacher = batch["teacher_loss"].to(runtime.device, non_blocking=True)
            extras = reads = None
            if distillation is not None:
                extras = extras_of(batch, distillation, runtime.device)
                reads = distillation.reads(extras, subset)
            with gradient_sync(model, micro == accumulation - 1):
                student = student_forward(
                    model, batch, labels, reads or HeadReads(), compute, kernels.loss_kernel,
                    runtime.device,
                )
                result = guided_loss(
                    student.loss,
                    teacher,
                    labels != IGNORE_INDEX,
                    settings,
                    generator=selection_generator(config, step, micro, runtime.rank),
                    chunk_start=batch.get("chunk_start"),
                )
                objective = result.kept_loss_sum * scale
                if distillation is not None:
                    term = distillation.loss_sum(student, labels, extras)
                    objective = objective + distillation.weight * term * distill_scale
                    totals[6] += term.detach().double()
                    totals[7] += units[micro]
                objective.backward()
            totals[:5] += torch.stack(
                [
                    result.kept_loss_sum.detach().double(),
                    result.loss_sum.double(),
                    result.kept.double(),
                    result.mapped.double(),
                    result.valid.double(),
                ]
            )

        # step
        lr = scheduler.get_last_lr()[0]
        grad_norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), config.grad_clip or float("inf")
        )
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        # log: the step's one host sync
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
            grad_norm = grad_norm.full_tensor()
        totals[5] = stop.vote  # every rank learns of a stop request at the same step
        logged = torch.cat((runtime.all_reduce_sum(totals), grad_norm.detach().double().view(1)))
        (kept_loss, all_loss, kept, mapped, valid_count, stop_votes, distill_sum, distill_units,
         grad_norm) = logged.tolist()  # fmt: skip
        if not all(map(math.isfinite, (kept_loss, all_loss, distill_sum, grad_norm))):
            kept_at = complete_checkpoints(config.out)
            raise TrainingDiverged(diverged(kept_at, step, kept_loss / max(kept, 1), grad_norm))
        step_tokens += int(valid_count)
        targets = valid_count > 0
        record = step_record(step, step * config.global_batch_tokens, lr, grad_norm,
                             (kept_loss, all_loss, kept, mapped, valid_count))  # fmt: skip
        if distillation is not None:  # the term's mean over its units (before its weight)
            record["distill_loss"] = distill_sum / distill_units if distill_units else None
        if documents is not None:
            documents.append({"step": step,
                              "documents": [d for b in micro_batches for d in b["documents"]]})
        if runtime.is_main:
            rates = step_rate.fields(int(valid_count), config.global_batch_tokens)
            metrics.append({**record, **rates})
            for key in (*METRIC_KEYS, "lr", "grad_norm"):
                if record[key] is not None:
                    writer.add_scalar(f"train/{key}", record[key], step)
            if not targets:
                progress.write(no_target(step), file=sys.stderr)
            rate = step_tokens / max(time.monotonic() - started, 1e-9)
            progress.set_postfix(
                loss=f"{record['loss']:.3f}" if targets else "-",
                kept=f"{record['kept_fraction']:.2f}" if targets else "-",
                tok_s=f"{rate:,.0f}",
                refresh=False,
            )
            progress.update()

        # save
        at_end = step == stop_step and config.save_at_end
        if stop_votes or step % config.save_every == 0 or at_end:
            saved = save_checkpoint(
                config, step, model, optimizer, scheduler, data_state, meta, runtime
            )
        if stop_votes:
            break

    progress.close()
    for log in (metrics, documents, writer):
        if log is not None:
            log.close()
    if stop_votes:
        raise StoppedBySignal(
            f"stopped by request after step {step}, saved in {saved}; run the same command "
            "to resume from it",
            stop.exit_signal,
        )
    if stop_step < config.max_steps or not config.save_at_end:
        return None
    provenance = {
        "config": to_dict(config),
        **meta,
        "steps": config.max_steps,
        "teacher": manifest.teacher,
        "cache_producer_fingerprint": manifest.producer_fingerprint,
        "software": software_versions(),
    }
    return save_final(config, model, tokenizer, provenance, runtime)
