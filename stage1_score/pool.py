"""The Ray side of stage 1: join or start the cluster, size and start the actor pool (each actor
loads the teacher once), and keep at most two units in flight per actor while the driver streams
the corpus, so memory stays bounded whatever the corpus size."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator

from pipeline.cache.manifest import ShardRecord
from pipeline.errors import ConfigError, VocagnoError
from pipeline.log import get_logger
from stage1_score.config import ScoreConfig
from stage1_score.progress import Progress
from stage1_score.units import WorkUnit
from stage1_score.worker import UnitResult, UnitScorer, WorkerSpec

UNITS_IN_FLIGHT_PER_WORKER = 2
CLOSE_SECONDS = 60  # for the workers to shut their teachers down at the end of a run

log = get_logger("stage1")


class ScoringError(VocagnoError):
    """A worker failed in a way that is not the input's fault (it died, ran out of memory...)."""


def connect_ray(address: str | None) -> bool:
    """Join (or start) Ray unless this process already did; True if we must shut it down."""
    import ray

    if ray.is_initialized():
        return False
    handler = signal.getsignal(signal.SIGTERM)
    ray.init(address=address, logging_level="WARNING")
    # ray.init puts its own SIGTERM handler in place, which skips our unwinding (lock, cleanup,
    # one line): the entry point's handler is put back.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)
    return True


def describe_cluster() -> str:
    """Which Ray cluster this job runs on: with --ray-address unset, Ray joins whatever local
    cluster is running, which a user must be able to see."""
    import ray

    nodes = [node for node in ray.nodes() if node.get("Alive")]
    resources = ray.cluster_resources()
    return (
        f"Ray cluster at {ray.get_runtime_context().gcs_address}: {len(nodes)} node(s), "
        f"{int(resources.get('CPU', 0))} CPU(s), {int(resources.get('GPU', 0))} GPU(s)"
    )


def size_pool(config: ScoreConfig) -> tuple[int, int, int]:
    """(workers, CPUs per worker, GPUs per worker) from the options and the cluster's resources."""
    import ray

    resources = ray.cluster_resources()
    total_cpus, total_gpus = int(resources.get("CPU", 0)), int(resources.get("GPU", 0))
    if total_gpus:
        workers, cpus, gpus = config.num_workers or total_gpus, config.cpus_per_worker or 1, 1
    else:
        # Without GPUs (either backend), one-thread workers are the default: on 2 shared cores
        # they scored 1.7x faster than one two-thread worker (benchmarks/bench_stage1_workers.py).
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
        log.info(describe_cluster())
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

    def close_teachers(self) -> None:
        """After a run, each actor shuts its teacher (vLLM's engine processes) down before Ray
        ends it. After an error Ray ends them as they are, as after a kill: units still in
        flight are not waited for, and the engines die with their actors."""
        if self.actors:
            import ray

            closing = [actor.close.remote() for actor in self.actors]
            ray.wait(closing, num_returns=len(closing), timeout=CLOSE_SECONDS)

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
