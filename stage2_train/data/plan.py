"""Partition. The stream is cut into C consumers (--data-consumers), a number fixed for the run
and independent of the world size, so a checkpoint continues on any world size that divides C.
Consumer c is read by rank c % world size; a rank's data-loader workers share its consumers (see
loader). The run's micro-batch g (counted over the whole run, all ranks) is the next micro-batch of
consumer g % C, and global step s is micro-batches (s - 1) M .. s M - 1 (M per step): which
documents a step trains on depends on C and the global batch, never on the ranks or workers.

A work item is one part of one shard: part p of P holds the shard's rows r with r % P == p, and
P = ceil(C / #shards) so that even a cache with fewer shards than consumers feeds everyone. In
epoch e the items are permuted by (seed, e) and consumer c takes items c, c + C, c + 2C, ...:
disjoint parts whose union is every row, so each document is used exactly once per epoch.
Within one Parquet read (READ_ROWS rows) the item's rows are shuffled by (seed, e, shard, read).
Each consumer's stream is endless (epoch after epoch), so every rank runs exactly --max-steps.
Consumers get equally many items (+-1); a consumer that finishes its part of epoch e goes on to
its part of epoch e + 1, so with few items per consumer (fewer shards than ~10x the consumers)
some documents come round again before others have been seen once.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pipeline.alignment import DEFAULT_AGGREGATION
from pipeline.cache.manifest import CacheManifest, ShardRecord, load_manifest
from pipeline.distillation import Distillation
from pipeline.errors import CacheError, ConfigError
from pipeline.io import fingerprint
from pipeline.storage import as_location


@dataclass(frozen=True)
class TeacherCache:
    """Another teacher's cache of the plan's corpus: where it is, its shards (shard i holds the
    documents of the first cache's shard i), its content's fingerprint, and how its tokens align
    to the student's (token, or identity where the student has its tokenizer)."""

    location: Path | str
    shards: tuple[ShardRecord, ...]
    fingerprint: str
    alignment: str = "token"
    head_size: int | None = None  # its teacher's outputs, where it records them (a sampled cache)


@dataclass(frozen=True)
class DataPlan:
    """Everything that fixes the stream; identical on every rank and worker."""

    cache_dir: Path | str  # a str is a URI: the cache is in object storage (pipeline.storage)
    shards: tuple[ShardRecord, ...]
    student_tokenizer: str
    seq_len: int
    micro_batch_size: int
    alignment: str = "token"  # or "chunk", or "identity" (see documents.choose_alignment)
    num_chunks: int = 1
    aggregate: str = DEFAULT_AGGREGATION
    seed: int = 0
    packing: str = "documents"  # or "stream" (see document_packing and packing)
    packing_context: float = 0.5  # documents packing: a split document's context, in windows
    consumers: int = 1  # C, fixed for the run (--data-consumers)
    world_size: int = 1  # ranks and workers only deal the consumers out: they never change the
    num_workers: int = 0  # stream
    distillation: Distillation | None = None  # its extras ride with every token (documents.py)
    target_spans: bool = False  # the cache's shards say which characters are targets
    head_size: int | None = None  # the cache's teacher's outputs, where it records them
    # other teachers' caches of the corpus, read in step (more_teachers), and how their teacher
    # losses combine with the cache's per token (pipeline.teacher_loss.combine_teacher_losses)
    more_caches: tuple[TeacherCache, ...] = ()
    combine_teachers: str = "min"
    # combine_teachers source: each corpus source's teacher, 0 for the cache, i for more_caches[i-1]
    source_teachers: dict[str, int] = field(default_factory=dict)
    # A cache in object storage is read from local copies (pipeline.cache.shard_cache); these
    # say where, how many bytes a rank may hold, and how many shards are fetched ahead. They
    # never change what is read.
    shard_cache: str = ""
    shard_cache_bytes: int = 8 << 30
    read_ahead: int = 2

    @classmethod
    def from_cache(cls, cache_dir: Path, **settings) -> DataPlan:
        """A plan over every shard the cache's manifest lists."""
        manifest = load_manifest(cache_dir)
        return cls(
            cache_dir=as_location(cache_dir),
            shards=tuple(manifest.shards),
            target_spans=has_target_spans(manifest),
            head_size=manifest.settings.sample_head_size,
            **settings,
        )

    @property
    def distillation_columns(self) -> tuple[str, ...]:
        """The cache columns the distillation reads beside the loss path's (none without one)."""
        return self.distillation.cache_columns if self.distillation is not None else ()

    @property
    def consumers_per_rank(self) -> int:
        return self.consumers // self.world_size

    @property
    def workers(self) -> int:
        """Data-loader workers per rank: the most, up to --num-workers, that split the rank's
        consumers evenly (each worker plays every workers-th of them)."""
        if self.num_workers == 0:
            return 0
        return max(w for w in range(1, self.num_workers + 1) if self.consumers_per_rank % w == 0)

    def rank_consumers(self, rank: int) -> list[int]:
        """The consumers rank `rank` reads, in the order its micro-batches take them."""
        return list(range(rank, self.consumers, self.world_size))

    def __post_init__(self) -> None:
        if self.consumers < 1 or self.consumers % self.world_size:
            raise ConfigError(
                f"--data-consumers ({self.consumers}) must be a multiple of the number of ranks "
                f"({self.world_size}): each consumer's stream is read by one rank"
            )
        rows = sum(shard.rows for shard in self.shards)
        if rows < self.consumers:
            raise CacheError(
                f"the cache has {rows} documents, fewer than the {self.consumers} data consumers; "
                "use a smaller --data-consumers"
            )

    @functools.cached_property
    def parts_per_shard(self) -> int:
        """The fewest parts per shard that give every consumer at least one non-empty item."""
        parts = max(1, math.ceil(self.consumers / max(1, len(self.shards))))
        while sum(min(shard.rows, parts) for shard in self.shards) < self.consumers:
            parts += 1
        return parts


def has_target_spans(manifest: CacheManifest) -> bool:
    """Whether the cache's shards name each document's target spans (stage 1's --targets)."""
    return manifest.settings.target_spans


def cache_fingerprint(manifest: CacheManifest) -> str:
    """Identity of a cache's content: its producer and every shard's size and checksum."""
    return fingerprint(
        {"producer": manifest.producer_fingerprint, "shards": [asdict(s) for s in manifest.shards]}
    )


def work_items(plan: DataPlan, consumer: int, epoch: int) -> list[tuple[int, int]]:
    """(shard list index, part) items of one consumer in one epoch: a pure function of its inputs.

    Empty parts (of shards with fewer rows than parts) are no items, so each consumer has at least
    one document per epoch.
    """
    parts = plan.parts_per_shard
    items = [
        (shard, part)
        for shard, record in enumerate(plan.shards)
        for part in range(min(parts, record.rows))
    ]
    order = np.random.default_rng([plan.seed, epoch]).permutation(len(items))
    return [items[i] for i in order[consumer :: plan.consumers]]
