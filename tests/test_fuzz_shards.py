"""The shard reader over randomly corrupted files (byte flips, truncations, insertions on a small
real shard): every reader verifies size and sha256 first (pipeline.cache.verify.verify_shard, as
stage 2's data path does), so any change is our own CacheError naming the shard; and the Parquet
decoder underneath, fed the damaged bytes directly, raises only CacheError or returns rows, and
never hangs (each read runs under a deadline).

The decoder alone cannot promise more: Parquet pages carry no checksum here, so a flipped bit in
a loss value decodes to another float. That is why the checksum comes first. The alignment fuzz
test is tests/test_alignment.py (slow property test over random Unicode).
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.cache.manifest import load_manifest
from pipeline.cache.schema import COLUMNS, iter_shard_batches
from pipeline.cache.verify import verify_shard
from pipeline.errors import CacheError
from tests.cache_fixtures import build_cache

READ_DEADLINE_SECONDS = 30.0
PRISTINE = "pristine.parquet"


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """(cache folder, its one shard's record); the pristine bytes are kept beside it."""
    cache = tmp_path_factory.mktemp("cache")
    build_cache(cache, num_documents=6, docs_per_shard=6)
    record = load_manifest(cache).shards[0]
    (cache.parent / PRISTINE).write_bytes((cache / record.file).read_bytes())
    return cache, record


@st.composite
def corruptions(draw, size: int) -> tuple[str, int, bytes]:
    """(kind, position, payload) describing a change that always alters the bytes."""
    kind = draw(st.sampled_from(["flip", "truncate", "insert"]))
    if kind == "flip":
        return kind, draw(st.integers(0, size - 1)), bytes([draw(st.integers(1, 255))])
    if kind == "truncate":
        return kind, draw(st.integers(0, size - 1)), b""
    return kind, draw(st.integers(0, size)), draw(st.binary(min_size=1, max_size=64))


def corrupt(data: bytes, change: tuple[str, int, bytes]) -> bytes:
    kind, at, payload = change
    if kind == "flip":
        return data[:at] + bytes([data[at] ^ payload[0]]) + data[at + 1 :]
    if kind == "truncate":
        return data[:at]
    return data[:at] + payload + data[at:]


def with_deadline(function):
    """Run `function` in a thread; a read that does not finish in time fails the test."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(function).result(timeout=READ_DEADLINE_SECONDS)
    except concurrent.futures.TimeoutError:
        pytest.fail(f"reading a corrupted shard did not finish in {READ_DEADLINE_SECONDS} s")
    finally:
        pool.shutdown(wait=False)


def decode(path: Path) -> int:
    """Rows the decoder yields. (Only decoding: pyarrow does not validate UTF-8 when it reads
    Parquet, so a flipped text byte can surface later as UnicodeDecodeError in to_pylist; the
    checksum-first readers never reach that point.)"""
    return sum(b.num_rows for b in iter_shard_batches(path, list(COLUMNS), 2))


def check_one(shard, change) -> None:
    cache, record = shard
    original = (cache.parent / PRISTINE).read_bytes()
    damaged = corrupt(original, change)
    assert damaged != original
    path = cache / record.file
    path.write_bytes(damaged)
    try:
        # The reader's path: checksum first, always refused, naming the shard.
        with pytest.raises(CacheError, match=record.file):
            with_deadline(lambda: verify_shard(cache, record))
        # The decoder under it: our own error or rows, never another exception, never a hang.
        try:
            with_deadline(lambda: decode(path))
        except CacheError as exc:
            assert record.file in str(exc)
    finally:
        path.write_bytes(original)


FUZZ = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@settings(max_examples=40, derandomize=True, **FUZZ)  # the same draw on every machine
@given(data=st.data())
def test_a_corrupted_shard_is_refused_by_name_and_never_hangs(shard, data):
    check_one(shard, data.draw(corruptions(shard[1].bytes)))


@pytest.mark.slow
@settings(max_examples=1500, **FUZZ)
@given(data=st.data())
def test_many_corrupted_shards_are_refused_by_name_and_never_hang(shard, data):
    check_one(shard, data.draw(corruptions(shard[1].bytes)))


def test_the_sound_shard_decodes_to_its_rows(shard):
    """The oracle the fuzz tests restore after each example."""
    cache, record = shard
    assert verify_shard(cache, record) == cache / record.file
    assert decode(cache / record.file) == record.rows == 6
