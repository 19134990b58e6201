"""The Ray side of stage 1: size and start the actor pool (each actor loads the teacher once),
spread over the cluster's nodes, and keep at most two units in flight per actor while the driver
streams the corpus, so memory stays bounded whatever the corpus size.

A lost actor (its process killed, its node gone) fails its units in flight at once: Ray neither
restarts it nor retries its tasks, since a retry waits for the actor to come back, which is never
when its node is gone. The pool gives those units to the other actors and starts a replacement,
used once it has loaded the teacher, wherever the cluster has room. A shard is a function of its
unit alone, so which actor scores a unit, or how often, never changes a byte.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from pipeline.errors import ConfigError, VocagnoError
from pipeline.log import counted, get_logger
from pipeline.scoring.resolve import Asked, resolve
from stage1_score.cluster import connect_ray, describe_cluster
from stage1_score.config import ScoreConfig
from stage1_score.options import WorkersOptions
from stage1_score.output import Sidecar
from stage1_score.progress import Progress
from stage1_score.units import WorkUnit
from stage1_score.worker import UnitResult, UnitScorer, WorkerSpec

UNITS_IN_FLIGHT_PER_WORKER = 2
CLOSE_SECONDS = 60  # for the workers to shut their teachers down at the end of a run
MAX_UNIT_ATTEMPTS = 3  # a unit on which this many workers died is taken to be what kills them
REPLACEMENTS_PER_WORKER = 2  # actors started in place of lost ones, per actor of the pool
# With every actor lost, how long a replacement may take to find room (an autoscaler adding a
# node takes minutes) before the run stops.
REPLACEMENT_SECONDS = 900

log = get_logger("stage1")


class ScoringError(VocagnoError):
    """A worker failed in a way that is not the input's fault (it died, ran out of memory...)."""


def size_pool(config: WorkersOptions) -> tuple[int, int, int]:
    """(workers, CPUs per worker, GPUs per worker) from the options and the cluster's resources."""
    import ray

    resources = ray.cluster_resources()
    return pool_shape(config, int(resources.get("CPU", 0)), int(resources.get("GPU", 0)))


def pool_shape(config: WorkersOptions, total_cpus: int, total_gpus: int) -> tuple[int, int, int]:
    """(workers, CPUs per worker, GPUs per worker) on a cluster of these resources."""
    if total_gpus:
        workers, cpus, gpus = config.num_workers or total_gpus, config.cpus_per_worker or 1, 1
    else:
        # Without GPUs (either backend), one-thread workers are the default: they score faster
        # than fewer workers of more threads (docs/stage1.md: bench_stage1_workers.py).
        split = total_cpus // config.num_workers if config.num_workers else 1
        cpus = config.cpus_per_worker or max(1, split)
        workers, gpus = config.num_workers or max(1, total_cpus // cpus), 0
    if workers * cpus > total_cpus or workers * gpus > total_gpus:
        raise ConfigError(
            f"{workers} workers x ({cpus} CPUs, {gpus} GPUs) do not fit this Ray cluster "
            f"({total_cpus} CPUs, {total_gpus} GPUs); lower --num-workers or --cpus-per-worker"
        )
    return workers, cpus, gpus


def _unwrap(error: Exception) -> Exception:
    """Our own errors raised in an actor come back as themselves, and any other as one line
    naming it: never Ray's remote traceback."""
    import ray

    cause = getattr(error, "cause", None)
    if isinstance(error, ray.exceptions.RayTaskError):
        if isinstance(cause, VocagnoError):
            return cause
        return ScoringError(
            f"a scoring worker failed ({type(cause).__name__}: {_first_line(cause)}); finished "
            "units are kept"
        )
    if isinstance(error, ray.exceptions.RayActorError):  # while loading its teacher
        return ScoringError(
            f"a scoring worker died while starting ({error.__class__.__name__}); finished units "
            "are kept: run the same command again to resume"
        )
    return error


@dataclass
class _Actor:
    handle: object
    index: int  # the worker number in logs, progress and the run record
    node: str = "?"
    ready: bool = False  # loaded its teacher
    alive: bool = True
    load: int = 0  # units in flight


class WorkerPool:
    """Ray actors, started when the first unit needs scoring: a finished cache needs none."""

    def __init__(
        self,
        config: ScoreConfig,
        spec: Callable[..., WorkerSpec],
        backend_version: str,
        dtype: str,
    ):
        """`spec(resolved=, threads=)`: the workers' WorkerSpec once the pool is sized;
        `dtype`: the teacher's, as the cache's identity holds it."""
        self.config = config
        self.spec = spec
        self.backend_version = backend_version
        self.dtype = dtype
        self.actors: list[_Actor] = []
        self.started_ray = False
        self.info: dict = {"workers": 0}
        self.starting: dict = {}  # object ref of an actor's start() -> _Actor
        self.pending: dict = {}  # object ref of a unit's score -> (_Actor, WorkUnit)
        self.retry: deque[WorkUnit] = deque()
        self.losses: Counter[int] = Counter()  # unit index -> workers lost while scoring it
        self.placements: dict[int, dict] = {}  # unit index -> where it was scored
        self.lost_workers = 0
        self.replacements_left = 0

    def start(self) -> None:
        import ray

        self.started_ray = connect_ray(self.config.workers.ray_address)
        log.info(describe_cluster())
        workers, cpus, gpus = size_pool(self.config.workers)
        # every choice of the device each worker gets (a GPU each, or CPUs), the dtype the identity's
        asked = replace(Asked.of(self.config), dtype=self.dtype)
        resolved = resolve(asked, torch.device("cuda" if gpus else "cpu"))
        overlap = resolved.unit_overlap
        log.info(
            f"starting {workers} worker(s) with {cpus} CPU(s) and {gpus} GPU(s) each, unit "
            f"overlap {overlap}"
        )
        # SPREAD: nodes share the actors (and the writes), so a lost node takes as few as possible.
        # With overlap, an actor runs its units in flight in threads of its own (UnitScorer keeps
        # one on the teacher at a time).
        self._actor_class = ray.remote(UnitScorer).options(
            max_concurrency=UNITS_IN_FLIGHT_PER_WORKER if overlap == "on" else 1,
            num_cpus=cpus,
            num_gpus=gpus,
            max_restarts=0,
            max_task_retries=0,
            scheduling_strategy="SPREAD",
        )
        self._worker_spec = self.spec(resolved=resolved, threads=cpus)
        for _ in range(workers):
            self._launch()
        self.replacements_left = REPLACEMENTS_PER_WORKER * workers
        try:  # loads the teacher in every actor: a bad teacher fails here, before any unit
            started = ray.get(list(self.starting))
        except Exception as exc:
            raise _unwrap(exc) from None
        for actor, description in zip(self.starting.values(), started, strict=True):
            actor.node, actor.ready = description["node"], True
        self.starting.clear()
        found = {d["backend"]["backend_version"] for d in started}
        if found != {self.backend_version}:
            raise ConfigError(
                f"workers run backend version(s) {sorted(found)}, the driver "
                f"{self.backend_version}: use one environment on every node"
            )
        log.info("workers on nodes: " + ", ".join(f"w{a.index} {a.node}" for a in self.actors))
        self.info = {"workers": workers, "cpus_per_worker": cpus, "gpus_per_worker": gpus}
        self.info["unit_overlap"] = overlap
        self.info["backend"] = started[0]["backend"]

    def _launch(self) -> None:
        actor = _Actor(None, len(self.actors))
        actor.handle = self._actor_class.remote(self._worker_spec, actor.index)
        self.actors.append(actor)
        self.starting[actor.handle.start.remote()] = actor

    def close_teachers(self) -> None:
        """After a run, each actor shuts its teacher (vLLM's engine processes) down before Ray
        ends it; a replacement still waiting for room is given up. After an error Ray ends them
        as they are, as after a kill: units still in flight are not waited for, and the engines
        die with their actors."""
        if self.actors:
            import ray

            for actor in self.starting.values():
                ray.kill(actor.handle)
            working = [a for a in self.actors if a.alive and a.ready]
            closing = [actor.handle.close.remote() for actor in working]
            ray.wait(closing, num_returns=len(closing), timeout=CLOSE_SECONDS)

    def close(self) -> None:
        if self.started_ray:
            import ray

            ray.shutdown()

    def record(self) -> dict:
        """How the run went, for the run record: the pool, and which node scored which unit."""
        units = {str(i): self.placements[i] for i in sorted(self.placements)}
        return self.info | {"lost_workers": self.lost_workers, "units": units}

    def score(
        self,
        units: Iterator[WorkUnit],
        finished: Callable[[WorkUnit], Sidecar | None],
        progress: Progress,
    ) -> dict[int, Sidecar]:
        """Every unit's sidecar: resumed where finished, scored by the actors otherwise."""
        shards: dict[int, Sidecar] = {}
        for unit in units:
            progress.planned(unit)
            sidecar = finished(unit)
            if sidecar is not None:
                shards[unit.index] = sidecar
                progress.resumed(unit)
                continue
            if not self.actors:
                self.start()
            self._dispatch(unit, shards, progress)
        while self.pending or self.retry:
            if self.retry:
                self._dispatch(self.retry.popleft(), shards, progress)
            else:
                self._collect_one(shards, progress)
        return shards

    def _dispatch(self, unit: WorkUnit, shards: dict, progress: Progress) -> None:
        """Give `unit` to the least loaded working actor, collecting results until one has room."""
        while True:
            working = [a for a in self.actors if a.alive and a.ready]
            actor = min(working, key=lambda a: a.load, default=None)
            if actor is not None and actor.load < UNITS_IN_FLIGHT_PER_WORKER:
                break
            self._collect_one(shards, progress)
        self.pending[actor.handle.score_unit.remote(unit)] = (actor, unit)
        actor.load += 1

    def _collect_one(self, shards: dict, progress: Progress) -> None:
        """Wait for the next finished unit, or the next replacement actor ready to work."""
        import ray

        if not self.pending and not self.starting:
            raise ScoringError(
                "every scoring worker was lost and none can be started; finished units are kept: "
                "run the same command again to resume"
            )
        timeout = None if self.pending else REPLACEMENT_SECONDS
        ready, _ = ray.wait([*self.pending, *self.starting], num_returns=1, timeout=timeout)
        if not ready:
            raise ScoringError(
                f"every scoring worker was lost and no replacement found room in "
                f"{REPLACEMENT_SECONDS} s; finished units are kept: run the same command again "
                "to resume"
            )
        if ready[0] in self.starting:
            self._replacement_started(self.starting.pop(ready[0]), ready[0])
            return
        actor, unit = self.pending.pop(ready[0])
        actor.load -= 1
        try:
            result: UnitResult = ray.get(ready[0])
        except ray.exceptions.RayActorError as exc:
            self._score_again(unit, actor, exc)
            return
        except Exception as exc:
            raise _unwrap(exc) from None
        shards[unit.index] = result.sidecar
        self.placements[unit.index] = {
            "worker": actor.index,
            "node": actor.node,
            "attempts": self.losses[unit.index] + 1,
            "phases": result.phases,
            "device": result.device,
        }
        log.info(
            f"unit {unit.index}: {counted(result.shard.rows, 'document')} scored by worker "
            f"{actor.index} on node {actor.node} in {result.seconds:.1f} s"
        )
        progress.scored(result)

    def _replacement_started(self, actor: _Actor, ref) -> None:
        import ray

        try:
            actor.node = ray.get(ref)["node"]
        except ray.exceptions.RayActorError as exc:
            self._lose(actor, exc)
            return
        except Exception as exc:
            raise _unwrap(exc) from None
        actor.ready = True
        log.info(f"worker {actor.index} on node {actor.node} replaces a lost worker")

    def _score_again(self, unit: WorkUnit, actor: _Actor, exc: Exception) -> None:
        self.losses[unit.index] += 1
        self._lose(actor, exc)
        if self.losses[unit.index] >= MAX_UNIT_ATTEMPTS:
            raise ScoringError(
                f"a scoring worker died while scoring unit {unit.index} "
                f"({exc.__class__.__name__}; {self.losses[unit.index]} workers lost on it); "
                "finished units are kept: run the same command again to resume"
            )
        log.warning(f"unit {unit.index}: scoring it again on another worker")
        self.retry.append(unit)

    def _lose(self, actor: _Actor, exc: Exception) -> None:
        """Drop a dead or unreachable actor, and start a replacement while any are left."""
        if not actor.alive:
            return
        import ray

        actor.alive = False
        self.lost_workers += 1
        # One that is only unreachable must not go on writing beside its replacement.
        ray.kill(actor.handle)
        replacing = "starting a replacement" if self.replacements_left else "no replacement left"
        log.warning(
            f"worker {actor.index} on node {actor.node} is lost ({exc.__class__.__name__}: "
            f"{_first_line(exc)}); {replacing}"
        )
        if self.replacements_left:
            self.replacements_left -= 1
            self._launch()


def _first_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else "no detail"
