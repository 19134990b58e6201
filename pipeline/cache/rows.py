"""The rows of a cache shard as arrays, and the row checks every reader of a shard runs.

One definition for the trainer's stream (stage2_train.data), `vocagno cache verify` and the cache
statistics, so a shard the verifier accepts is exactly a shard the trainer accepts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.cache.schema import LOSS, TEXT, TEXT_SHA256, TOKEN_END, TOKEN_IDS, TOKEN_START
from pipeline.errors import CacheError
from pipeline.io import sha256_text

# Per-token list columns, in the order their lengths are compared (the first present one is the
# reference: token_ids in a full read, token_start where a reader skips the ids).
PER_TOKEN_COLUMNS = (TOKEN_IDS, TOKEN_START, TOKEN_END, LOSS)


def list_column(batch: pa.RecordBatch, name: str, dtype=None) -> tuple[np.ndarray, np.ndarray]:
    """A list<...> column as (flat values, int64 per-row lengths); values cast to `dtype`."""
    column = batch.column(name)
    values = pc.list_flatten(column).to_numpy(zero_copy_only=False)
    if dtype is not None:
        values = values.astype(dtype, copy=False)
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
    return values, lengths


def check_rows(path: Path, batch: pa.RecordBatch, rows: np.ndarray) -> np.ndarray:
    """CacheError unless every row's text matches its text_sha256, its per-token columns have
    equal lengths, and its token spans lie inside its text. `rows` are the batch rows' numbers in the
    shard (for the message). Returns the token count of each row."""
    # The text first: a text that changed explains any span that no longer fits it.
    texts = batch.column(TEXT).to_pylist()
    hashes = batch.column(TEXT_SHA256).to_pylist()
    for row, text, digest in zip(rows, texts, hashes, strict=True):
        if sha256_text(text) != digest:
            raise CacheError(f"shard {path} row {row}: text_sha256 does not match text")
    present = [name for name in PER_TOKEN_COLUMNS if name in batch.schema.names]
    lengths = pc.list_value_length(batch.column(present[0])).to_numpy(zero_copy_only=False)
    for name in present[1:]:
        other = pc.list_value_length(batch.column(name)).to_numpy(zero_copy_only=False)
        bad = np.flatnonzero(other != lengths)
        if bad.size:
            raise CacheError(
                f"shard {path} row {rows[bad[0]]}: {name} has {other[bad[0]]} values "
                f"for {lengths[bad[0]]} tokens"
            )
    start, _ = list_column(batch, TOKEN_START, np.int64)
    end, _ = list_column(batch, TOKEN_END, np.int64)
    chars = pc.utf8_length(batch.column(TEXT)).to_numpy(zero_copy_only=False)
    limit = np.repeat(chars, lengths)
    bad = np.flatnonzero((start < 0) | (start > end) | (end > limit))
    if bad.size:
        row = int(np.searchsorted(np.cumsum(lengths), bad[0], side="right"))
        raise CacheError(
            f"shard {path} row {rows[row]}: token span ({start[bad[0]]}, {end[bad[0]]}) "
            f"is not inside its text of {limit[bad[0]]} characters"
        )
    return lengths.astype(np.int64)
