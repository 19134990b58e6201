"""Prove a cache is whole and consistent before anything trusts it.

`verify_shard` is the cheap check every reader runs before reading a shard (size and sha256
against the manifest). `verify_cache` is the full audit behind `vocagno cache verify`: every
listed shard present, none unlisted, no leftover temporary files, and inside each shard the
schema, row and token counts, equal list lengths, text hashes and offsets within the text, and the
values of the optional columns (top-k, space log-probability) the manifest's settings declare.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline.cache.manifest import (
    MANIFEST_NAME,
    TEMPORARY_GLOB,
    CacheManifest,
    ShardRecord,
    load_manifest,
)
from pipeline.cache.rows import check_extra_columns, check_rows
from pipeline.cache.schema import COLUMNS, cache_schema, iter_shard_batches
from pipeline.cache.settings import CacheSettings
from pipeline.errors import CacheError
from pipeline.storage.store import Store, as_location, child, open_parquet

SHARD_GLOB = "*.parquet"


def verify_shard(cache_dir: str | Path, record: ShardRecord) -> str | Path:
    """The shard's location (a path, or a URI in object storage) once it exists with the
    manifest's size and sha256; CacheError otherwise."""
    store = Store(cache_dir)
    path = child(cache_dir, record.file)
    check_shard_bytes(path, store.size(record.file), lambda: store.sha256(record.file), record)
    return path


def check_shard_bytes(
    where: str | Path, size: int | None, digest: str | Callable[[], str], record: ShardRecord
) -> None:
    """CacheError naming the shard at `where` unless it exists (`size` is not None) with the
    manifest's size and sha256 (`digest`, or a function computing it once the size matched)."""
    if size is None:
        raise CacheError(f"shard {where} is listed in the manifest but missing")
    if size != record.bytes:
        raise CacheError(
            f"shard {where} has {size} bytes but the manifest says {record.bytes}: truncated or replaced"
        )
    digest = digest if isinstance(digest, str) else digest()
    if digest != record.sha256:
        raise CacheError(
            f"shard {where} has sha256 {digest[:16]}… but the manifest says {record.sha256[:16]}…: "
            "corrupted or replaced"
        )


def _check_schema(path: str | Path, settings: CacheSettings) -> list[str]:
    """The shard's column names once every column the settings declare is there with its type."""
    try:
        actual = open_parquet(path).schema_arrow
    except Exception as exc:
        raise CacheError(f"shard {path} is not a readable Parquet file: {exc}") from exc
    try:
        schema = cache_schema(settings.loss_dtype, settings)
    except (KeyError, TypeError, ValueError) as exc:
        raise CacheError(f"the manifest's settings declare no valid schema ({exc!r})") from None
    for expected in schema:
        if expected.name not in actual.names:
            raise CacheError(f"shard {path} lacks column {expected.name!r}")
        found = actual.field(expected.name).type
        if not _same_type(found, expected.type):
            raise CacheError(
                f"shard {path}: column {expected.name!r} is {found}, the schema says {expected.type}"
            )
    return schema.names


def _same_type(found: pa.DataType, expected: pa.DataType) -> bool:
    """Equal types; for lists only the value type counts (writers name the item field
    'item' or 'element'), nested lists included."""
    if pa.types.is_list(found) and pa.types.is_list(expected):
        return _same_type(found.value_type, expected.value_type)
    if pa.types.is_fixed_size_list(found) and pa.types.is_fixed_size_list(expected):
        return found.list_size == expected.list_size and _same_type(
            found.value_type, expected.value_type
        )
    return found.equals(expected)


def check_shard_contents(cache_dir: str | Path, record: ShardRecord, settings: CacheSettings) -> None:
    """Schema, row count, token count and per-row consistency of one shard; `settings` (the
    manifest's) say which optional columns it must hold, whose values are checked too."""
    path = child(cache_dir, record.file)
    names = _check_schema(path, settings)
    extra = [name for name in names if name not in COLUMNS]
    rows = tokens = 0
    for batch in iter_shard_batches(path, [*COLUMNS, *extra], batch_size=1024):
        numbers = rows + np.arange(batch.num_rows)
        lengths = check_rows(path, batch, numbers).lengths
        if extra:
            check_extra_columns(path, batch, numbers, lengths, settings.sample_head_size)
        tokens += int(lengths.sum())
        rows += batch.num_rows
    if rows != record.rows:
        raise CacheError(f"shard {path} has {rows} rows but the manifest says {record.rows}")
    if tokens != record.teacher_tokens:
        raise CacheError(
            f"shard {path} has {tokens} teacher tokens but the manifest says {record.teacher_tokens}"
        )


def _layout_problems(store: Store, manifest: CacheManifest) -> list[str]:
    problems = []
    listed = [s.file for s in manifest.shards]
    if len(set(listed)) != len(listed):
        problems.append(f"{store.display(MANIFEST_NAME)} lists a shard file more than once")
    indexes = [s.index for s in manifest.shards]
    if indexes != list(range(len(indexes))):
        problems.append(
            f"{store.display(MANIFEST_NAME)} shard indexes are not 0..{len(indexes) - 1}"
        )
    known = set(listed)
    for name in store.names(SHARD_GLOB):
        if name not in known:
            problems.append(f"shard {store.display(name)} is not listed in the manifest")
    for name in store.names(TEMPORARY_GLOB):
        problems.append(f"{store.display(name)} is a temporary file left by an unfinished write")
    return problems


def verify_cache(
    cache_dir: str | Path, on_shard: Callable[[ShardRecord, str | None], None] | None = None
) -> tuple[CacheManifest, list[str]]:
    """(manifest, problems): every problem found, each naming its file. Empty list = sound.
    `cache_dir` is a local folder or a URI (pipeline.storage)."""
    cache_dir = as_location(cache_dir)
    manifest = load_manifest(cache_dir)
    problems = _layout_problems(Store(cache_dir), manifest)
    for record in manifest.shards:
        problem = None
        try:
            verify_shard(cache_dir, record)
            check_shard_contents(cache_dir, record, manifest.settings)
        except CacheError as exc:
            problem = str(exc)
            problems.append(problem)
        if on_shard is not None:
            on_shard(record, problem)
    return manifest, problems
