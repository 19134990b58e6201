"""Batches of windows under a token budget, grouped by length so that padding stays small."""

from __future__ import annotations

import numpy as np


def plan_batches(lengths: np.ndarray, batch_tokens: int) -> list[np.ndarray]:
    """Split window indices into batches whose padded size (rows x longest) fits `batch_tokens`.

    Windows are taken longest first (ties in index order, so the plan is deterministic); a window
    longer than the budget gets a batch of its own.
    """
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be positive, not {batch_tokens}")
    order = np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable")
    batches: list[np.ndarray] = []
    begin = 0
    while begin < len(order):
        longest = int(lengths[order[begin]])  # sorted: the first row is the longest
        rows = max(1, batch_tokens // max(longest, 1))
        batches.append(order[begin : begin + rows])
        begin += rows
    return batches
