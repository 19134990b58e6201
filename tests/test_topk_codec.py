"""The compact top-k encoding (pipeline/cache/topk_codec.py, docs/cache-columns.md): what a
reader gets back from it, against the teacher's values and against the float16 cache."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from pipeline.cache import topk_codec
from pipeline.cache.rows import check_extra_columns, check_rows, token_values
from pipeline.cache.schema import TOPK_CODES, TOPK_ID_RANKS, TOPK_IDS, TOPK_PROBS, TOPK_REST
from pipeline.cache.settings import CacheSettings
from pipeline.cache.writer import build_unit_table
from pipeline.errors import CacheError
from pipeline.io import sha256_text
from pipeline.tokenizer import load_tokenizer
from tests.cache_fixtures import teacher_topk


def descending(rng: np.random.Generator, n: int, k: int, spread: float) -> np.ndarray:
    logits = rng.normal(0.0, spread, (n, 4 * k))
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    return -np.sort(-probs, axis=1)[:, :k].astype(np.float32)


def test_each_probability_decodes_within_the_stated_relative_error():
    """Flat, peaked and very peaked rows (a top near 1 with a tail 30 nats below, where gaps
    exceed a byte and are shortened), zeros and the smallest float32 values."""
    rng = np.random.default_rng(0)
    probs = np.concatenate([descending(rng, 500, 32, s) for s in (0.5, 3.0, 12.0)])
    probs[0, -4:] = 0.0
    probs[1, -4:] = np.float32(1e-44)  # subnormal: far below what the codes reach
    codes = topk_codec.encode_probs(probs)
    assert codes.shape == (len(probs), 33) and codes.dtype == np.uint8
    back = topk_codec.decode_probs(codes)
    relative = np.abs(back / np.where(probs > 0, probs, 1) - 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        gaps = np.diff(-np.log(probs.astype(np.float64)), axis=1)
    limit = topk_codec.MAX_GAP * topk_codec.STEP
    long_gap = np.pad(gaps > limit, ((0, 0), (1, 0)))  # a finite gap longer than a byte holds
    after = np.cumsum(np.pad(~(gaps <= limit), ((0, 0), (1, 0))), axis=1) > 0  # and zeros
    assert long_gap.any() and after.mean() < 0.05  # the very peaked rows, only there
    assert relative[~after].max() <= topk_codec.RELATIVE_ERROR * (1 + 1e-6)
    # a shortened gap raises the ranks after it, but keeps them 255 steps below the rank before
    assert (back[after] >= probs[after] * (1 - topk_codec.RELATIVE_ERROR)).all()
    before = np.roll(back, 1, axis=1)[long_gap]
    np.testing.assert_allclose(
        back[long_gap], before * np.exp(-topk_codec.STEP * topk_codec.MAX_GAP), rtol=1e-5
    )
    assert (back[:2, -4:] < 1e-6 * back[:2, -5:-4]).all()  # zeros and subnormals: negligible
    assert (np.diff(back, axis=1) <= 0).all()  # still descending


@pytest.mark.parametrize("vocab,width", [(49_152, 2), (151_665, 4)])
def test_ids_decode_exactly_by_their_rank_in_the_shard(vocab, width):
    rng = np.random.default_rng(1)
    ids = np.stack([rng.choice(vocab, 16, replace=False) for _ in range(300)])
    ids[:, 0] = rng.choice([13, 220, vocab - 1], 300)  # frequent ids get the smallest ranks
    ids[[0, 7]] = -1  # unscored
    order = topk_codec.id_order(ids)
    assert order[0] in (13, 220, vocab - 1) and len(np.unique(order)) == order.size
    stored = topk_codec.encode_ids(ids, order, width)
    assert stored.shape == (300, 16 * width)
    back = topk_codec.decode_ids(stored, order, width)
    np.testing.assert_array_equal(back[ids >= 0], ids[ids >= 0])
    field = pa.field("f", pa.int8(), metadata=topk_codec.order_metadata(order, width))
    found, found_width = topk_codec.order_from(field)
    np.testing.assert_array_equal(found, order)
    assert found_width == width


def unit_table(k: int, encoding: str, seed: int = 0, texts: tuple[str, ...] = ()):
    tokenizer = load_tokenizer("smollm2")
    texts = list(texts or ("Tom has 3 apples and buys 12 more. How many? 15 " * 4, "x", "words"))
    encodings = tokenizer.encode_batch(texts)
    rng = np.random.default_rng(seed)
    columns = [teacher_topk(len(e), k, tokenizer.vocab_size, rng) for e in encodings]
    losses = [np.where(np.arange(len(e)) == 0, np.nan, 1.0).astype(np.float32) for e in encodings]
    settings = CacheSettings(topk_probs=k, topk_id_dtype="uint16", topk_encoding=encoding)
    extras = {name: [c[name] for c in columns] for name in columns[0]}
    table = build_unit_table(
        [str(i) for i in range(len(texts))], texts, [sha256_text(t) for t in texts], encodings,
        losses, "float16", extras, settings,
    )  # fmt: skip
    return table, extras


def test_a_compact_table_reads_back_as_the_float16_one_within_the_stated_error():
    """Readers ask for topk_probs and topk_ids whichever encoding a shard holds; the compact one
    stores other columns (so no outside reader takes codes for probabilities), reads back the
    same ids, nulls where the float16 table has them, and passes the row checks."""
    compact, extras = unit_table(8, "compact")
    plain, _ = unit_table(8, "float16")
    assert {TOPK_CODES, TOPK_ID_RANKS} <= set(compact.column_names)
    assert not {TOPK_PROBS, TOPK_IDS} & set(compact.column_names)
    ours, theirs = compact.to_batches()[0], plain.to_batches()[0]
    np.testing.assert_array_equal(token_values(ours, TOPK_IDS), token_values(theirs, TOPK_IDS))
    np.testing.assert_array_equal(token_values(ours, TOPK_REST), token_values(theirs, TOPK_REST))
    truth = np.concatenate(extras[TOPK_PROBS])
    read = token_values(ours, TOPK_PROBS)
    assert (np.isnan(read) == np.isnan(truth)).all() and np.isnan(read[0]).all()
    scored = ~np.isnan(truth)
    assert np.abs(read[scored] / truth[scored] - 1).max() <= topk_codec.RELATIVE_ERROR * 1.0001
    rows = np.arange(ours.num_rows)
    check_extra_columns("s", ours, rows, check_rows("s", ours, rows).lengths)


def test_a_shard_of_one_token_documents_only_reads_back_as_nulls():
    table, _ = unit_table(8, "compact", texts=("x", "y"))  # no position is scored
    batch = table.to_batches()[0]
    assert (token_values(batch, TOPK_IDS) == -1).all()
    assert np.isnan(token_values(batch, TOPK_PROBS)).all()


def test_a_damaged_id_order_is_refused_in_one_line():
    """Before: a lost id order was quoted as a bare KeyError (`b'vocagno.topk_id_order'`)
    naming neither the shard nor what was lost; the check every reader runs names both."""
    table, _ = unit_table(8, "compact")
    index = table.schema.get_field_index(TOPK_ID_RANKS)
    field = table.schema.field(index)
    lost = table.cast(table.schema.set(index, field.with_metadata({})))
    batch = lost.to_batches()[0]
    rows = np.arange(batch.num_rows)
    with pytest.raises(CacheError, match=r"^shard cache/shard-000000.parquet: topk_id_ranks does "
                       r"not decode: its field lacks the id order stage 1 stores beside it"):  # fmt: skip
        check_extra_columns("cache/shard-000000.parquet", batch, rows,
                            check_rows("s", batch, rows).lengths)  # fmt: skip
    short = topk_codec.order_metadata(topk_codec.order_from(field)[0][:3], 2)
    cut = table.cast(table.schema.set(index, field.with_metadata(short)))
    with pytest.raises(CacheError, match=r"^topk_id_ranks does not decode \(IndexError"):
        token_values(cut.to_batches()[0], TOPK_IDS)
