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


def build_unit_table(
    doc_ids: list[str],
    texts: list[str],
    text_sha256: list[str],
    encodings: list[Encoding],
    losses: list[np.ndarray],
    loss_dtype: str,
) -> pa.Table:
    """One row per document; list columns are built from flat arrays, not per token."""
    lengths = np.fromiter((len(e) for e in encodings), dtype=np.int32, count=len(encodings))
    offsets = pa.array(np.concatenate(([0], np.cumsum(lengths))).astype(np.int32))
    schema = cache_schema(loss_dtype)
    columns = {
        DOC_ID: pa.array(doc_ids, pa.string()),
        TEXT: pa.array(texts, pa.large_string()),
        TEXT_SHA256: pa.array(text_sha256, pa.string()),
        TOKEN_IDS: _list_column([e.ids for e in encodings], np.int32, offsets),
        TOKEN_START: _list_column([e.start for e in encodings], np.int32, offsets),
        TOKEN_END: _list_column([e.end for e in encodings], np.int32, offsets),
        LOSS: _list_column(losses, np.dtype(loss_dtype), offsets),
    }
    return pa.Table.from_arrays([columns[f.name] for f in schema], schema=schema)
