"""A scoring worker: loads the tokenizer and the teacher once, then turns whole work units into
shards. Ray runs it as an actor (pool.py); it is a plain class, so it also runs in-process.

Per unit: tokenize with offsets, score, build the table, write the shard atomically, then the
sidecar. A worker killed at any point leaves either nothing new or a finished unit behind.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.cache.manifest import ShardRecord, profile_name
from pipeline.cache.schema import SCHEMA_VERSION, shard_name, write_shard
from pipeline.cache.settings import CacheSettings
from pipeline.cache.writer import build_unit_table
from pipeline.io import space_checked
from pipeline.log import configure, get_logger
from pipeline.profiling import traced
from pipeline.scoring.head import HeadExtras
from pipeline.scoring.resolve import Asked, Resolved, check_worker, resolve
from pipeline.scoring.teacher import TeacherSource, load_teacher_tokenizer
from pipeline.space_mask import space_mask
from pipeline.storage import Store
from pipeline.storage.store import child
from pipeline.versions import software_versions
from stage1_score.config import ScoreConfig
from stage1_score.output import Sidecar, write_sidecar
from stage1_score.units import WorkUnit


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs (picklable): stage 1's config as given, what the driver resolved, and
    the run's own facts."""

    config: ScoreConfig
    resolved: Resolved  # the driver's, for the device a worker gets (the identity's dtype)
    teacher: TeacherSource  # as the driver resolved it, inside the shipped working directory
    settings: CacheSettings  # the cache's: its windows and which optional columns it holds
    out: Path | str  # the cache, resolved; a URI in object storage (pipeline.storage)
    run_fingerprint: str
    threads: int  # the CPUs the pool gives each worker


@dataclass(frozen=True)
class UnitResult:
    sidecar: Sidecar  # the unit's shard record and the software that scored it
    seconds: float
    worker: int
    # [start, end] in the worker node's monotonic seconds of "tokenize" (and its batches planned),
    # "score" (the unit's batches queued, holding the teacher), "collect" (its last batch read
    # back) and "write"
    phases: dict[str, list[float]] = field(default_factory=dict)
    # where the unit's time on the device went (pipeline.scoring.device: DeviceTime.record);
    # None where the backend returns only once done (vLLM's engine)
    device: dict | None = None
    # ids of the unit's documents with no scored teacher token: fewer than two tokens, as token 0
    # has no prediction (one word under a teacher with no BOS, or only characters its vocabulary
    # lacks); stage 2 leaves their student tokens unmapped
    unscored: list[str] = field(default_factory=list)

    @property
    def shard(self) -> ShardRecord:
        return self.sidecar.shard


@contextlib.contextmanager
def phase(phases: dict[str, list[float]], name: str):
    """Record the block's [start, end] as `phases[name]`."""
    start = time.monotonic()
    yield
    phases[name] = [round(start, 3), round(time.monotonic(), 3)]


def head_extras(spec: WorkerSpec, tokenizer) -> HeadExtras:
    """The optional columns the settings ask for; the space mask is rebuilt here from the
    tokenizer and must be the one the driver recorded in the cache's identity."""
    settings = spec.settings
    mask = None
    if settings.space_logprob:
        recorded = settings.space_logprob
        mask, identity = space_mask(tokenizer, recorded["size"])
        if identity != recorded:
            raise ValueError("the worker's space mask differs from the one the driver recorded")
    return HeadExtras(
        settings.topk_probs, settings.topk_ids, mask, settings.sampled, settings.sample_seed
    )


def load_scorer(spec: WorkerSpec, extras: HeadExtras):
    """The backend the config names, loaded; vLLM is imported only when chosen. A worker whose
    device would load the teacher in another dtype than the cache's identity holds is refused
    before it loads anything."""
    config = spec.config
    windows = {"max_length": spec.settings.max_length, "stride": spec.settings.stride}
    if config.teacher.backend == "vllm":
        from stage1_score.backends.vllm_backend import VLLMScorer

        dtype, threads = spec.resolved.dtype, spec.threads
        return VLLMScorer(spec.teacher, config.vllm, dtype, threads, extras=extras, **windows).load()
    from pipeline.scoring.hf import HFScorer

    asked, batch_tokens = Asked.of(config), config.batching.batch_tokens
    scorer = HFScorer(spec.teacher, asked=asked, batch_tokens=batch_tokens, extras=extras, **windows)
    check_worker(spec.resolved, resolve(scorer.asked, scorer.device))
    return scorer.load()


class UnitScorer:
    """Loads the teacher on first use: start() under Ray, the first unit in-process."""

    def __init__(self, spec: WorkerSpec, worker: int = 0):
        configure()  # as a Ray actor this is its process's entry point
        self.spec = spec
        self.worker = worker
        self._tokenizer = None
        self._scorer = None
        # One unit on the teacher at a time; with --unit-overlap on (a threaded actor holding two
        # units) the other unit's tokenizing and writing run beside it.
        self._device = threading.Lock()
        # One unit tokenized at a time: the tokenizer spreads one call over every core, so the
        # first two units, which arrive together, would share them and the teacher would wait for
        # both; in turn, the first unit reaches it after its own tokenizing alone.
        self._tokenizing = threading.Lock()

    def _load(self) -> None:
        if self._scorer is not None:
            return
        import torch

        torch.set_num_threads(self.spec.threads)
        self._tokenizer = load_teacher_tokenizer(self.spec.teacher, self.spec.config.teacher.tokenizer)
        self._extras = head_extras(self.spec, self._tokenizer)
        self._scorer = load_scorer(self.spec, self._extras)
        # once the teacher is loaded, so that each package it imported names its build
        self._software = software_versions()
        self._switches = {} if self._scorer.switches is None else self._scorer.switches.saved()

    def describe(self) -> dict:
        self._load()
        return self._scorer.describe() | {"threads": self.spec.threads}

    def start(self) -> dict:
        """As a Ray actor: load the teacher, and say which backend and which node this is."""
        from stage1_score.cluster import this_node

        return {"backend": self.describe(), "node": this_node()}

    def close(self) -> None:
        """Release the teacher; only the vLLM engine holds processes that need shutting down."""
        close = getattr(self._scorer, "close", None)
        if close is not None:
            close()

    def score_unit(self, unit: WorkUnit) -> UnitResult:
        self._load()
        started, phases = time.monotonic(), {}
        with self._tokenizing, phase(phases, "tokenize"):
            encodings = self._tokenizer.encode_batch(unit.texts)
            ids = [e.ids for e in encodings]
            # before the teacher is held: the previous unit's last batch, maybe a short one, may
            # be all that the device has queued
            plan = self._scorer.plan(ids)
        lengths = [len(e) for e in encodings]
        scorable = sum(max(n - 1, 0) for n in lengths)  # token 0 has no prediction
        output = self.spec.config.output
        report = _ProgressLog(self.worker, unit.index, scorable, output.progress_seconds)
        with traced(unit.index == output.profile_unit) as trace:
            with self._device, phase(phases, "score"):
                queued = self._scorer.queue_columns(ids, progress=report, plan=plan)
            # The teacher is released: the next unit queues its batches behind this one's last.
            with phase(phases, "collect"):
                columns = queued.collect()
        losses = columns.pop("loss")
        device = None if queued.device_time is None else queued.device_time.record()
        if trace.data is not None:
            Store(self.spec.out).write_bytes(profile_name(unit.index), trace.data)
        with phase(phases, "write"):
            sidecar = write_unit(
                self.spec, unit, encodings, losses, columns, self._software, self._switches
            )
        unscored = [doc for doc, n in zip(unit.doc_ids, lengths, strict=True) if n < 2]
        seconds = time.monotonic() - started
        return UnitResult(sidecar, seconds, self.worker, phases, device, unscored)


def write_unit(
    spec: WorkerSpec, unit: WorkUnit, encodings, losses, columns, software: dict, switches: dict
) -> Sidecar:
    """The unit's shard (atomically), then its sidecar, which names the `software` and the
    resolved `switches` that scored it: the worker's host work after scoring."""
    table = build_unit_table(
        unit.doc_ids,
        unit.texts,
        unit.text_sha256,
        encodings,
        losses,
        spec.settings.loss_dtype,
        columns,
        spec.settings,
        unit.target_spans,
    )
    name = shard_name(unit.index)
    footer = {
        "unit": unit.index,
        "run_fingerprint": spec.run_fingerprint,
        "content_sha256": unit.content_sha256,
        "schema_version": SCHEMA_VERSION,
    }
    total = sum(len(e) for e in encodings)
    # A full local disk is one line naming it (Ray would relay a remote traceback); an object
    # store's own errors name their bucket.
    writing = (
        space_checked(spec.out, f"unit {unit.index}'s shard", "the finished units are kept")
        if isinstance(spec.out, Path)
        else contextlib.nullcontext()
    )
    with writing:
        size, digest = write_shard(child(spec.out, name), table, footer)
        record = ShardRecord(unit.index, name, len(unit), total, size, digest)
        sidecar = Sidecar(record, spec.run_fingerprint, unit.content_sha256, software, switches)
        write_sidecar(spec.out, sidecar)
    return sidecar


class _ProgressLog:
    """Progress inside a long unit, logged (Ray forwards actor stderr to the driver)."""

    def __init__(self, worker: int, unit: int, total: int, every: float):
        self.worker, self.unit, self.total, self.every = worker, unit, total, every
        self.done = 0
        self.started = self.last = time.monotonic()

    def __call__(self, tokens: int) -> None:
        self.done += tokens
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            rate = self.done / max(now - self.started, 1e-9)
            get_logger(f"worker {self.worker}").info(
                f"unit {self.unit}: {self.done}/{self.total} tokens ({rate:,.0f} tok/s)"
            )
