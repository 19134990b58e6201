"""The Arrow table of one work unit, in the cache schema (pipeline.cache.schema)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from pipeline.cache.schema import (
    DOC_ID,
    LOSS,
    TEXT,
    TEXT_SHA256,
    TOKEN_END,
    TOKEN_IDS,
    TOKEN_START,
    cache_schema,
)
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


def _extra_columns(
    schema: pa.Schema, extras: dict[str, list[np.ndarray]], losses, offsets
) -> dict[str, pa.Array]:
    unscored = np.isnan(np.concatenate(losses)) if losses else np.empty(0, dtype=bool)
    columns = {}
    for name, parts in extras.items():
        field = schema.field(name)
        if pa.types.is_fixed_size_list(field.type.value_type):
            columns[name] = _nested_column(parts, field, offsets, unscored)
        else:
            columns[name] = _list_column(parts, field.type.value_type.to_pandas_dtype(), offsets)
    return columns


def build_unit_table(
    doc_ids: list[str],
    texts: list[str],
    text_sha256: list[str],
    encodings: list[Encoding],
    losses: list[np.ndarray],
    loss_dtype: str,
    extras: dict[str, list[np.ndarray]] | None = None,
    settings: dict | None = None,
) -> pa.Table:
    """One row per document; list columns are built from flat arrays, not per token.

    `extras` are the optional columns (pipeline.scoring.head) that `settings`, the cache's result
    settings, declare (pipeline.cache.schema.extra_fields)."""
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
    columns |= _extra_columns(schema, extras or {}, losses, offsets)
    missing = set(schema.names) - set(columns)
    if missing:
        raise ValueError(f"the settings declare columns {sorted(missing)} that were not computed")
    return pa.Table.from_arrays([columns[f.name] for f in schema], schema=schema)
