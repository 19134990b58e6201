"""Bytes per teacher token of stage-1 shards, without and with the text column, for the shipped
writer options and alternatives, measured side by side on the same rows.

Usage: python benchmarks/bench_stage1_storage.py --cache DIR
DIR is a stage-1 cache with real teacher losses, best written with --loss-dtype float32 so the
float16 variants are derived from the same values (e.g. the SmolLM2 run of
manifests/stage1-example.toml with --loss-dtype float32). Target: <= 5 bytes/token without text.

A cache made with `--topk-probs 128 --topk-encoding float16 --space-logprob` also gets the bytes
per token of each optional
column (docs/cache-columns.md) for K = 8, 32 and 128, the smaller K cut from the stored top 128
(top-k lists are descending, so the first K are the top K; the rest is recomputed).
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
    OPTIONAL_COLUMNS,
    SPACE_LOGPROB,
    TEXT,
    TOKEN_END,
    TOKEN_IDS,
    TOKEN_START,
    TOPK_CODES,
    TOPK_IDS,
    TOPK_PROBS,
    TOPK_REST,
    cache_schema,
    leaf,
    write_options,
    write_shard,
)
from pipeline.cache.stats import _text_bytes, column_bytes  # noqa: E402


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


def cut_topk(table: pa.Table, k: int) -> pa.Table:
    """The table with its top-k columns cut to the first `k` entries and the rest recomputed."""
    import numpy as np

    table = table.combine_chunks()
    for name in (TOPK_PROBS, TOPK_IDS):
        if name not in table.column_names:
            continue
        column = table.column(name).chunk(0)
        items = column.flatten()
        stored = items.type.list_size
        kind = items.type.value_type
        values = items.values.fill_null(0).to_numpy(zero_copy_only=False)  # null entries: 0s
        values = values.reshape(-1, stored)[:, :k].reshape(-1)
        cut = pa.FixedSizeListArray.from_arrays(
            pa.array(values, type=kind), k, mask=items.is_null()
        )
        table = table.set_column(
            table.schema.get_field_index(name),
            name,
            pa.ListArray.from_arrays(column.offsets, cut),
        )
        if name == TOPK_PROBS:
            probs = values.reshape(-1, k).astype(np.float32)
            rest = np.clip(1 - probs.sum(1), 0, None).astype(np.float16)
            rest[items.is_null().to_numpy(zero_copy_only=False)] = np.nan
            rests = pa.ListArray.from_arrays(column.offsets, pa.array(rest))
            table = table.set_column(table.schema.get_field_index(TOPK_REST), TOPK_REST, rests)
    return table


def optional_column_bytes(tables: list[pa.Table], tokens: int, folder: Path) -> None:
    """Bytes per token of each optional column, shipped writer options, for K = 8, 32, 128."""
    stored = tables[0].schema.field(TOPK_PROBS).type.value_type.list_size
    print(f"optional columns (shipped writer options; stored top-{stored}):")
    for k in (8, 32, 128):
        if k > stored:
            continue
        sizes: dict[str, int] = {}
        for table in tables:
            path = folder / "probe.parquet"
            write_shard(path, cut_topk(table, k), {"benchmark": True})
            for name, size in column_bytes(path).items():
                sizes[name] = sizes.get(name, 0) + size
        parts = "  ".join(
            f"{name}={sizes[name] / tokens:.3f}" for name in OPTIONAL_COLUMNS if name in sizes
        )
        topk = sum(sizes.get(n, 0) for n in (TOPK_PROBS, TOPK_IDS, TOPK_REST)) / tokens
        print(f"  K={k:<4d} top-k total {topk:7.3f} B/token   {parts}")
    if SPACE_LOGPROB in tables[0].column_names:
        print(f"  space_logprob alone: {sizes[SPACE_LOGPROB] / tokens:.3f} B/token")


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
        f"teacher {manifest.teacher.get('name')}; stored loss dtype {manifest.settings.loss_dtype}"
    )
    print(f"{'variant':34s} {'loss':8s} {'B/token w/o text':>17s} {'B/token with text':>18s}")
    with tempfile.TemporaryDirectory() as scratch:
        for loss_dtype in ("float16", "float32"):
            schema = cache_schema(loss_dtype)
            cast = [
                t.select([n for n in t.column_names if n not in OPTIONAL_COLUMNS])
                .set_column(
                    t.schema.get_field_index(LOSS),
                    LOSS,
                    pc.cast(t.column(LOSS), schema.field(LOSS).type),
                )
                .select(schema.names)
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
        if TOPK_PROBS in tables[0].column_names:
            optional_column_bytes(tables, tokens, Path(scratch))
        elif TOPK_CODES in tables[0].column_names:
            print("top-k columns: compact; bench_topk_encoding.py compares the encodings")
    text_chars = sum(pc.sum(pc.utf8_length(t.column(TEXT))).as_py() for t in tables)
    print(f"(text: {text_chars / tokens:.2f} characters per teacher token before compression)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
