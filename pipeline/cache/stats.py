"""What a cache holds, in numbers: documents, tokens, the teacher's loss distribution, bytes.

Percentiles come from a histogram with 0.001-nat bins (losses above 64 nats share the last bin),
so the whole cache is summarized in one streaming pass with constant memory.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pipeline.cache.manifest import load_manifest
from pipeline.cache.rows import list_column
from pipeline.cache.schema import LOSS, TEXT, iter_shard_batches
from pipeline.storage.store import as_location, child, open_parquet

BIN_WIDTH = 0.001
MAX_LOSS = 64.0
PERCENTILES = (1, 10, 50, 90, 99)


@dataclass
class CacheStats:
    shards: int
    documents: int
    skipped: int
    unscored_documents: int  # documents with no scored teacher token (fewer than two tokens)
    teacher_tokens: int
    scored_tokens: int
    nan_fraction: float
    loss_mean: float
    loss_percentiles: dict[str, float]
    bytes: int
    bytes_per_token: float
    bytes_per_token_without_text: float
    teacher: dict
    tokenizer: dict
    settings: dict  # the manifest's, as written (pipeline.cache.settings)
    # Compressed bytes per teacher token of each column (footer sizes; the file's own framing
    # and footer are the rest of bytes_per_token).
    column_bytes_per_token: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def _text_bytes(path: str | Path) -> int:
    """Compressed bytes of the text column in a shard (from the Parquet footer)."""
    metadata = open_parquet(path).metadata
    column = metadata.schema.to_arrow_schema().get_field_index(TEXT)
    return sum(
        metadata.row_group(g).column(column).total_compressed_size
        for g in range(metadata.num_row_groups)
    )


def column_bytes(path: str | Path) -> Counter:
    """Compressed bytes of each top-level column of a shard (its leaves summed), from the footer."""
    metadata = open_parquet(path).metadata
    sizes: Counter = Counter()
    for g in range(metadata.num_row_groups):
        group = metadata.row_group(g)
        for c in range(group.num_columns):
            chunk = group.column(c)
            sizes[chunk.path_in_schema.split(".")[0]] += chunk.total_compressed_size
    return sizes


def percentile_from_histogram(counts: np.ndarray, q: float) -> float:
    """The q-th percentile (0-100) as the centre of the bin where the cumulative count crosses it."""
    total = counts.sum()
    if total == 0:
        return float("nan")
    index = int(np.searchsorted(np.cumsum(counts), q / 100 * total, side="left"))
    return (min(index, len(counts) - 1) + 0.5) * BIN_WIDTH


def cache_stats(cache_dir: str | Path) -> CacheStats:
    """`cache_dir` is a local folder or a URI (pipeline.storage)."""
    cache_dir = as_location(cache_dir)
    manifest = load_manifest(cache_dir)
    counts = np.zeros(int(MAX_LOSS / BIN_WIDTH), dtype=np.int64)
    loss_sum = 0.0
    tokens = scored = unscored_documents = total_bytes = 0
    per_column: Counter = Counter()
    for record in manifest.shards:
        path = child(cache_dir, record.file)
        total_bytes += record.bytes
        per_column.update(column_bytes(path))
        for batch in iter_shard_batches(path, [LOSS], batch_size=1024):
            loss, lengths = list_column(batch, LOSS, np.float64)
            tokens += loss.size
            is_scored = ~np.isnan(loss)
            scored_per_row = np.bincount(
                np.repeat(np.arange(len(lengths)), lengths)[is_scored], minlength=len(lengths)
            )
            unscored_documents += int((scored_per_row == 0).sum())
            finite = loss[is_scored]
            scored += finite.size
            loss_sum += float(finite.sum())
            bins = np.clip((finite / BIN_WIDTH).astype(np.int64), 0, len(counts) - 1)
            counts += np.bincount(bins, minlength=len(counts))
    text_bytes = per_column[TEXT]
    return CacheStats(
        shards=len(manifest.shards),
        documents=manifest.total_rows,
        skipped=len(manifest.skipped),
        unscored_documents=unscored_documents,
        teacher_tokens=tokens,
        scored_tokens=scored,
        nan_fraction=(tokens - scored) / tokens if tokens else float("nan"),
        loss_mean=loss_sum / scored if scored else float("nan"),
        loss_percentiles={f"p{q}": percentile_from_histogram(counts, q) for q in PERCENTILES},
        bytes=total_bytes,
        bytes_per_token=total_bytes / tokens if tokens else float("nan"),
        bytes_per_token_without_text=(total_bytes - text_bytes) / tokens
        if tokens
        else float("nan"),
        teacher=manifest.teacher,
        tokenizer=manifest.tokenizer,
        settings=manifest.settings.to_json(),
        column_bytes_per_token={
            name: size / tokens if tokens else float("nan") for name, size in per_column.items()
        },
    )
