"""Building a stage 2 run: read the cache's manifests and the student's tokenizer, refuse what
cannot train (every refusal before OUT's lock, which creates OUT: a refused run leaves nothing
behind), plan the data, build and wrap the student, its optimizer and schedule, and continue from
the newest checkpoint where there is one. The loop (stage2_train.trainer) gets it all as one
`Run`."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from pipeline.cache.manifest import CacheManifest, load_manifest
from pipeline.distillation import Distillation, vocabulary_subset_on
from pipeline.guidance import GuidanceSettings
from pipeline.loggers import check_logger
from pipeline.models.student import build_student
from pipeline.tokenizer import load_tokenizer
from stage2_train.attention import use_attention
from stage2_train.checkpoint import check_resumable, load_checkpoint, resume_from
from stage2_train.checkpoint_trust import trusted_checkpoint
from stage2_train.config import TrainConfig
from stage2_train.data.documents import choose_alignment
from stage2_train.data.heldout import HeldOut, check_unseen, read_heldout
from stage2_train.data.loader import batches, make_loader
from stage2_train.data.more_teachers import run_cache_fingerprint, teacher_settings
from stage2_train.data.plan import DataPlan, has_target_spans
from stage2_train.data.position import DataState
from stage2_train.data.shards import verify_local_shards
from stage2_train.distributed import Runtime
from stage2_train.output import check_output_is_a_run, hold_output
from stage2_train.parallel import wrap
from stage2_train.preflight import (
    chat_template_note,
    check_batch_within_cache,
    check_distillation_cache,
    check_output_and_cache,
    check_scratch,
    check_student_fits,
    remove_stale_logs,
)
from stage2_train.resolve import Resolved, resolve
from stage2_train.schedule import lr_at, make_optimizer


@dataclass
class Run:
    """What the loop needs, built once. `meta`: what config.json and every checkpoint save
    beside the config (world size, workers, fingerprints, threads, the resolved switches);
    `start_step`: the checkpoint's step (0 when fresh); `stop_step`: the last step this run
    takes (--stop-at-step or --max-steps)."""

    config: TrainConfig
    runtime: Runtime
    settings: GuidanceSettings
    manifest: CacheManifest
    tokenizer: object
    distillation: Distillation | None  # None unless the mode trains one
    plan: DataPlan
    meta: dict
    resolved: Resolved  # every device-dependent decision (stage2_train.resolve)
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    data_state: DataState
    start_step: int
    stop_step: int
    accumulation: int  # micro-batches per rank and step
    subset: torch.Tensor | None  # a distillation's vocabulary subset (e.g. ALM's space mask)
    heldout: HeldOut | None  # --eval-every's documents

    def batches(self) -> Iterator[dict]:
        """This rank's micro-batches from where the run stands."""
        first = self.start_step * self.accumulation  # the rank's micro-batches taken so far
        pin = self.resolved.pin_memory
        loader = make_loader(
            self.plan, self.runtime.rank, self.data_state, first, pin, self.accumulation
        )
        return batches(loader)


def build_run(config: TrainConfig, runtime: Runtime, output: contextlib.ExitStack) -> Run:
    """The run, checked and (from a checkpoint) restored; `output` takes OUT's lock."""
    check_logger(config.logging.logger)
    settings = config.guidance.settings()
    manifest = load_manifest(config.data.cache)
    more = {location: load_manifest(location) for location in config.data.more_caches}
    # one term per teacher's cache, summed
    distillation = config.guidance.distillation(
        config.model, manifest.settings, *(m.settings for m in more.values())
    )
    tokenizer = load_tokenizer(config.model.tokenizer_spec())
    out, cache = config.checkpointing.out, config.data.cache
    check_output_and_cache(out, cache, manifest, more)
    check_batch_within_cache(config.optimizer, manifest)
    check_output_is_a_run(out, config.model.student)
    caches = {cache: manifest, **more}
    check_distillation_cache(config.guidance, config.model, distillation, caches, tokenizer)
    if runtime.is_main and (note := chat_template_note(manifest, tokenizer)):
        print(f"stage 2: {note}", file=sys.stderr)
    accumulation = config.accumulation_steps(runtime.world_size)
    heldout = held_out(config, runtime, tokenizer, manifest)
    plan = data_plan(config, runtime, settings, tokenizer, distillation, manifest, more)
    check_scratch(plan.workers)
    meta = {
        "world_size": runtime.world_size,
        "workers_per_rank": plan.workers,
        "cache_fingerprint": run_cache_fingerprint(manifest, plan.more_caches),
        "config_fingerprint": config.fingerprint,
        "torch_threads": torch.get_num_threads(),
    }
    seed, seq_len = config.optimizer.seed, config.data.seq_len
    student = build_student(config.model.student, tokenizer, seed, seq_len)
    resolved = resolve(config, runtime.device, student)
    meta |= resolved.saved()
    use_attention(student, resolved.attention)
    check_student_fits(config, student, runtime, resolved)
    model = wrap(
        student, runtime, config.model.fsdp, resolved.compile, resolved.fsdp_param_dtype,
        config.model.activation_checkpointing,
    )  # fmt: skip
    optimizer = make_optimizer(model, config.optimizer, resolved.adamw_kernel)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda index: lr_at(index + 1, config.optimizer) / config.optimizer.lr
    )
    start_step, data_state = resume(
        config, runtime, output, plan, meta, model, optimizer, scheduler
    )
    return Run(
        config=config, runtime=runtime, settings=settings, manifest=manifest,
        tokenizer=tokenizer, distillation=distillation, plan=plan, meta=meta, resolved=resolved,
        model=model, optimizer=optimizer,
        scheduler=scheduler, data_state=data_state, start_step=start_step,
        stop_step=config.checkpointing.stop_at_step or config.optimizer.max_steps,
        accumulation=accumulation,
        subset=vocabulary_subset_on(distillation, runtime.device), heldout=heldout,
    )  # fmt: skip


def held_out(
    config: TrainConfig, runtime: Runtime, tokenizer, manifest: CacheManifest
) -> HeldOut | None:
    """--eval-every's documents (stage2_train.data.heldout), refused if the cache holds any."""
    options = config.logging
    if not options.eval_every:
        return None
    heldout = read_heldout(options.eval_data, options.eval_docs, tokenizer, config.data.seq_len,
                           config.optimizer.micro_batch_size)  # fmt: skip
    check_unseen(heldout, config.data.cache, manifest.shards, runtime.rank, runtime.world_size,
                 runtime.all_gather_objects)  # fmt: skip
    return heldout


def data_plan(
    config: TrainConfig,
    runtime: Runtime,
    settings: GuidanceSettings,
    tokenizer,
    distillation: Distillation | None,
    manifest: CacheManifest,
    more: dict,
) -> DataPlan:
    """What every rank's data stream reads, aligns and packs."""
    align = functools.partial(choose_alignment, settings, tokenizer.fingerprint)
    return DataPlan(
        cache_dir=config.data.cache,
        shards=tuple(manifest.shards),
        student_tokenizer=tokenizer.spec,
        alignment=align(manifest.tokenizer),
        num_chunks=config.guidance.num_chunks,
        aggregate=config.guidance.aggregate,
        packing=config.data.packing,
        packing_context=config.data.packing_context,
        seq_len=config.data.seq_len,
        micro_batch_size=config.optimizer.micro_batch_size,
        seed=config.optimizer.seed,
        consumers=config.data.data_consumers,
        world_size=runtime.world_size,
        num_workers=config.data.num_workers,
        distillation=distillation,
        target_spans=config.data.completion_only and has_target_spans(manifest),
        **teacher_settings(config.data, config.guidance, manifest, more, align),
        shard_cache=config.data.shard_cache,
        shard_cache_bytes=int(config.data.shard_cache_gib * (1 << 30)),
        read_ahead=config.data.read_ahead,
    )


def resume(
    config: TrainConfig,
    runtime: Runtime,
    output: contextlib.ExitStack,
    plan: DataPlan,
    meta: dict,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> tuple[int, DataState]:
    """Take OUT's lock once the newest checkpoint (if any) is found resumable, then restore it;
    returns the step to start after and this rank's data position."""
    newest = resume_from(config.checkpointing)
    checkpoint = trusted_checkpoint(config.checkpointing, newest, runtime)
    start_step = 0 if checkpoint is None else check_resumable(checkpoint, config, meta)
    verify_local_shards(plan)
    output.enter_context(hold_output(config.checkpointing, runtime, newest))
    if checkpoint is not None:
        return start_step, load_checkpoint(checkpoint, model, optimizer, scheduler, plan, runtime)
    if runtime.is_main:
        remove_stale_logs(config.checkpointing.out)
    return start_step, DataState.fresh(plan, runtime.rank)
