"""One read's rows a consumer trains on, in stream order, with their per-token cache columns: what
stage2_train.data.documents annotates."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pipeline.cache.rows import CheckedRows, list_column, rows_index, target_spans, token_values
from pipeline.cache.schema import (
    DOC_ID,
    LOSS,
    TARGET_SPANS,
    TEXT,
    TEXT_SHA256,
    TOKEN_END,
    TOKEN_START,
)


@dataclass(frozen=True)
class ReadRows:
    """The rows of one read a consumer trains on, in stream order: texts, document ids, tokens per
    row, and the per-token cache columns (pipeline.cache.rows.token_values), rows concatenated."""

    texts: list[str]
    doc_ids: list[str]
    lengths: np.ndarray
    columns: dict[str, np.ndarray]
    target_spans: tuple[np.ndarray, np.ndarray] | None = None  # (spans [n, 2], per row)

    @classmethod
    def of(
        cls,
        batch: pa.RecordBatch,
        checked: CheckedRows,
        order: np.ndarray,
        names: list[str],
        decoded: dict[str, np.ndarray],
    ) -> ReadRows:
        """The `batch` rows in `order`, from what check_rows read and check_extra_columns
        `decoded`, and the other `names`."""
        index = rows_index(checked.lengths, order)
        known = {
            TOKEN_START: checked.token_start,
            TOKEN_END: checked.token_end,
            LOSS: list_column(batch, LOSS, np.float32)[0],
            **decoded,
        }
        columns = {
            name: (known[name] if name in known else token_values(batch, name))[index]
            for name in names
            if name not in (DOC_ID, TEXT, TEXT_SHA256, TARGET_SPANS)
        }
        spans = None
        if TARGET_SPANS in names:
            stored, per_row = target_spans(batch)
            spans = (stored[rows_index(per_row, order)], per_row[order])
        doc_ids = batch.column(DOC_ID).to_pylist()
        rows = order.tolist()
        return cls(
            [checked.texts[i] for i in rows],
            [doc_ids[i] for i in rows],
            checked.lengths[order],
            columns,
            spans,
        )
