"""Checks before any work starts: each refuses, in one line, a run that would otherwise fail late
(after the compute is spent), hang, be killed without a word, or quietly train on something other
than what was asked."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from pipeline.cache.manifest import CacheManifest
from pipeline.corpus.own_template import own_template
from pipeline.distillation import Distillation
from pipeline.distillation.columns import check_columns
from pipeline.errors import CacheError, ConfigError, TokenizerError
from pipeline.guidance_modes import MODES
from pipeline.loggers import TENSORBOARD_FOLDER
from pipeline.storage import Store
from pipeline.tokenizer import TextTokenizer
from stage2_train.config import TrainConfig
from stage2_train.distributed import Runtime
from stage2_train.memory import MemoryEstimate, StudentShape, estimate_memory, gib
from stage2_train.options import GuidanceOptions, ModelOptions, OptimizerOptions
from stage2_train.resolve import Resolved


def check_output_and_cache(
    out: Path, cache: str, manifest: CacheManifest, more: dict | None = None
) -> None:
    """--out apart from the cache (and the `more` caches: --more-caches' manifests by location),
    and every listed shard present with its recorded size (the hashes are checked as shards are
    read): a deleted shard fails now, not at step 15 of 40. A cache in object storage is listed
    once, not asked about shard by shard."""
    caches = [("--cache", cache, manifest)]
    caches += [("--more-caches", location, listed) for location, listed in (more or {}).items()]
    for flag, location, listed in caches:
        _check_cache_files(out, flag, location, listed)


def check_batch_within_cache(options: OptimizerOptions, manifest: CacheManifest) -> None:
    """A step's tokens within the whole cache."""
    if options.global_batch_tokens > manifest.total_teacher_tokens:
        raise ConfigError(
            f"--global-batch-tokens {options.global_batch_tokens} is more than the whole cache "
            f"({manifest.total_teacher_tokens} teacher tokens): one step would repeat documents "
            "within itself; lower it or score a larger corpus"
        )


def _check_cache_files(out: Path, flag: str, location, manifest: CacheManifest) -> None:
    store, given = Store(location), out
    out = Path(out).resolve()
    cache = store.local.resolve() if store.local is not None else None
    if cache is not None and (out == cache or cache in out.parents or out in cache.parents):
        raise ConfigError(
            f"--out {given} and {flag} {location} overlap: checkpoints and the model "
            "would be written into the cache (or the cache into the run); choose another --out"
        )
    problems = []
    sizes = store.sizes() if store.remote else None
    for shard in manifest.shards:
        size = sizes.get(shard.file) if sizes is not None else store.size(shard.file)
        if size is None:
            problems.append(f"{shard.file} is missing")
        elif size != shard.bytes:
            problems.append(f"{shard.file} has {size} bytes, not {shard.bytes}")
    if problems:
        raise CacheError(
            f"cache {location}: {len(problems)} of {len(manifest.shards)} shard(s) do not "
            f"match the manifest ({'; '.join(problems[:3])}{'; ...' if len(problems) > 3 else ''})"
            "; run `vocagno cache verify` and rerun stage 1 to restore them"
        )


def check_distillation_cache(
    guidance: GuidanceOptions,
    student: ModelOptions,
    distillation: Distillation | None,
    caches: dict[str | Path, CacheManifest],
    tokenizer: TextTokenizer,
) -> None:
    """Each cache (manifests by location: --cache, then --more-caches) holds every column the
    distillation reads (naming the stage-1 option that adds it), and under a same-vocabulary mode
    (KLD) was scored with the student's tokenizer."""
    if distillation is None:
        return
    for location, manifest in caches.items():
        check_columns(guidance, distillation, f"cache {location}", manifest.settings, student)
        if MODES[guidance.mode].same_tokenizer and (
            manifest.tokenizer.get("fingerprint") != tokenizer.fingerprint
        ):
            raise ConfigError(
                f"--guidance {guidance.mode} compares the teacher's and the student's "
                f"probabilities of the same token ids, but cache {location} was scored with "
                f"{_tokenizer_of(manifest.tokenizer)} and the student's is {tokenizer.spec!r} "
                f"({tokenizer.vocab_size:,} tokens, another fingerprint): use the cache's "
                "tokenizer for the student, or --guidance uld for a teacher with another vocabulary"
            )


def _tokenizer_of(record: dict) -> str:
    """A cache's tokenizer as its manifest records it (a fingerprint and a size, no name)."""
    size = f"{record['vocab_size']:,} tokens" if "vocab_size" in record else "its size unrecorded"
    own = "its teacher's own tokenizer" if record.get("source") == "teacher" else "a --tokenizer"
    return f"{own} ({size})"


def check_student_fits(
    config: TrainConfig, student: nn.Module, runtime: Runtime, resolved: Resolved
) -> None:
    """--seq-len within the student's positions, and a training step within one rank's memory:
    the model's state, its copies in the compute dtype and a micro-batch's activations
    (stage2_train.memory), checked before the student is placed."""
    positions = getattr(student.config.get_text_config(), "max_position_embeddings", None)
    if positions is not None and config.data.seq_len > positions:
        raise ConfigError(
            f"--seq-len {config.data.seq_len} is beyond the student's {positions} positions; "
            f"use --seq-len {positions} or less"
        )
    estimate = step_memory(config, StudentShape.of(student), runtime.world_size, resolved)
    available = available_memory(runtime.device)
    if estimate.total > available:
        raise ConfigError(
            f"a training step needs about {gib(estimate.total)} per rank ({estimate.parts()}, "
            f"for a micro-batch of {config.optimizer.micro_batch_size} x {config.data.seq_len} "
            f"tokens on {runtime.world_size} rank(s); an estimate) and {gib(available)} is free on "
            f"{runtime.device}: {ways_to_fit(config, estimate, available)}"
        )


def step_memory(
    config: TrainConfig, shape: StudentShape, world_size: int, resolved: Resolved
) -> MemoryEstimate:
    """One rank's estimate (stage2_train.memory) for this config, as resolved on its device."""
    return estimate_memory(
        shape,
        micro_batch_size=config.optimizer.micro_batch_size,
        seq_len=config.data.seq_len,
        world_size=world_size,
        fsdp=config.model.fsdp,
        compute_dtype=resolved.dtype,
        fsdp_param_dtype=resolved.fsdp_param_dtype,
        loss_kernel=resolved.loss_kernel,
        activation_checkpointing=config.model.activation_checkpointing,
    )


def ways_to_fit(config: TrainConfig, estimate: MemoryEstimate, available: int) -> str:
    """What makes a step that does not fit a rank's `available` memory smaller."""
    ways = []
    if estimate.total - estimate.activations < available:  # the activations overflow it
        if config.optimizer.micro_batch_size > 1:
            ways.append("lower --micro-batch-size (the step keeps its size by accumulation)")
        if not config.model.activation_checkpointing:
            ways.append("add --activation-checkpointing (layers recomputed in the backward)")
    ways.append(
        "run more ranks (--fsdp divides the model's state among them)"
        if config.model.fsdp
        else "shard the model's state with --fsdp (divided among torchrun's ranks)"
    )
    return ", or ".join(ways)


def available_memory(device: torch.device) -> int:
    """Free memory for this process: the GPU's, or on a CPU the machine's available memory
    (page cache counts as available) shared by the ranks torchrun started on this node."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines())
        available = int(fields["MemAvailable"].split()[0]) * 1024
    else:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def remove_stale_logs(out: Path) -> None:
    """A fresh start (no checkpoint to resume) must not show an earlier failed run's curves."""
    shutil.rmtree(Path(out) / TENSORBOARD_FOLDER, ignore_errors=True)


# Data-loader workers pass each batch's shared memory to the trainer through a Unix socket at
# TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX (multiprocessing), and a socket path holds 107 bytes.
SOCKET_PATH_BYTES, SOCKET_SUFFIX_BYTES = 107, len("/pymp-XXXXXXXX/listener-XXXXXXXX")


def check_scratch(workers: int) -> None:
    """A TMPDIR too long for those sockets: the workers' batches never arrive, and the run would
    hang at its first step (a deep node-local scratch folder on a cluster, say)."""
    scratch = tempfile.gettempdir()
    longest = SOCKET_PATH_BYTES - SOCKET_SUFFIX_BYTES
    if workers and len(os.fsencode(scratch)) > longest:
        raise ConfigError(
            f"TMPDIR {scratch} is longer than {longest} bytes: data-loader workers hand batches "
            "over through Unix sockets in it, whose paths cannot be that long; set TMPDIR to a "
            "shorter folder, or --num-workers 0"
        )


def chat_template_note(manifest: CacheManifest, tokenizer: TextTokenizer) -> str | None:
    """A cache of chat records rendered in a student's own template (stage 1's --chat-template
    student) for another student than this one: a line saying so, else None. Not a refusal:
    the student aligns by characters into the one text the teacher scored whatever its format,
    but it will learn the other student's turn markers (docs/instruction-data.md)."""
    template = manifest.corpus.get("targets", {}).get("template", {})
    if template.get("name") != "student":
        return None
    try:
        own = own_template("student", tokenizer).describe()["chat_template_sha256"]
    except TokenizerError:
        own = None
    if own == template["chat_template_sha256"]:
        return None
    which = "has no chat template" if own is None else "has another chat template"
    return (
        f"the cache's chat records are rendered in a student's own template (sha256 "
        f"{template['chat_template_sha256'][:12]}), and this student's tokenizer {which}: it "
        "trains on that template's turn markers"
    )
