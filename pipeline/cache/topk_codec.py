"""The compact top-k encoding (`--topk-encoding compact`, the default of new caches;
docs/cache-columns.md: "Compact top-k"), chosen by measurement
(benchmarks/bench_topk_encoding.py; the table in docs/cache-columns.md).

Probabilities. A position's K probabilities descend, so their negative log-probabilities ascend.
Each is rounded to a multiple of STEP nats, q_j = round(-log p_j / STEP), and the position stores
K + 1 bytes (`topk_codes`, fixed_size_binary): q_0 as two little-endian bytes, then each gap
q_j - q_{j-1} (j >= 1) in one byte. Consecutive ranks are mostly a few steps apart, so zstd keeps
a gap in about two bits. Decoding is exp(-STEP * cumsum): each probability comes back within a
factor exp(STEP / 2) of the teacher's (3.2% at STEP = 1/16), except where two consecutive ranks are
more than MAX_GAP steps (16 nats) apart: the gap is shortened to MAX_GAP, which raises the later
ranks by less than exp(-16) of the rank before them.

Ids. Each id is stored as its rank in the shard's own id order (the ids its top-k lists hold,
most frequent first), in W little-endian bytes (`topk_id_ranks`, fixed_size_binary; W = 2 for a
head of at most 65,536 outputs, else 4), and the order itself, zstd-compressed, in that field's
metadata. Frequent ids get small ranks whose high bytes are zero; an id's bytes are the same
wherever it occurs, which zstd finds. The ids decode exactly.

`topk_rest` stays float16. A cache made before the encoding existed, or with `--topk-encoding
float16`, holds `topk_probs` and `topk_ids` as before and reads unchanged: readers ask for the
logical columns (TOPK_PROBS, TOPK_IDS) and pipeline.cache.rows decodes whichever is stored.
"""

from __future__ import annotations

import base64

import numpy as np
import pyarrow as pa
import zstandard

STEP = 1.0 / 16.0  # nats per code
RELATIVE_ERROR = float(np.expm1(STEP / 2))  # the most a decoded probability is off, relatively
MAX_GAP = 255  # the most steps one byte holds between consecutive ranks
MAX_FIRST = (1 << 16) - 1  # q_0's largest code: p_0 >= exp(-4096), below any float32 probability
ORDER_KEY = b"vocagno.topk_id_order"  # the field metadata holding the shard's id order
WIDTH_KEY = b"vocagno.topk_id_width"  # and the bytes of each stored rank


def id_width(id_dtype: str) -> int:
    """Bytes per stored id rank, from the cache's `topk_id_dtype` (pipeline.cache.schema)."""
    return 2 if id_dtype == "uint16" else 4


def encode_probs(probs: np.ndarray) -> np.ndarray:
    """The codes [n, K + 1] (uint8) of descending probabilities [n, K] (float32; a zero reads
    back as the smallest probability its codes reach)."""
    with np.errstate(divide="ignore"):
        codes = np.rint(-np.log(probs.astype(np.float64)) / STEP)
    k = probs.shape[1]
    codes = np.minimum(np.nan_to_num(codes, nan=0.0), MAX_FIRST + MAX_GAP * k).astype(np.int64)
    gaps = np.clip(np.diff(codes, axis=1), 0, MAX_GAP).astype(np.uint8)
    first = np.minimum(codes[:, 0], MAX_FIRST).astype("<u2")
    return np.concatenate([first[:, None].view(np.uint8), gaps], axis=1)


def decode_probs(codes: np.ndarray) -> np.ndarray:
    """The probabilities [n, K] (float32) that `encode_probs` stored as `codes` [n, K + 1]."""
    first = np.ascontiguousarray(codes[:, :2]).view("<u2")[:, 0].astype(np.int64)
    steps = np.cumsum(codes[:, 2:], axis=1, dtype=np.int64)
    q = np.concatenate([first[:, None], first[:, None] + steps], axis=1)
    return np.exp(-STEP * q).astype(np.float32)


def id_order(ids: np.ndarray) -> np.ndarray:
    """The ids of `ids` [n, K] (int64, -1 where a position is unscored) that occur, most frequent
    first, equal counts by the lower id: the rank of each is what the shard stores. A shard with
    no scored position (one-token documents only) gets the order [0], so that its null entries'
    ranks decode too."""
    counts = np.bincount(ids[ids >= 0].ravel())
    used = np.flatnonzero(counts)
    return used[np.lexsort((used, -counts[used]))] if used.size else np.zeros(1, np.int64)


def encode_ids(ids: np.ndarray, order: np.ndarray, width: int) -> np.ndarray:
    """The rank bytes [n, K * width] (uint8) of `ids` [n, K] in `order` (id_order); an unscored
    position (-1) gets rank 0."""
    rank = np.zeros(int(order.max(initial=0)) + 1, dtype=np.int64)
    rank[order] = np.arange(order.size)
    ranks = np.where(ids >= 0, rank[np.maximum(ids, 0)], 0).astype(f"<u{width}")
    return np.ascontiguousarray(ranks).view(np.uint8).reshape(len(ids), -1)


def decode_ids(stored: np.ndarray, order: np.ndarray, width: int) -> np.ndarray:
    """The ids [n, K] (int64) that `encode_ids` stored as `stored` [n, K * width]."""
    ranks = np.ascontiguousarray(stored).view(f"<u{width}").astype(np.int64)
    return order[ranks]


def order_metadata(order: np.ndarray, width: int) -> dict[bytes, bytes]:
    """The field metadata that holds `order` (ids in `width` bytes, zstd, base64: Parquet's
    key-value metadata is text)."""
    packed = zstandard.ZstdCompressor(level=9).compress(order.astype(f"<u{width}").tobytes())
    return {ORDER_KEY: base64.b64encode(packed), WIDTH_KEY: str(width).encode()}


def order_from(field: pa.Field) -> tuple[np.ndarray, int]:
    """(the id order, the bytes of a rank) stored in `field`'s metadata (order_metadata)."""
    metadata = field.metadata or {}
    width = int(metadata[WIDTH_KEY])
    data = zstandard.ZstdDecompressor().decompress(base64.b64decode(metadata[ORDER_KEY]))
    return np.frombuffer(data, dtype=f"<u{width}").astype(np.int64), width
