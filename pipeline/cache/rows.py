"""The rows of a cache shard as arrays, and the row checks every reader of a shard runs.

One definition for the trainer's stream (stage2_train.data), `vocagno cache verify` and the cache
statistics, so a shard the verifier accepts is exactly a shard the trainer accepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import zstandard

from pipeline.cache import topk_codec
from pipeline.cache.schema import (
    LOGICAL,
    LOSS,
    OPTIONAL_COLUMNS,
    SAMPLE_IDS,
    SAMPLE_LOGPROBS,
    SAMPLE_RANKS,
    SPACE_LOGPROB,
    STORED_AS,
    TARGET_SPANS,
    TEXT,
    TEXT_SHA256,
    TOKEN_END,
    TOKEN_IDS,
    TOKEN_START,
    TOPK_CODES,
    TOPK_IDS,
    TOPK_PROBS,
    TOPK_REST,
)
from pipeline.corpus.targets import span_problems
from pipeline.errors import CacheError
from pipeline.io import sha256_text

# Per-token list columns, in the order their lengths are compared (the first present one is the
# reference: token_ids in a full read, token_start where a reader skips the ids).
PER_TOKEN_COLUMNS = (TOKEN_IDS, TOKEN_START, TOKEN_END, LOSS, *OPTIONAL_COLUMNS)
# float16 rounds each of K probabilities by up to 2**-11 of itself: sum(topk) + rest within this.
MASS_TOLERANCE = 1e-2


def list_column(batch: pa.RecordBatch, name: str, dtype=None) -> tuple[np.ndarray, np.ndarray]:
    """A list<...> column as (flat values, int64 per-row lengths); values cast to `dtype`."""
    column = batch.column(name)
    values = pc.list_flatten(column).to_numpy(zero_copy_only=False)
    if dtype is not None:
        values = values.astype(dtype, copy=False)
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
    return values, lengths


@dataclass(frozen=True)
class CheckedRows:
    """What check_rows read of a batch, for a reader to use rather than read again."""

    texts: list[str]
    token_start: np.ndarray  # as stored (int32), rows concatenated
    token_end: np.ndarray
    lengths: np.ndarray  # int64, tokens per row


def check_rows(path: Path, batch: pa.RecordBatch, rows: np.ndarray) -> CheckedRows:
    """CacheError unless every row's text matches its text_sha256, its per-token columns have
    equal lengths, and its token spans lie inside its text. `rows` are the batch rows' numbers in the
    shard (for the message)."""
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
    start, _ = list_column(batch, TOKEN_START)
    end, _ = list_column(batch, TOKEN_END)
    chars = pc.utf8_length(batch.column(TEXT)).to_numpy(zero_copy_only=False)
    limit = np.repeat(chars, lengths)
    bad = np.flatnonzero((start < 0) | (start > end) | (end > limit))
    if bad.size:
        row = int(np.searchsorted(np.cumsum(lengths), bad[0], side="right"))
        raise CacheError(
            f"shard {path} row {rows[row]}: token span ({start[bad[0]]}, {end[bad[0]]}) "
            f"is not inside its text of {limit[bad[0]]} characters"
        )
    return CheckedRows(texts, start, end, lengths.astype(np.int64))


def rows_index(lengths: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Flat indices that take the values of `rows`, in that order, from the per-token values of
    consecutive rows of these `lengths` (a reordering of rows without Arrow's take)."""
    first = np.cumsum(lengths) - lengths
    counts = lengths[rows]
    return np.arange(int(counts.sum())) + np.repeat(
        first[rows] - (np.cumsum(counts) - counts), counts
    )


def _entries(
    batch: pa.RecordBatch, name: str, where: Path | str = ""
) -> tuple[np.ndarray, np.ndarray]:
    """A list<fixed_size_list<...>[K]> column as ((tokens, K) values, per-token null flags); the
    top-k probabilities and ids decoded from the compact columns where a shard stores those
    (pipeline.cache.topk_codec). `where` names the shard in a refusal."""
    stored = STORED_AS.get(name)
    if name not in batch.schema.names and stored in batch.schema.names:
        return _compact_entries(batch, name, stored, where)
    items = batch.column(name).flatten()  # one fixed-size entry per token, nulls kept
    k = items.type.list_size
    values = items.values.slice(items.offset * k, len(items) * k)
    values = values.fill_null(0).to_numpy(zero_copy_only=False).reshape(len(items), k)
    return values, items.is_null().to_numpy(zero_copy_only=False)


def _compact_entries(
    batch: pa.RecordBatch, name: str, stored: str, where: Path | str
) -> tuple[np.ndarray, np.ndarray]:
    items = batch.column(stored).flatten()  # list<fixed_size_binary[W]>: one entry per token
    width = items.type.byte_width
    raw = np.frombuffer(items.buffers()[1], dtype=np.uint8)
    raw = raw[items.offset * width : (items.offset + len(items)) * width].reshape(-1, width)
    null = items.is_null().to_numpy(zero_copy_only=False)
    if name == TOPK_PROBS:
        return topk_codec.decode_probs(raw), null
    shard = f"shard {where}: " if where else ""
    try:
        order, id_width = topk_codec.order_from(batch.schema.field(stored))
        return topk_codec.decode_ids(raw, order, id_width), null
    except KeyError as exc:
        raise CacheError(
            f"{shard}{stored} does not decode: its field lacks the id order stage 1 stores "
            f"beside it (metadata {exc}), lost where the shard was rewritten by another tool"
        ) from None
    except (ValueError, IndexError, zstandard.ZstdError) as exc:
        raise CacheError(f"{shard}{stored} does not decode ({type(exc).__name__}: {exc})") from None


def token_values(batch: pa.RecordBatch, name: str) -> np.ndarray:
    """A per-token column's values for every token of the batch, rows concatenated: shape
    (tokens,) for list<scalar>, (tokens, K) for list<fixed_size_list[K]> with an unscored token's
    null entry read as NaN (floats) or -1 (integers)."""
    if name in STORED_AS or pa.types.is_fixed_size_list(batch.column(name).type.value_type):
        return _filled(*_entries(batch, name))
    return list_column(batch, name)[0]


def _filled(values: np.ndarray, null: np.ndarray) -> np.ndarray:
    """Entries as token_values gives them: a writable copy (Arrow's float16 values come
    zero-copy, read-only), integers as int64, a null entry NaN or -1."""
    values = values.astype(values.dtype if values.dtype.kind == "f" else np.int64)
    values[null] = np.nan if values.dtype.kind == "f" else -1
    return values


def _fail(path: Path, rows: np.ndarray, lengths: np.ndarray, bad: np.ndarray, what: str):
    row = int(np.searchsorted(np.cumsum(lengths), bad[0], side="right"))
    token = int(bad[0] - (np.cumsum(lengths)[row] - lengths[row]))
    raise CacheError(f"shard {path} row {rows[row]} token {token}: {what}")


def check_extra_columns(
    path: Path,
    batch: pa.RecordBatch,
    rows: np.ndarray,
    lengths: np.ndarray,
    head_size: int | None = None,
) -> dict[str, np.ndarray]:
    """CacheError unless the optional columns present hold what docs/cache-columns.md says:
    unscored (NaN loss) exactly where they are null or NaN, top-k probabilities in [0, 1] and
    descending, distinct non-negative ids, top-k mass plus rest near 1, drawn ids (below
    `head_size`, the teacher's outputs, where the cache records it) and ranks non-negative, drawn
    log-probabilities finite and <= 0, space log-probs <= 0, target spans within the text. Each
    column is checked where it is present: `cache verify` reads them all, stage 2 those it uses.
    Returns the fixed-size columns it decoded, as token_values gives them, for a reader to use
    rather than decode again."""
    names = {LOGICAL.get(name, name) for name in batch.schema.names}
    unscored = np.isnan(list_column(batch, LOSS, np.float32)[0])
    decoded = {}

    def entries(name: str) -> tuple[np.ndarray, np.ndarray]:
        values, null = _entries(batch, name, path)
        decoded[name] = _filled(values, null)
        return values, null

    if TOPK_PROBS in names:
        probs, null = entries(TOPK_PROBS)
        probs = probs.astype(np.float32, copy=False)  # compact codes decode to float32
        _check(path, rows, lengths, null != unscored, f"{TOPK_PROBS} null where loss is not NaN")
        p = probs[~null]
        bad = ~((p >= 0) & (p <= 1)).all(1) | (np.diff(p, axis=1) > 0).any(1)
        _check(path, rows, lengths, _at(~null, bad), f"{TOPK_PROBS} not in [0, 1] and descending")
        if TOPK_REST in names:
            rest = list_column(batch, TOPK_REST, np.float32)[0]
            unset = np.isnan(rest) != unscored
            _check(path, rows, lengths, unset, f"{TOPK_REST} NaN where scored")
            mass = p.sum(1) + rest[~null]
            compact = TOPK_CODES in batch.schema.names  # each probability within a relative error
            tolerance = MASS_TOLERANCE + (topk_codec.RELATIVE_ERROR if compact else 0.0)
            bad = ~((rest[~null] >= 0) & (np.abs(mass - 1) <= tolerance))
            _check(path, rows, lengths, _at(~null, bad), f"top-k mass + {TOPK_REST} is not 1")
    if TOPK_IDS in names:
        ids, null = entries(TOPK_IDS)
        _check(path, rows, lengths, null != unscored, f"{TOPK_IDS} null where loss is not NaN")
        ordered = np.sort(ids[~null].astype(np.int64), axis=1)
        bad = (ordered[:, :1] < 0).any(1) | (np.diff(ordered, axis=1) == 0).any(1)
        _check(path, rows, lengths, _at(~null, bad), f"{TOPK_IDS} negative or repeated")
    limit = head_size if head_size is not None else np.iinfo(np.int64).max
    beyond = f" or from {head_size:,}, the teacher's head size" if head_size is not None else ""
    draws = {
        SAMPLE_IDS: (lambda v: (v >= 0) & (v < limit), f"below 0{beyond}"),
        SAMPLE_LOGPROBS: (lambda v: np.isfinite(v) & (v <= 0), "above 0 or not finite"),
        SAMPLE_RANKS: (lambda v: v >= 0, "below 0"),
    }
    for name, (good, said) in draws.items():
        if name in names:
            values, null = entries(name)
            _check(path, rows, lengths, null != unscored, f"{name} null where loss is not NaN")
            bad = ~good(values[~null]).all(1)
            _check(path, rows, lengths, _at(~null, bad), f"{name} out of range ({said})")
    if SPACE_LOGPROB in names:
        space = list_column(batch, SPACE_LOGPROB, np.float32)[0]
        bad = (np.isnan(space) != unscored) | (space > 0)
        _check(path, rows, lengths, bad, f"{SPACE_LOGPROB} above 0, or NaN where scored")
    if TARGET_SPANS in names:
        _check_target_spans(path, batch, rows)
    return decoded


def target_spans(batch: pa.RecordBatch) -> tuple[np.ndarray, np.ndarray]:
    """The rows' target spans (pipeline.corpus.targets) as [n, 2] int64, rows in order, and how
    many each row has."""
    values, widths = list_column(batch, TARGET_SPANS, np.int64)
    return values.reshape(-1, 2), widths // 2


def _check_target_spans(path: Path, batch: pa.RecordBatch, rows: np.ndarray) -> None:
    widths = list_column(batch, TARGET_SPANS)[1]
    bad = widths % 2 == 1
    if not bad.any():
        text_lengths = pc.utf8_length(batch.column(TEXT)).to_numpy(zero_copy_only=False)
        bad = span_problems(*target_spans(batch), text_lengths)
    if bad.any():
        raise CacheError(
            f"shard {path} row {rows[np.flatnonzero(bad)[0]]}: {TARGET_SPANS} are not ascending, "
            "non-overlapping [start, end) pairs within the text"
        )


def _at(where: np.ndarray, bad: np.ndarray) -> np.ndarray:
    """`bad`, given for the tokens where `where` holds, spread back over all tokens."""
    full = np.zeros(where.shape, dtype=bool)
    full[where] = bad
    return full


def _check(path: Path, rows: np.ndarray, lengths: np.ndarray, bad: np.ndarray, what: str) -> None:
    found = np.flatnonzero(bad)
    if found.size:
        _fail(path, rows, lengths, found, what)
