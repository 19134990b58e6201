"""Stage 2's `--dry-run`: the options as resolved (pipeline.config_preview), each `auto` switch as
it resolves on this machine's device, and the run's plan (world size, steps and tokens,
accumulation per world size, epochs of the cache, one rank's memory against the device's), then
exit: OUT is not created, no weight is loaded, no process group started.

What it cannot see here it may be told, each answer labeled as assumed: the world size
(`--assume-world-size`, else torchrun's WORLD_SIZE), the device (`--assume-device h100`: its
memory, and `auto` resolving as on a CUDA GPU with bfloat16) and, where the student's config is
out of reach (a hub id offline), a student of the same shape (`--assume-student`). What it cannot
read and was not told is said to be unknown, not guessed.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from pipeline.cache.manifest import load_manifest
from pipeline.config import value_of
from pipeline.config_preview import Command, options_listing
from pipeline.errors import CacheError, ConfigError, TokenizerError
from pipeline.models.student import student_config, student_kind
from pipeline.tokenizer import load_tokenizer
from stage2_train.config import SECTION, TrainConfig
from stage2_train.data.epochs import cache_passes
from stage2_train.data.plan import DataPlan
from stage2_train.distributed import launch_environment
from stage2_train.memory import StudentShape, gib
from stage2_train.preflight import available_memory, step_memory, ways_to_fit
from stage2_train.resolve import SAVED, Resolved, resolve, resolve_dtype

# Devices a plan may assume: the name and memory nvidia-smi lists for each (MiB).
DEVICES = {
    "h100": ("NVIDIA H100 80GB HBM3", 81559),
    "h200": ("NVIDIA H200", 143771),
    "a100-80gb": ("NVIDIA A100-SXM4-80GB", 81920),
    "a100-40gb": ("NVIDIA A100-SXM4-40GB", 40960),
}
UNREADABLE = (OSError, CacheError, ConfigError, TokenizerError)


def add_assumptions(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--assume-world-size", type=int, metavar="N", help="--dry-run: plan for "
        "N ranks (default: torchrun's WORLD_SIZE, else 1)")  # fmt: skip
    group.add_argument("--assume-device", choices=DEVICES, help="--dry-run: plan for this GPU: "
        "its memory, and auto switches as on a CUDA GPU computing in bfloat16 (default: this "
        "machine's device)")  # fmt: skip
    group.add_argument("--assume-student", metavar="SPEC", help="--dry-run: size the plan with "
        "this student (a preset, config.json or folder) where the student's config cannot be "
        "read here, e.g. a hub id offline")  # fmt: skip
    group.add_argument("--assume-student-tokenizer", metavar="SPEC", help="--dry-run: this "
        "tokenizer in place of the student's (a preset's vocabulary, the cache's epochs)")  # fmt: skip


@dataclass(frozen=True)
class Machine:
    device: torch.device
    memory: int  # bytes a rank may use
    said: str


def dry_run(command: Command) -> Iterator[str]:
    """The dry run's report, a block at a time (a refusal the run would make raises after the
    blocks before it)."""
    config, flags = command.config, command.flags
    yield "# stage 2 --dry-run: nothing is written, no weights loaded, no process group started"
    yield "# each option's value and where it came from (default, manifest or flag)"
    yield options_listing(command, SECTION)
    machine = _machine(flags.assume_device)
    world, said = _world_size(flags.assume_world_size)
    yield f"\n# the plan\ndevice: {machine.said}\nworld size: {world} ({said})"
    tokenizer, student = _student(config, flags)
    if isinstance(student, str):  # why the student is unknown here
        dtype = _on(machine, resolve_dtype, config.model.dtype)
        yield f"student: unknown: {student}"
        yield f"auto switches: dtype {config.model.dtype} -> {dtype}; the others depend on the student"
    else:
        resolved = _on(machine, resolve, config, student)
        yield _student_line(config, flags, student)
        yield "auto switches: " + ", ".join(
            f"{name} auto -> {value}" if value_of(config, name) == "auto" else f"{name} {value}"
            for name, value in ((name, getattr(resolved, name)) for name in SAVED)
        )
    yield from _schedule(config, world)
    yield f"epochs of the cache: {_epochs(config, tokenizer)}"
    if isinstance(student, str):
        yield "memory per rank: unknown: the student is unknown"
    else:
        yield _memory(config, StudentShape.of(student), world, resolved, machine)


def _on(machine: Machine, decide: Callable, first, *rest):
    """One of stage2_train.resolve's decisions, its device the machine's; a refusal names it."""
    try:
        return decide(first, machine.device, *rest)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (on {machine.device}; --assume-device plans for a GPU)") from None


def _machine(assumed: str | None) -> Machine:
    if assumed is not None:
        name, mib = DEVICES[assumed]
        said = (f"assumed (--assume-device {assumed}): {name}, {mib:,} MiB (all of it; a run "
                "compares its free memory, less by the CUDA context), a CUDA GPU computing in "
                "bfloat16")  # fmt: skip
        return Machine(torch.device("cuda"), mib * 2**20, said)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        name = torch.cuda.get_device_name(device)
        return Machine(device, available_memory(device), f"this machine's {device} ({name})")
    return Machine(torch.device("cpu"), available_memory(torch.device("cpu")),
                   "this machine's CPU (no GPU here; --assume-device plans for one)")  # fmt: skip


def _world_size(assumed: int | None) -> tuple[int, str]:
    if assumed is not None:
        if assumed < 1:
            raise ConfigError(f"--assume-world-size must be at least 1, not {assumed}")
        return assumed, "assumed: --assume-world-size"
    world, _, _ = launch_environment(os.environ)
    return world, "torchrun's WORLD_SIZE" if "WORLD_SIZE" in os.environ else "one process"


def _student(config: TrainConfig, flags: argparse.Namespace):
    """(the student's tokenizer or None, the student on the meta device or why it is unknown)."""
    spec = flags.assume_student or config.model.student
    tokenizer, unread = None, ""
    try:
        tokenizer = load_tokenizer(flags.assume_student_tokenizer or config.model.tokenizer_spec())
    except UNREADABLE as exc:
        unread = f"the student's tokenizer is not readable here ({exc}); --assume-student-tokenizer"
    if tokenizer is None and student_kind(spec) == "preset":
        return None, unread  # a preset's vocabulary is its tokenizer's
    try:
        model_config = student_config(spec, tokenizer, config.data.seq_len)
    except UNREADABLE as exc:
        return tokenizer, f"{exc}; --assume-student gives one of the same shape"
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return tokenizer, AutoModelForCausalLM.from_config(model_config)


def _student_line(config: TrainConfig, flags: argparse.Namespace, student) -> str:
    assumed = [f"--{flag.replace('_', '-')} {value}" for flag, value in vars(flags).items()
               if flag.startswith("assume_student") and value]  # fmt: skip
    said = f"assumed ({', '.join(assumed)})" if assumed else config.model.student
    return f"student: {said}: {StudentShape.of(student).parameters:,} parameters"


def _schedule(config: TrainConfig, world: int) -> Iterator[str]:
    optimizer, data = config.optimizer, config.data
    steps, batch = optimizer.max_steps, optimizer.global_batch_tokens
    stop = config.checkpointing.stop_at_step
    yield (f"steps: {steps:,} (warmup {optimizer.warmup_steps:,}"
           + (f"; this run stops after step {stop:,})" if stop else ")")
           + f" of {batch:,} tokens: {steps * batch:,} tokens")  # fmt: skip
    micro = f"{optimizer.micro_batch_size} x {data.seq_len:,} tokens"
    yield (f"accumulation: {config.accumulation_steps(world)} micro-batches of {micro} per rank "
           f"and step on {world} rank(s)")  # fmt: skip
    others = []
    for ranks in (n for n in range(1, data.data_consumers + 1) if data.data_consumers % n == 0):
        try:
            others.append(f"{ranks}: {config.accumulation_steps(ranks)}")
        except ConfigError:
            others.append(f"{ranks}: refused (the global batch does not split)")
    yield ("accumulation on each world size a checkpoint resumes on (dividing --data-consumers "
           f"{data.data_consumers}): " + ", ".join(others))  # fmt: skip


def _epochs(config: TrainConfig, tokenizer) -> str:
    try:
        manifest = load_manifest(config.data.cache)
    except (CacheError, OSError) as exc:
        return f"unknown: cache not found here ({exc})"
    if tokenizer is None:
        return "unknown: the student's tokenizer is not readable here (--assume-student-tokenizer)"
    plan = DataPlan(cache_dir=config.data.cache, shards=tuple(manifest.shards),
                    student_tokenizer=tokenizer.spec, seq_len=config.data.seq_len,
                    micro_batch_size=config.optimizer.micro_batch_size)  # fmt: skip
    schedule = config.optimizer.max_steps * config.optimizer.global_batch_tokens
    return cache_passes(plan, manifest.total_teacher_tokens, schedule, tokenizer).note()


def _memory(config, shape, world, resolved: Resolved, machine: Machine) -> str:
    estimate, memory = step_memory(config, shape, world, resolved), machine.memory
    verdict = "fits" if estimate.total <= memory else (
        f"does not fit: the run would refuse; {ways_to_fit(config, estimate, memory)}"
    )  # fmt: skip
    return (f"memory per rank: about {gib(estimate.total)} ({estimate.parts()}; an estimate) "
            f"of {gib(machine.memory)}: {verdict}")  # fmt: skip
