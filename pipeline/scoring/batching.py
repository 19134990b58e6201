"""Batches of windows under a token budget: padded (one window per row, grouped by length so that
padding stays small) or packed (several windows per row, each attending to itself only).

A batch's `BatchLayout` says where each of its windows sits; the forward pass's inputs
(`layout_arrays`) and the scored positions (`scored_positions`) come from it, the same way for
both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.scoring.windows import WindowTable


@dataclass(frozen=True)
class BatchLayout:
    """Window `windows[i]` of a batch fills row `row[i]`, columns [offset[i], offset[i] + its
    length), of an array of shape (rows, length)."""

    windows: np.ndarray
    row: np.ndarray
    offset: np.ndarray
    rows: int
    length: int

    @property
    def slots(self) -> int:
        """Token positions the forward pass computes, padding included."""
        return self.rows * self.length


@dataclass(frozen=True)
class UnitPlan:
    """A scoring call's host-side plan (pipeline.scoring.hf: `HFScorer.plan`): its documents'
    windows, the batches they are laid out in, and the per-document arrays that the batches'
    columns are placed into (so a plan serves one call). A worker makes it before it holds the
    teacher, so that the next unit is planned while the previous one still has the device."""

    windows: WindowTable
    layouts: list[BatchLayout]
    columns: dict[str, list[np.ndarray]]
    # --topk-mode sampled: per document, the uniforms [tokens, K] its draws invert at
    uniforms: list[np.ndarray] | None = None

    def batch_uniforms(self, layout: BatchLayout) -> np.ndarray | None:
        """The uniforms of a batch's scored positions, in the order its columns come back."""
        if self.uniforms is None:
            return None
        w = self.windows
        return np.concatenate([
            self.uniforms[w.doc[row]][w.score_from[row] : w.end[row]] for row in layout.windows
        ])  # fmt: skip


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


def padded_layouts(lengths: np.ndarray, batch_tokens: int) -> list[BatchLayout]:
    """`plan_batches` as layouts: a window per row, right-padded to the batch's longest."""
    return [
        BatchLayout(
            windows=batch, row=np.arange(len(batch)), offset=np.zeros(len(batch), np.int64),
            rows=len(batch), length=int(lengths[batch].max()),
        )  # fmt: skip
        for batch in plan_batches(lengths, batch_tokens)
    ]


def pack_rows(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, offset) of each window in rows of `capacity` tokens: first fit, longest first.

    Deterministic (ties in index order). A loop over windows, not tokens: each step is one
    vectorized search of the rows' free space."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and lengths.max() > capacity:
        raise ValueError(f"a window of {lengths.max()} tokens does not fit a row of {capacity}")
    row = np.empty(len(lengths), dtype=np.int64)
    offset = np.empty(len(lengths), dtype=np.int64)
    used = np.zeros(len(lengths), dtype=np.int64)  # at most one row per window
    rows = 0
    for window in np.argsort(-lengths, kind="stable"):
        fits = np.flatnonzero(used[:rows] + lengths[window] <= capacity)
        target = int(fits[0]) if len(fits) else rows
        rows = max(rows, target + 1)
        row[window], offset[window] = target, used[target]
        used[target] += lengths[window]
    return row, offset


def packed_layouts(lengths: np.ndarray, row_length: int, batch_tokens: int) -> list[BatchLayout]:
    """Windows packed into rows of `row_length` tokens (`pack_rows`), `batch_tokens // row_length`
    rows (at least one) per batch; within a row, windows in row-offset order."""
    row, offset = pack_rows(lengths, row_length)
    per_batch = max(1, batch_tokens // row_length)
    order = np.lexsort((offset, row))  # by row, then position in the row
    rows = int(row.max(initial=-1)) + 1
    bounds = np.searchsorted(row[order], np.arange(-(-rows // per_batch) + 1) * per_batch)
    layouts = []
    for first, (begin, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        members = order[begin:end]
        used = row[members] - first * per_batch
        layouts.append(
            BatchLayout(
                windows=members, row=used, offset=offset[members], rows=int(used.max()) + 1,
                length=row_length,
            )  # fmt: skip
        )
    return layouts


def scored_positions(windows: WindowTable, layout: BatchLayout) -> tuple[np.ndarray, np.ndarray]:
    """(row in batch, position in row) of every position whose next token is scored, window by
    window in the layout's order."""
    rows = layout.windows
    start, score_from, end = windows.start[rows], windows.score_from[rows], windows.end[rows]
    counts = end - score_from
    row = np.repeat(layout.row, counts)
    first = np.repeat(layout.offset + score_from - start - 1, counts)  # predicts token f
    offset = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return row, first + offset


def layout_arrays(
    token_ids: list[np.ndarray], windows: WindowTable, layout: BatchLayout
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input ids, segment ids, position ids), int64 arrays of the layout's shape: window i of the
    layout holds segment i + 1 (0: padding) and positions 0, 1, ... of its own."""
    shape = (layout.rows, layout.length)
    input_ids, segment_ids, position_ids = (np.zeros(shape, dtype=np.int64) for _ in range(3))
    for segment, (window, row, offset) in enumerate(
        zip(layout.windows, layout.row, layout.offset, strict=True), start=1
    ):
        length = windows.length[window]
        place = (row, slice(offset, offset + length))
        input_ids[place] = token_ids[windows.doc[window]][windows.start[window] : windows.end[window]]
        segment_ids[place] = segment
        position_ids[place] = np.arange(length)
    return input_ids, segment_ids, position_ids
