"""`vocagno cache verify` names every damaged shard and exits non-zero; `cache stats` is exact
where it can be (counts, mean, bytes) and within one histogram bin for percentiles."""

from __future__ import annotations

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from apps.cli import main
from pipeline.cache.manifest import MANIFEST_NAME, ShardRecord, load_manifest, write_manifest
from pipeline.cache.schema import LOSS, TEXT, TEXT_SHA256, TOKEN_END, write_shard
from pipeline.cache.stats import BIN_WIDTH
from pipeline.cache.verify import verify_shard
from pipeline.errors import CacheError
from tests.cache_fixtures import build_cache


@pytest.fixture
def cache(tmp_path):
    build_cache(tmp_path / "cache", num_documents=12, docs_per_shard=4)
    return tmp_path / "cache"


def verify(cache, capsys) -> tuple[int, str]:
    code = main(["cache", "verify", str(cache)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_a_sound_cache_verifies(cache, capsys):
    code, output = verify(cache, capsys)
    assert code == 0, output
    assert (
        output.count("ok    shard-") == 3 and "12 documents" in output and "all verified" in output
    )


def flip_byte(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_bit_flip_truncation_and_missing_shards_are_named(cache, capsys):
    flip_byte(cache / "shard-000001.parquet", 200)
    shard2 = cache / "shard-000002.parquet"
    shard2.write_bytes(shard2.read_bytes()[:-100])
    code, output = verify(cache, capsys)
    assert code == 1
    assert "FAIL  shard" in output and "shard-000001.parquet has sha256" in output
    assert "shard-000002.parquet has" in output and "truncated or replaced" in output
    assert "ok    shard-000000.parquet" in output and "2 problem(s)" in output
    shard2.unlink()
    code, output = verify(cache, capsys)
    assert code == 1 and "shard-000002.parquet is listed in the manifest but missing" in output


def test_unlisted_shards_and_leftover_temporary_files_are_problems(cache, capsys):
    (cache / "shard-000009.parquet").write_bytes(b"PAR1")
    (cache / ".shard-000003.parquet.abc.tmp").write_bytes(b"partial")
    code, output = verify(cache, capsys)
    assert code == 1
    assert "shard-000009.parquet is not listed in the manifest" in output
    assert ".shard-000003.parquet.abc.tmp is a temporary file" in output


def rewrite_shard(cache, index: int, change) -> None:
    """Replace shard `index` by a changed table and record its new size and hash (a consistent
    manifest), so only the content checks can catch the change."""
    manifest = load_manifest(cache)
    record = manifest.shards[index]
    path = cache / record.file
    table = change(pq.read_table(path))
    size, digest = write_shard(path, table, {"shard": index})
    manifest.shards[index] = ShardRecord(
        index, record.file, record.rows, record.teacher_tokens, size, digest
    )
    write_manifest(cache, manifest)


def test_content_checks_name_the_row(cache, capsys):
    def wrong_hash(table):
        hashes = table.column(TEXT_SHA256).to_pylist()
        hashes[2] = "0" * 64
        return table.set_column(2, TEXT_SHA256, pa.array(hashes))

    def span_past_text(table):
        ends = table.column(TOKEN_END).to_pylist()
        ends[1][-1] = len(table.column(TEXT)[1].as_py()) + 5
        return table.set_column(
            table.schema.get_field_index(TOKEN_END),
            TOKEN_END,
            pa.array(ends, table.schema.field(TOKEN_END).type),
        )

    def short_loss(table):
        losses = table.column(LOSS).to_pylist()
        losses[3] = losses[3][:-1]
        return table.set_column(
            table.schema.get_field_index(LOSS),
            LOSS,
            pa.array(losses, table.schema.field(LOSS).type),
        )

    rewrite_shard(cache, 0, wrong_hash)
    rewrite_shard(cache, 1, span_past_text)
    rewrite_shard(cache, 2, short_loss)
    code, output = verify(cache, capsys)
    assert code == 1 and "3 problem(s)" in output
    assert "shard-000000.parquet row 2: text_sha256 does not match text" in output
    assert "shard-000001.parquet row 1: token span" in output and "is not inside its text" in output
    assert "shard-000002.parquet row 3: loss has" in output


def test_counts_and_schema_must_match_the_manifest(cache, capsys):
    manifest = load_manifest(cache)
    record = manifest.shards[0]
    manifest.shards[0] = ShardRecord(
        0, record.file, record.rows + 1, record.teacher_tokens, record.bytes, record.sha256
    )
    write_manifest(cache, manifest)
    rewrite_shard(
        cache,
        1,
        lambda t: t.set_column(
            t.schema.get_field_index(LOSS), LOSS, pc.cast(t.column(LOSS), pa.list_(pa.float64()))
        ),
    )
    code, output = verify(cache, capsys)
    assert code == 1
    assert (
        f"shard-000000.parquet has {record.rows} rows but the manifest says {record.rows + 1}"
        in output
    )
    assert re.search(
        r"column 'loss' is list<\w+: double>, the schema says list<item: float>", output
    )


def test_a_corrupt_manifest_is_one_line_and_exit_2(cache, capsys):
    (cache / MANIFEST_NAME).write_text('{"schema_version": 1')
    code, output = verify(cache, capsys)
    assert code == 2
    assert output.strip().startswith("vocagno cache: error:") and "is not valid JSON" in output
    assert len(output.strip().splitlines()) == 1


def test_verify_shard_is_the_readers_cheap_check(cache):
    record = load_manifest(cache).shards[1]
    assert verify_shard(cache, record) == cache / record.file
    flip_byte(cache / record.file, 10)
    with pytest.raises(CacheError, match="shard-000001.parquet has sha256"):
        verify_shard(cache, record)


def test_stats_match_the_shards(cache, capsys):
    assert main(["cache", "stats", str(cache), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    manifest = load_manifest(cache)
    loss = np.concatenate(
        [
            pc.list_flatten(pq.read_table(cache / s.file).column(LOSS)).to_numpy(
                zero_copy_only=False
            )
            for s in manifest.shards
        ]
    ).astype(np.float64)
    scored = loss[~np.isnan(loss)]
    assert stats["documents"] == 12 and stats["teacher_tokens"] == loss.size
    assert stats["scored_tokens"] == scored.size
    assert stats["nan_fraction"] == pytest.approx(12 / loss.size)
    assert stats["loss_mean"] == pytest.approx(scored.mean(), rel=1e-9)
    for q in (1, 10, 50, 90, 99):
        assert abs(stats["loss_percentiles"][f"p{q}"] - np.percentile(scored, q)) <= 2 * BIN_WIDTH
    total = sum(s.bytes for s in manifest.shards)
    assert stats["bytes_per_token"] == pytest.approx(total / loss.size)
    assert 0 < stats["bytes_per_token_without_text"] < stats["bytes_per_token"]
    assert main(["cache", "stats", str(cache)]) == 0
    text = capsys.readouterr().out
    assert "documents        12 (+0 skipped)" in text and "without the text column" in text
