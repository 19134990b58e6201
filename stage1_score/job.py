"""The stage-1 driver: check the inputs, take the output lock, resume or refuse what is there,
stream the corpus into work units for a pool of Ray actors, and write the manifest last.

The driver alone reads the corpus; it keeps at most two units in flight per actor, so memory stays
bounded whatever the corpus size. Which actor scores a unit never changes the shard's bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata

from pipeline.cache.manifest import CacheManifest, ShardRecord, SkippedDocument, write_manifest
from pipeline.config import to_dict
from pipeline.corpus import Corpus
from pipeline.errors import ConfigError, CorpusError, VocagnoError
from pipeline.io import atomic_write_json, sha256_text
from pipeline.log import get_logger
from pipeline.scoring.teacher import (
    TeacherSource,
    check_tokenizer_fits,
    check_weights_readable,
    describe_config,
    load_teacher_config,
    load_teacher_tokenizer,
    resolve_teacher,
    teacher_context_length,
    teacher_identity,
)
from pipeline.versions import software_versions
from stage1_score.config import ScoreConfig, result_settings
from stage1_score.output import RUN_RECORD_NAME, OutputLock, finished_shard, prepare_output
from stage1_score.progress import Progress
from stage1_score.units import WorkUnit, plan_units
from stage1_score.worker import UnitResult, UnitScorer, WorkerSpec

UNITS_IN_FLIGHT_PER_WORKER = 2
BACKEND_PACKAGES = {"hf": "transformers", "vllm": "vllm"}

log = get_logger("stage1")


class ScoringError(VocagnoError):
    """A worker failed in a way that is not the input's fault (it died, ran out of memory...)."""


@dataclass(frozen=True)
class Plan:
    """Everything resolved before the output folder or Ray is touched."""

    config: ScoreConfig
    corpus: Corpus
    teacher: TeacherSource
    max_length: int
    stride: int
    identity: dict


def backend_version(backend: str) -> str:
    package = BACKEND_PACKAGES[backend]
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        raise ConfigError(
            f"the {backend} backend needs the {package} package (pip install 'vocagno[{backend}]')"
        ) from None


def plan(config: ScoreConfig) -> Plan:
    """Resolve and check corpus, teacher, tokenizer and windows; CorpusError/TeacherError/... if bad."""
    corpus = Corpus(config.corpus, config.corpus_options())
    teacher = resolve_teacher(config.teacher, config.teacher_revision)
    teacher_config = load_teacher_config(teacher)
    check_weights_readable(teacher)
    tokenizer = load_teacher_tokenizer(teacher, config.tokenizer)
    check_tokenizer_fits(tokenizer, teacher_config)
    context = teacher_context_length(teacher_config)
    try:
        max_length, stride = config.windows(context)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if context is not None and max_length > context:
        raise ConfigError(
            f"--max-length {max_length} exceeds the teacher's context of {context} tokens"
        )
    identity = {
        "teacher": teacher_identity(teacher)
        | {
            "dtype": config.dtype,
            "backend": config.backend,
            "backend_version": backend_version(config.backend),
            "architecture": describe_config(teacher_config),
        },
        "tokenizer": {
            "fingerprint": tokenizer.fingerprint,
            "vocab_size": tokenizer.vocab_size,
            "add_bos": tokenizer.policy.add_bos,
            "bos_token": tokenizer.policy.bos_token,
            "source": "teacher" if config.tokenizer is None else "--tokenizer",
        },
        "settings": result_settings(config, max_length, stride),
        "corpus": corpus.describe(),
    }
    return Plan(config, corpus, teacher, max_length, stride, identity)


def connect_ray(address: str | None) -> bool:
    """Join (or start) Ray unless this process already did; True if we must shut it down."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(address=address, logging_level="WARNING")
    return True


def describe_cluster(started: bool) -> str:
    """Which Ray cluster this job runs on: with --ray-address unset, Ray joins whatever local
    cluster is running, which a user must be able to see."""
    import ray

    nodes = [node for node in ray.nodes() if node.get("Alive")]
    resources = ray.cluster_resources()
    how = "started a local Ray cluster" if started else "joined the Ray cluster"
    return (
        f"{how} at {ray.get_runtime_context().gcs_address}: {len(nodes)} node(s), "
        f"{int(resources.get('CPU', 0))} CPU(s), {int(resources.get('GPU', 0))} GPU(s)"
    )


def size_pool(config: ScoreConfig) -> tuple[int, int, int]:
    """(workers, CPUs per worker, GPUs per worker) from the options and the cluster's resources."""
    import ray

    resources = ray.cluster_resources()
    total_cpus, total_gpus = int(resources.get("CPU", 0)), int(resources.get("GPU", 0))
    if config.backend == "vllm" and total_gpus == 0:
        raise ConfigError("the vllm backend needs GPUs, and this Ray cluster has none")
    if total_gpus:
        workers, cpus, gpus = config.num_workers or total_gpus, config.cpus_per_worker or 1, 1
    else:
        # Without GPUs, one-thread workers are the default: on 2 shared cores they scored 1.7x
        # faster than one two-thread worker (benchmarks/bench_stage1_workers.py).
        split = total_cpus // config.num_workers if config.num_workers else 1
        cpus = config.cpus_per_worker or max(1, split)
        workers, gpus = config.num_workers or max(1, total_cpus // cpus), 0
    if workers * cpus > total_cpus or workers * gpus > total_gpus:
        raise ConfigError(
            f"{workers} workers x ({cpus} CPUs, {gpus} GPUs) do not fit this Ray cluster "
            f"({total_cpus} CPUs, {total_gpus} GPUs); lower --num-workers or --cpus-per-worker"
        )
    return workers, cpus, gpus


def _unwrap(error: Exception, unit: int | None) -> Exception:
    """Our own errors raised in an actor come back as themselves, for a one-line message."""
    import ray

    cause = getattr(error, "cause", None)
    if isinstance(error, ray.exceptions.RayTaskError) and isinstance(cause, VocagnoError):
        return cause
    if isinstance(error, ray.exceptions.RayActorError):
        where = f" while scoring unit {unit}" if unit is not None else ""
        return ScoringError(
            f"a scoring worker died{where} ({error.__class__.__name__}); finished units are kept: "
            "run the same command again to resume"
        )
    return error


class WorkerPool:
    """Ray actors, started when the first unit needs scoring: a finished cache needs none."""

    def __init__(
        self, config: ScoreConfig, spec: Callable[[int], WorkerSpec], backend_version: str
    ):
        self.config = config
        self.spec = spec
        self.backend_version = backend_version
        self.actors: list = []
        self.started_ray = False
        self.info: dict = {"workers": 0}

    def start(self) -> None:
        import ray

        self.started_ray = connect_ray(self.config.ray_address)
        log.info(describe_cluster(self.started_ray))
        workers, cpus, gpus = size_pool(self.config)
        log.info(f"starting {workers} worker(s) with {cpus} CPU(s) and {gpus} GPU(s) each")
        actor = ray.remote(UnitScorer).options(
            num_cpus=cpus, num_gpus=gpus, max_restarts=2, max_task_retries=2
        )
        spec = self.spec(cpus)
        self.actors = [actor.remote(spec, index) for index in range(workers)]
        try:  # loads the teacher in every actor: a bad teacher fails here, before any unit
            described = ray.get([a.describe.remote() for a in self.actors])
        except Exception as exc:
            raise _unwrap(exc, None) from None
        found = {d["backend_version"] for d in described}
        if found != {self.backend_version}:
            raise ConfigError(
                f"workers run backend version(s) {sorted(found)}, the driver "
                f"{self.backend_version}: use one environment on every node"
            )
        self.info = {"workers": workers, "cpus_per_worker": cpus, "gpus_per_worker": gpus}
        self.info["backend"] = described[0]

    def close(self) -> None:
        if self.started_ray:
            import ray

            ray.shutdown()

    def score(
        self,
        units: Iterator[WorkUnit],
        finished: Callable[[WorkUnit], ShardRecord | None],
        progress: Progress,
    ) -> dict[int, ShardRecord]:
        """Every unit's shard record: resumed where finished, scored by the actors otherwise."""
        import ray

        shards: dict[int, ShardRecord] = {}
        pending: dict = {}  # object ref -> (actor index, unit index)
        load: list[int] = []

        def collect_one() -> None:
            ready, _ = ray.wait(list(pending), num_returns=1)
            worker, index = pending.pop(ready[0])
            load[worker] -= 1
            try:
                result: UnitResult = ray.get(ready[0])
            except Exception as exc:
                raise _unwrap(exc, index) from None
            shards[index] = result.shard
            progress.scored(result)

        for unit in units:
            progress.planned(unit)
            record = finished(unit)
            if record is not None:
                shards[unit.index] = record
                progress.resumed(unit)
                continue
            if not self.actors:
                self.start()
                load = [0] * len(self.actors)
            while min(load) >= UNITS_IN_FLIGHT_PER_WORKER:
                collect_one()
            worker = load.index(min(load))
            pending[self.actors[worker].score_unit.remote(unit)] = (worker, unit.index)
            load[worker] += 1
        while pending:
            collect_one()
        return shards


def run(config: ScoreConfig) -> CacheManifest:
    """Score the corpus into `config.out`; returns the manifest written there."""
    job = plan(config)
    log.info(
        f"teacher {config.teacher} ({config.backend}, {config.dtype}), windows of "
        f"{job.max_length} tokens every {job.stride}; corpus {config.corpus} "
        f"({len(job.corpus.sources)} source(s), {job.corpus.total_bytes:,} bytes)"
    )
    with OutputLock(config.out):
        run_fingerprint = prepare_output(config.out, job.identity, config.overwrite, log.info)

        def spec(threads: int) -> WorkerSpec:
            return WorkerSpec(
                teacher=job.teacher,
                tokenizer=config.tokenizer,
                backend=config.backend,
                dtype=config.dtype,
                max_length=job.max_length,
                stride=job.stride,
                batch_tokens=config.batch_tokens,
                loss_dtype=config.loss_dtype,
                out=config.out.resolve(),
                run_fingerprint=run_fingerprint,
                threads=threads,
                progress_seconds=config.progress_seconds,
                vllm_max_num_batched_tokens=config.vllm_max_num_batched_tokens,
                vllm_gpu_memory_utilization=config.vllm_gpu_memory_utilization,
            )

        pool = WorkerPool(config, spec, job.identity["teacher"]["backend_version"])
        try:
            manifest = _score_corpus(job, pool, run_fingerprint)
        finally:
            pool.close()
        # How this run went (paths as given, workers, threads): beside the cache, not in its
        # identity, so the manifest stays a function of what was scored.
        atomic_write_json(config.out / RUN_RECORD_NAME, {"config": to_dict(config)} | pool.info)
        write_manifest(config.out, manifest)
    log.info(
        f"wrote {config.out}: {len(manifest.shards)} shards, {manifest.total_rows:,} documents, "
        f"{manifest.total_teacher_tokens:,} teacher tokens, {len(manifest.skipped)} skipped"
    )
    return manifest


def _score_corpus(job: Plan, pool: WorkerPool, run_fingerprint: str) -> CacheManifest:
    config = job.config
    unit_hashes: list[str] = []
    skipped: list[SkippedDocument] = []
    progress = Progress(job.corpus.fraction_read, config.progress_seconds)

    def units() -> Iterator[WorkUnit]:
        for unit in plan_units(job.corpus, config.docs_per_shard, job.corpus.fraction_read):
            if not len(unit):
                first = unit.skipped[0]
                raise CorpusError(
                    f"no documents to score in {config.corpus}: all {len(unit.skipped)} records "
                    f"were skipped (first: {first.source} record {first.record}: {first.reason})"
                )
            unit_hashes.append(unit.content_sha256)
            skipped.extend(unit.skipped)
            yield unit

    def finished(unit: WorkUnit) -> ShardRecord | None:
        return finished_shard(
            config.out, unit.index, unit.content_sha256, run_fingerprint, log.info
        )

    shards = pool.score(units(), finished, progress)
    if not shards:
        raise CorpusError(f"corpus {config.corpus} holds no documents")
    progress.report(final=True)
    documents = sum(s.rows for s in shards.values())
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
        settings=job.identity["settings"],
        corpus=corpus,
        shards=[shards[i] for i in range(len(shards))],
        skipped=skipped,
        software=software_versions(),
    )
