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

from pipeline.cache_schema import (  # noqa: E402
    DOC_ID,
    LOSS,
    TEXT,
    TOKEN_IDS,
    WRITE_OPTIONS,
    cache_schema,
    write_shard,
)
from pipeline.cache_stats import _text_bytes  # noqa: E402
from pipeline.manifest import load_manifest  # noqa: E402


def variant(**changes) -> dict:
    options = copy.deepcopy(WRITE_OPTIONS)
    encodings = changes.pop("column_encoding", {})
    for column, encoding in encodings.items():
        if encoding is None:
            options["column_encoding"].pop(column, None)
        else:
            options["column_encoding"][column] = encoding
    options.update(changes)
    return options


VARIANTS = {
    "shipped (WRITE_OPTIONS)": variant(),
    "token_ids PLAIN": variant(column_encoding={TOKEN_IDS: "PLAIN"}),
    "token_ids dictionary": variant(
        column_encoding={TOKEN_IDS: None}, use_dictionary=[DOC_ID, TOKEN_IDS]
    ),
    "loss PLAIN (no byte split)": variant(column_encoding={LOSS: "PLAIN"}),
    "zstd level 3": variant(compression_level=3),
    "zstd level 19": variant(compression_level=19),
    "no dictionary for doc_id": variant(use_dictionary=False),
}


def measure(table: pa.Table, options: dict, folder: Path) -> tuple[int, int]:
    """(bytes with text, bytes of the text column) of `table` written as one shard."""
    path = folder / "probe.parquet"
    size, _ = write_shard(path, table, {"benchmark": True}, options)
    return size, _text_bytes(path)


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
            for name, options in VARIANTS.items():
                sizes = [measure(t, options, Path(scratch)) for t in cast]
                total = sum(s for s, _ in sizes)
                text = sum(t for _, t in sizes)
                print(
                    f"{name:34s} {loss_dtype:8s} {(total - text) / tokens:17.3f} {total / tokens:18.3f}"
                )
    text_chars = sum(pc.sum(pc.utf8_length(t.column(TEXT))).as_py() for t in tables)
    print(f"(text: {text_chars / tokens:.2f} characters per teacher token before compression)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
