"""The Arrow table of one work unit, in the cache schema (pipeline.cache.schema)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from pipeline.cache import topk_codec
from pipeline.cache.schema import (
    DOC_ID,
    LOSS,
    TARGET_SPANS,
    TEXT,
    TEXT_SHA256,
    TOKEN_END,
    TOKEN_IDS,
    TOKEN_START,
    TOPK_CODES,
    TOPK_ID_RANKS,
    TOPK_IDS,
    TOPK_PROBS,
    cache_schema,
)
from pipeline.cache.settings import CacheSettings
from pipeline.tokenizer import Encoding


def _list_column(parts: list[np.ndarray], dtype: np.dtype, offsets: pa.Array) -> pa.ListArray:
    values = np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype)
    return pa.ListArray.from_arrays(offsets, pa.array(values))


def _nested_column(
    parts: list[np.ndarray], field: pa.Field, offsets: pa.Array, unscored: np.ndarray
) -> pa.ListArray:
    """list<fixed_size_list<...>[K]> from per-document (n, K) arrays; unscored entries are null."""
    item = field.type.value_type
    k = item.list_size
    values = np.concatenate(parts).reshape(-1) if parts else np.empty(0)
    values = pa.array(values.astype(item.value_type.to_pandas_dtype(), copy=False))
    mask = pa.array(unscored) if unscored.any() else None
    return pa.ListArray.from_arrays(
        offsets, pa.FixedSizeListArray.from_arrays(values, k, mask=mask)
    )


def _binary_column(
    rows: np.ndarray, field: pa.Field, offsets: pa.Array, unscored: np.ndarray
) -> pa.ListArray:
    """list<fixed_size_binary[W]> from (tokens, W) uint8 rows; unscored entries are null."""
    item = field.type.value_type
    validity = pa.array(~unscored).buffers()[1] if unscored.any() else None
    data = pa.py_buffer(np.ascontiguousarray(rows, dtype=np.uint8).tobytes())
    values = pa.Array.from_buffers(item, len(rows), [validity, data], int(unscored.sum()))
    return pa.ListArray.from_arrays(offsets, values)


def _compact_topk(
    schema: pa.Schema,
    extras: dict[str, list[np.ndarray]],
    offsets,
    unscored,
    settings: CacheSettings,
) -> tuple[pa.Schema, dict[str, pa.Array]]:
    """The compact columns (pipeline.cache.topk_codec) that stand for the top-k probabilities and
    ids in `extras`, which loses them; the schema gains the shard's id order."""
    columns = {}
    probs = np.concatenate(extras.pop(TOPK_PROBS)).reshape(len(unscored), -1)
    probs[unscored] = 1.0  # a null entry's bytes: any finite code
    columns[TOPK_CODES] = _binary_column(
        topk_codec.encode_probs(probs), schema.field(TOPK_CODES), offsets, unscored
    )
    if TOPK_IDS in extras:
        ids = np.concatenate(extras.pop(TOPK_IDS)).reshape(len(unscored), -1).astype(np.int64)
        ids[unscored] = -1
        width = topk_codec.id_width(settings.topk_id_dtype)
        order = topk_codec.id_order(ids)
        index = schema.get_field_index(TOPK_ID_RANKS)
        field = schema.field(index).with_metadata(topk_codec.order_metadata(order, width))
        schema = schema.set(index, field)
        ranks = topk_codec.encode_ids(ids, order, width)
        columns[TOPK_ID_RANKS] = _binary_column(ranks, field, offsets, unscored)
    return schema, columns


def _extra_columns(
    schema: pa.Schema,
    extras: dict[str, list[np.ndarray]],
    losses,
    offsets,
    settings: CacheSettings,
) -> tuple[pa.Schema, dict[str, pa.Array]]:
    unscored = np.isnan(np.concatenate(losses)) if losses else np.empty(0, dtype=bool)
    columns = {}
    if TOPK_PROBS in extras and settings.compact:
        extras = dict(extras)
        schema, columns = _compact_topk(schema, extras, offsets, unscored, settings)
    for name, parts in extras.items():
        field = schema.field(name)
        if pa.types.is_fixed_size_list(field.type.value_type):
            columns[name] = _nested_column(parts, field, offsets, unscored)
        else:
            columns[name] = _list_column(parts, field.type.value_type.to_pandas_dtype(), offsets)
    return schema, columns


def build_unit_table(
    doc_ids: list[str],
    texts: list[str],
    text_sha256: list[str],
    encodings: list[Encoding],
    losses: list[np.ndarray],
    loss_dtype: str,
    extras: dict[str, list[np.ndarray]] | None = None,
    settings: CacheSettings | None = None,
    target_spans: list | None = None,
) -> pa.Table:
    """One row per document; list columns are built from flat arrays, not per token.

    `extras` are the optional columns (pipeline.scoring.head) that `settings`, the cache's result
    settings, declare (pipeline.cache.schema.extra_fields); `target_spans`, each document's
    spans (pipeline.corpus.targets), where the settings declare them."""
    lengths = np.fromiter((len(e) for e in encodings), dtype=np.int32, count=len(encodings))
    offsets = pa.array(np.concatenate(([0], np.cumsum(lengths))).astype(np.int32))
    schema = cache_schema(loss_dtype, settings)
    columns = {
        DOC_ID: pa.array(doc_ids, pa.string()),
        TEXT: pa.array(texts, pa.large_string()),
        TEXT_SHA256: pa.array(text_sha256, pa.string()),
        TOKEN_IDS: _list_column([e.ids for e in encodings], np.int32, offsets),
        TOKEN_START: _list_column([e.start for e in encodings], np.int32, offsets),
        TOKEN_END: _list_column([e.end for e in encodings], np.int32, offsets),
        LOSS: _list_column(losses, np.dtype(loss_dtype), offsets),
    }
    schema, extra = _extra_columns(
        schema, extras or {}, losses, offsets, settings or CacheSettings()
    )
    columns |= extra
    if TARGET_SPANS in schema.names:
        spans = [np.asarray(s, dtype=np.int32).reshape(-1) for s in target_spans or []]
        widths = np.fromiter((s.size for s in spans), dtype=np.int32, count=len(spans))
        span_offsets = pa.array(np.concatenate(([0], np.cumsum(widths))).astype(np.int32))
        columns[TARGET_SPANS] = _list_column(spans, np.int32, span_offsets)
    missing = set(schema.names) - set(columns)
    if missing:
        raise ValueError(f"the settings declare columns {sorted(missing)} that were not computed")
    return pa.Table.from_arrays([columns[f.name] for f in schema], schema=schema)
