"""The cache contract: one Parquet shard per work unit, one row per document (the columns, for
readers outside this tool: docs/cache-columns.md).

Column names are what outside tools rely on; more columns may be added, never renamed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.cache.settings import CacheSettings
from pipeline.cache.topk_codec import id_width
from pipeline.choices import LOSS_DTYPE_NAMES
from pipeline.errors import CacheError
from pipeline.io import atomic_path, sha256_bytes, sha256_file
from pipeline.storage.store import Store, is_uri, open_parquet

SCHEMA_VERSION = 1
METADATA_KEY = b"vocagno"

DOC_ID = "doc_id"
TEXT = "text"
TEXT_SHA256 = "text_sha256"
TOKEN_IDS = "token_ids"
TOKEN_START = "token_start"
TOKEN_END = "token_end"
LOSS = "loss"
COLUMNS = (DOC_ID, TEXT, TEXT_SHA256, TOKEN_IDS, TOKEN_START, TOKEN_END, LOSS)
LOSS_DTYPES = {name: pa.type_for_alias(name) for name in LOSS_DTYPE_NAMES}

# Optional per-token columns (docs/cache-columns.md); the manifest's settings say which a cache has
# (pipeline.cache.settings: a column's name is the setting that adds it, where it has one).
TOPK_PROBS = "topk_probs"  # list<fixed_size_list<float16>[K]>, null where unscored
TOPK_IDS = "topk_ids"  # list<fixed_size_list<uint16 or int32>[K]>, null where unscored
TOPK_REST = "topk_rest"  # list<float16>: 1 - sum(topk_probs), NaN where unscored
MAX_TOPK = 128  # the most top-k entries a position holds
# The compact encoding's columns (pipeline.cache.topk_codec), which stand for TOPK_PROBS and
# TOPK_IDS: readers ask for those, and pipeline.cache.rows decodes whichever a shard stores.
TOPK_CODES = "topk_codes"  # list<fixed_size_binary[K + 1]>, null where unscored
TOPK_ID_RANKS = "topk_id_ranks"  # list<fixed_size_binary[K * W]>, the id order in its metadata
# Per document, with `--targets spans|chat` (pipeline.corpus.targets): its target spans as
# [start0, end0, start1, end1, ...] character offsets in its text.
TARGET_SPANS = "target_spans"  # list<int32>
STORED_AS = {TOPK_PROBS: TOPK_CODES, TOPK_IDS: TOPK_ID_RANKS}
LOGICAL = {stored: logical for logical, stored in STORED_AS.items()}
# A sampled cache's columns (--topk-mode sampled; pipeline.scoring.draws): per position K
# ids drawn from the teacher's distribution, with replacement, and what the estimator needs.
SAMPLE_IDS = "sample_ids"  # list<fixed_size_list<uint16 or int32>[K]>, null where unscored
SAMPLE_LOGPROBS = "sample_logprobs"  # list<fixed_size_list<float32>[K]>: log t(id)
SAMPLE_RANKS = "sample_ranks"  # list<fixed_size_list<int32>[K]>: the id's rank in t, from 0
SPACE_LOGPROB = "space_logprob"  # list<float16>: log P(next token in the space mask), NaN unscored
OPTIONAL_COLUMNS = (
    TOPK_PROBS, TOPK_IDS, TOPK_CODES, TOPK_ID_RANKS, TOPK_REST,
    SAMPLE_IDS, SAMPLE_LOGPROBS, SAMPLE_RANKS, SPACE_LOGPROB,
)  # fmt: skip
# The stage-1 option that adds each (stage1_score/config.py), for a refusal that says what to run.
COLUMN_OPTIONS = {
    TOPK_PROBS: "--topk-probs K",
    TOPK_IDS: "--topk-probs K without --no-topk-ids",
    TOPK_REST: "--topk-probs K",
    SPACE_LOGPROB: "--space-logprob",
    SAMPLE_IDS: "--topk-probs K --topk-mode sampled",
    SAMPLE_LOGPROBS: "--topk-probs K --topk-mode sampled",
    SAMPLE_RANKS: "--topk-probs K --topk-mode sampled",
}


def topk_id_dtype(vocab_size: int) -> str:
    """The narrowest Arrow integer type that holds every id of a head of `vocab_size` outputs."""
    return "uint16" if vocab_size <= 1 << 16 else "int32"


def extra_fields(settings: CacheSettings) -> list[pa.Field]:
    """The optional columns a cache made with these result settings holds, in column order."""
    fields = []
    k = settings.topk_probs
    if k and settings.sampled:
        ids = pa.type_for_alias(settings.topk_id_dtype)
        kinds = {SAMPLE_IDS: ids, SAMPLE_LOGPROBS: pa.float32(), SAMPLE_RANKS: pa.int32()}
        for name, kind in kinds.items():
            fields.append(pa.field(name, pa.list_(pa.list_(kind, k)), nullable=False))
    elif k and settings.compact:
        fields.append(pa.field(TOPK_CODES, pa.list_(pa.binary(k + 1)), nullable=False))
        if settings.topk_ids:
            width = id_width(settings.topk_id_dtype)
            fields.append(pa.field(TOPK_ID_RANKS, pa.list_(pa.binary(k * width)), nullable=False))
    elif k:
        fields.append(pa.field(TOPK_PROBS, pa.list_(pa.list_(pa.float16(), k)), nullable=False))
        if settings.topk_ids:
            ids = pa.type_for_alias(settings.topk_id_dtype)
            fields.append(pa.field(TOPK_IDS, pa.list_(pa.list_(ids, k)), nullable=False))
    if k and not settings.sampled:
        fields.append(pa.field(TOPK_REST, pa.list_(pa.float16()), nullable=False))
    if settings.space_logprob:
        fields.append(pa.field(SPACE_LOGPROB, pa.list_(pa.float16()), nullable=False))
    if settings.target_spans:
        fields.append(pa.field(TARGET_SPANS, pa.list_(pa.int32()), nullable=False))
    return fields


def cache_schema(loss_dtype: str = "float32", settings: CacheSettings | None = None) -> pa.Schema:
    """The shard schema; `settings` (a manifest's result settings) add the optional columns."""
    if loss_dtype not in LOSS_DTYPES:
        raise ValueError(f"loss dtype must be one of {sorted(LOSS_DTYPES)}, not {loss_dtype!r}")
    return pa.schema(
        [
            pa.field(DOC_ID, pa.string(), nullable=False),
            pa.field(TEXT, pa.large_string(), nullable=False),
            pa.field(TEXT_SHA256, pa.string(), nullable=False),
            pa.field(TOKEN_IDS, pa.list_(pa.int32()), nullable=False),
            pa.field(TOKEN_START, pa.list_(pa.int32()), nullable=False),
            pa.field(TOKEN_END, pa.list_(pa.int32()), nullable=False),
            pa.field(LOSS, pa.list_(LOSS_DTYPES[loss_dtype]), nullable=False),
            *extra_fields(settings or CacheSettings()),
        ]
    )


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.parquet"


def leaf(column: str) -> str:
    """Parquet path of a list column's values: encodings are set per leaf, not per list."""
    return f"{column}.list.element"


def write_options(loss_dtype: str = "float32") -> dict:
    """pyarrow `write_table` arguments for a shard (benchmarks/bench_stage1_storage.py compares
    alternatives on real teacher losses).

    Encodings are picked for size among those every common Parquet reader decodes: offsets grow
    by a few characters per token, so delta packing stores them in a few bits; the split bytes of
    float32 losses compress better than whole floats. Byte-split integers and float16 (Parquet
    2.11) gain little here and are not yet readable everywhere. Token ids stay plain: zstd does
    better on them than delta packing. No statistics and a fixed writer keep shards
    byte-reproducible.
    """
    encodings = {
        leaf(TOKEN_START): "DELTA_BINARY_PACKED",
        leaf(TOKEN_END): "DELTA_BINARY_PACKED",
        leaf(TOKEN_IDS): "PLAIN",
        leaf(LOSS): "BYTE_STREAM_SPLIT" if loss_dtype == "float32" else "PLAIN",
        TEXT_SHA256: "PLAIN",
    }
    return {
        "compression": "zstd",
        "compression_level": 9,
        "use_dictionary": False,  # ids are unique, hashes random: a dictionary only adds bytes
        "column_encoding": encodings,
        "write_statistics": False,
        "store_schema": True,
    }


def write_shard(
    path: str | Path, table: pa.Table, metadata: dict, options: dict | None = None
) -> tuple[int, str]:
    """Write `table` atomically with our metadata in the Parquet footer; returns (bytes, sha256).
    `path` is a local path or a URI (pipeline.storage).

    `options` (pyarrow.parquet.write_table arguments) default to `write_options` for the table's
    loss dtype.
    """
    if options is None:
        is_half = table.schema.field(LOSS).type.value_type == pa.float16()
        options = write_options("float16" if is_half else "float32")
    table = table.replace_schema_metadata({METADATA_KEY: json.dumps(metadata, sort_keys=True)})
    if is_uri(path):
        # Object storage has no rename: the whole file is built in memory and sent in one upload.
        buffer = pa.BufferOutputStream()
        pq.write_table(table, buffer, **options)
        data = buffer.getvalue().to_pybytes()
        folder, name = str(path).rsplit("/", 1)
        Store(folder).write_bytes(name, data)
        return len(data), sha256_bytes(data)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, **options)
    return path.stat().st_size, sha256_file(path)


def read_shard_metadata(path: Path) -> dict:
    try:
        meta = open_parquet(path).schema_arrow.metadata or {}
    except Exception as exc:
        raise CacheError(f"shard {path} is not a readable Parquet file: {exc}") from exc
    if METADATA_KEY not in meta:
        raise CacheError(f"shard {path} has no vocagno metadata: not written by stage 1")
    return json.loads(meta[METADATA_KEY])


def iter_shard_batches(
    path: str | Path,
    columns: list[str] | None = None,
    batch_size: int = 256,
    *,
    use_threads: bool = True,
) -> Iterator[pa.RecordBatch]:
    """Stream a shard (a local path or a URI) in record batches; every failure to decode becomes a
    CacheError naming it. `use_threads=False` decodes on the calling thread (a reader that has
    one core: Arrow's thread pool would only add hand-offs)."""
    try:
        parquet = open_parquet(path)
        stored = parquet.schema_arrow.names
        if columns is not None:  # a logical top-k column is read in the encoding stored
            columns = [
                STORED_AS[c] if c not in stored and STORED_AS.get(c) in stored else c
                for c in columns
            ]
        missing = set(columns or COLUMNS) - set(stored)
        if missing:
            raise CacheError(f"shard {path} lacks columns {sorted(missing)}")
        yield from parquet.iter_batches(
            batch_size=batch_size, columns=columns, use_threads=use_threads
        )
    except CacheError:
        raise
    except Exception as exc:
        raise CacheError(f"shard {path} is corrupt: {exc}") from exc
