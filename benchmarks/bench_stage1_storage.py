"""Bytes per teacher token of stage-1 shards, without and with the text column, for the shipped
writer options and alternatives, measured side by side on the same rows.

Usage: python benchmarks/bench_stage1_storage.py --cache DIR
DIR is a stage-1 cache with real teacher losses, best written with --loss-dtype float32 so the
float16 variants are derived from the same values (e.g. the SmolLM2 run of
manifests/stage1-example.toml with --loss-dtype float32). Target: <= 5 bytes/token without text.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.cache.manifest import load_manifest  # noqa: E402
from pipeline.cache.schema import (  # noqa: E402
    LOSS,
    TEXT,
    TOKEN_END,
    TOKEN_IDS,
    TOKEN_START,
    cache_schema,
    leaf,
    write_options,
    write_shard,
)
from pipeline.cache.stats import _text_bytes  # noqa: E402


def variant(loss_dtype: str, **changes) -> dict:
    """The shipped options with some changed; an encoding of None drops the column's entry."""
    options = copy.deepcopy(write_options(loss_dtype))
    for column, encoding in changes.pop("column_encoding", {}).items():
        if encoding is None:
            options["column_encoding"].pop(column, None)
        else:
            options["column_encoding"][column] = encoding
    options.update(changes)
    return options


def variants(loss_dtype: str) -> dict[str, dict]:
    other_loss = "PLAIN" if loss_dtype == "float32" else "BYTE_STREAM_SPLIT"
    offsets = (leaf(TOKEN_START), leaf(TOKEN_END))
    return {
        "shipped (write_options)": variant(loss_dtype),
        "token_ids delta-packed": variant(
            loss_dtype, column_encoding={leaf(TOKEN_IDS): "DELTA_BINARY_PACKED"}
        ),
        "token_ids dictionary": variant(
            loss_dtype, column_encoding={leaf(TOKEN_IDS): None}, use_dictionary=[leaf(TOKEN_IDS)]
        ),
        "offsets plain": variant(loss_dtype, column_encoding=dict.fromkeys(offsets, "PLAIN")),
        "offsets byte-split (Parquet 2.11)": variant(
            loss_dtype, column_encoding=dict.fromkeys(offsets, "BYTE_STREAM_SPLIT")
        ),
        f"loss {other_loss.lower()}": variant(loss_dtype, column_encoding={leaf(LOSS): other_loss}),
        "zstd level 3": variant(loss_dtype, compression_level=3),
        "zstd level 19": variant(loss_dtype, compression_level=19),
    }


def measure(table: pa.Table, options: dict, folder: Path) -> tuple[int, int, dict]:
    """(bytes with text, bytes of the text column, encodings per column) of `table` as a shard."""
    path = folder / "probe.parquet"
    size, _ = write_shard(path, table, {"benchmark": True}, options)
    group = pq.ParquetFile(path).metadata.row_group(0)
    encodings = {
        group.column(i).path_in_schema: group.column(i).encodings for i in range(group.num_columns)
    }
    return size, _text_bytes(path), encodings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, required=True, help="stage-1 cache to re-encode")
    args = parser.parse_args()
    manifest = load_manifest(args.cache)
    tables = [pq.read_table(args.cache / s.file) for s in manifest.shards]
    tokens = sum(s.teacher_tokens for s in manifest.shards)
    docs = sum(s.rows for s in manifest.shards)
    print(f"cache {args.cache}: {len(tables)} shards, {docs} documents, {tokens} teacher tokens")
    print(
        f"teacher {manifest.teacher.get('name')}; stored loss dtype {manifest.settings['loss_dtype']}"
    )
    print(f"{'variant':34s} {'loss':8s} {'B/token w/o text':>17s} {'B/token with text':>18s}")
    with tempfile.TemporaryDirectory() as scratch:
        for loss_dtype in ("float16", "float32"):
            schema = cache_schema(loss_dtype)
            cast = [
                t.set_column(
                    t.schema.get_field_index(LOSS),
                    LOSS,
                    pc.cast(t.column(LOSS), schema.field(LOSS).type),
                ).select(schema.names)
                for t in tables
            ]
            for name, options in variants(loss_dtype).items():
                sizes = [measure(t, options, Path(scratch)) for t in cast]
                total = sum(s for s, _, _ in sizes)
                text = sum(t for _, t, _ in sizes)
                print(
                    f"{name:34s} {loss_dtype:8s} {(total - text) / tokens:17.3f} {total / tokens:18.3f}"
                )
                if name.startswith("shipped"):
                    used = {k: "+".join(v) for k, v in sizes[0][2].items()}
                    print(f"    encodings: {used}")
    text_chars = sum(pc.sum(pc.utf8_length(t.column(TEXT))).as_py() for t in tables)
    print(f"(text: {text_chars / tokens:.2f} characters per teacher token before compression)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
