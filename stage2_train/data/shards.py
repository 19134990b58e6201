"""The shards a reader opens, each checked against its cache's manifest before a row is used:
a local shard hashed once per process and file version, a shard in object storage copied and
checked as it is fetched (pipeline.cache.shard_cache)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from pipeline.cache.manifest import ShardRecord
from pipeline.cache.shard_cache import ShardCache
from pipeline.cache.verify import verify_shard
from stage2_train.data.plan import DataPlan


@functools.cache
def _verify_once(cache_dir: str, record: ShardRecord, mtime_ns: int | None) -> Path:
    return verify_shard(cache_dir, record)


@functools.cache
def _shard_cache(pid: int, location: str, folder: str, max_bytes: int, ahead: int) -> ShardCache:
    """One per process (`pid`: a forked data-loader worker must not inherit its parent's threads)."""
    return ShardCache(location, folder, max_bytes, ahead)


def verified_shard(
    plan: DataPlan,
    record: ShardRecord,
    upcoming: list[ShardRecord] | None = None,
    location: Path | str | None = None,
) -> Path:
    """A local file of the shard of the cache at `location` (the plan's cache unless given: one
    of its --more-caches), checked against the manifest (size and sha256): for a local cache,
    pipeline.cache.verify.verify_shard, hashed once per process and file version rather than
    once per read; for a cache in object storage, a verified local copy
    (pipeline.cache.shard_cache), with the `upcoming` shards fetched ahead. A rank's bytes are
    shared by its data-loader workers and its caches."""
    location = plan.cache_dir if location is None else location
    if isinstance(location, str):
        cache = _shard_cache(
            os.getpid(),
            location,
            plan.shard_cache,
            plan.shard_cache_bytes // (plan.consumers_per_rank * (1 + len(plan.more_caches))),
            plan.read_ahead,
        )
        return cache.get(record, upcoming or [])
    path = Path(location) / record.file
    mtime_ns = path.stat().st_mtime_ns if path.exists() else None
    return _verify_once(str(location), record, mtime_ns)


def verify_local_shards(plan: DataPlan) -> None:
    """Hash every shard of a local cache now, before the run writes anything: a damaged shard is
    refused before the first step, not when the stream reaches it. The stream visits every shard
    each epoch, and the verdicts are remembered (`verified_shard`, inherited by forked data-loader
    workers), so a run of an epoch or more hashes nothing twice. A cache in object storage is
    verified as each shard is fetched instead."""
    caches = [(plan.cache_dir, plan.shards)]
    caches += [(cache.location, cache.shards) for cache in plan.more_caches]
    for location, shards in caches:
        if isinstance(location, str):
            continue
        for record in shards:
            verified_shard(plan, record, location=location)
