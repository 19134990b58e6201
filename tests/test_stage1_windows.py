"""Window and batch planning: every token scored once, with the promised left context."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.scoring.batching import plan_batches
from pipeline.scoring.windows import plan_document_windows, plan_windows


@given(
    n=st.integers(0, 400),
    max_length=st.integers(2, 64),
    data=st.data(),
)
def test_every_token_after_the_first_is_scored_once_with_context(n, max_length, data):
    stride = data.draw(st.integers(1, max_length - 1))
    windows = plan_windows(n, max_length, stride)
    times_scored = np.zeros(n, dtype=int)
    for start, end, score_from in windows:
        assert 0 <= start < score_from <= end <= n and end - start <= max_length
        times_scored[score_from:end] += 1
        # Context of each scored token: everything since the window's start.
        context = np.arange(score_from, end) - start
        assert np.all(context >= np.minimum(np.arange(score_from, end), max_length - stride))
    assert times_scored[:1].sum() == 0
    assert np.all(times_scored[1:] == 1)


def test_short_documents_are_one_window_and_tiny_ones_none():
    assert plan_windows(10, 16, 8).tolist() == [[0, 10, 1]]
    assert plan_windows(1, 16, 8).shape == (0, 3)
    assert plan_windows(0, 16, 8).shape == (0, 3)


def test_last_window_is_pulled_back_to_end_at_the_document_end():
    assert plan_windows(20, 8, 4).tolist() == [[0, 8, 1], [4, 12, 8], [8, 16, 12], [12, 20, 16]]
    assert plan_windows(18, 8, 6).tolist() == [[0, 8, 1], [6, 14, 8], [10, 18, 14]]


@pytest.mark.parametrize(("max_length", "stride"), [(1, 1), (8, 0), (8, 8), (8, 9)])
def test_invalid_window_settings_are_refused(max_length, stride):
    with pytest.raises(ValueError):
        plan_windows(10, max_length, stride)


def test_document_windows_are_flat_and_in_document_order():
    table = plan_document_windows([5, 0, 20], 8, 4)
    assert table.doc.tolist() == [0, 2, 2, 2, 2]
    assert table.scored.sum() == 4 + 19


@given(lengths=st.lists(st.integers(1, 300), max_size=60), budget=st.integers(1, 2000))
def test_batches_cover_each_window_once_within_the_budget(lengths, budget):
    lengths = np.array(lengths, dtype=np.int64)
    batches = plan_batches(lengths, budget)
    flat = np.concatenate(batches) if batches else np.array([], dtype=np.int64)
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) == 1 or len(batch) * lengths[batch].max() <= budget
    assert [b.tolist() for b in plan_batches(lengths, budget)] == [b.tolist() for b in batches]


def test_batches_group_similar_lengths():
    lengths = np.array([3, 100, 4, 98, 5, 97])
    assert [b.tolist() for b in plan_batches(lengths, 300)] == [[1, 3, 5], [4, 2, 0]]
