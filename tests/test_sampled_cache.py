"""The sampled cache (`--topk-mode sampled`; docs/cache-columns.md "Sampled targets"): stage 1's
draws are those of the teacher's own softmax at the uniforms its documents seed, with each id's
log-probability and rank, the same whatever the batching; the table passes the row checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.cache.rows import check_extra_columns, check_rows, token_values
from pipeline.cache.schema import SAMPLE_IDS, SAMPLE_LOGPROBS, SAMPLE_RANKS
from pipeline.cache.settings import CacheSettings
from pipeline.cache.writer import build_unit_table
from pipeline.errors import CacheError, ConfigError
from pipeline.io import sha256_text
from pipeline.scoring import draws
from pipeline.scoring.head import HeadExtras
from pipeline.scoring.hf import HFScorer
from pipeline.scoring.resolve import Asked
from pipeline.scoring.switches import HeadSwitches
from pipeline.scoring.teacher import resolve_teacher
from pipeline.tokenizer import load_tokenizer
from tests.stage1_helpers import load_model, make_tiny_teacher, windowed_direct_logprobs

TEXTS = ["Tom has 3 apples and buys 12 more. How many? 15 " * 3, "x", "two words here"]
MAX_LENGTH, STRIDE, K = 16, 6, 8
EXTRAS = HeadExtras(topk=K, sampled=True, sample_seed=7)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return make_tiny_teacher(tmp_path_factory.mktemp("teacher") / "t", "smollm2")


def scored(folder, batch_tokens: int = 64, extras: HeadExtras = EXTRAS, **switches):
    tokenizer = load_tokenizer(str(folder))
    ids = [np.asarray(e.ids) for e in tokenizer.encode_batch(TEXTS)]
    scorer = HFScorer(
        resolve_teacher(str(folder)), max_length=MAX_LENGTH, stride=STRIDE,
        batch_tokens=batch_tokens, device="cpu", extras=extras,
        asked=Asked("float32", HeadSwitches(**switches)),
    ).load()  # fmt: skip
    return tokenizer, ids, scorer.score_columns(ids)


def vocabulary_ranks(logprobs: torch.Tensor) -> torch.Tensor:
    """Every id's rank [n, V] by a stable descending sort: the definition draws.drawn_ranks
    counts without sorting."""
    order = torch.sort(logprobs, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1]).expand_as(order))
    return rank


@pytest.mark.parametrize("vocab", [1, 2, 7, 1000, 151_665])
def test_drawn_ranks_are_the_sorted_vocabularys_with_ties_to_the_lower_id(vocab):
    """bf16-rounded logits tie often (as a bf16 teacher's do), a row holds -inf, one is all equal,
    and an id is drawn twice: each drawn id's rank is its place in the stable sort."""
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(16, vocab, generator=generator)).bfloat16().float()
    logits[:3, : vocab // 2] = float("-inf")
    logits[5] = 1.0
    logprobs = torch.log_softmax(logits, -1)
    ids = torch.randint(0, vocab, (16, K), generator=generator)
    ids[:, 1] = ids[:, 0]
    expected = vocabulary_ranks(logprobs).gather(-1, ids)
    assert torch.equal(draws.drawn_ranks(logprobs, ids), expected)


def test_the_draws_are_the_teachers_softmax_inverted_at_the_documents_uniforms(teacher):
    _, ids, columns = scored(teacher)
    model = load_model(teacher)
    for doc, loss, drawn, logprob, rank in zip(
        ids, *(columns[c] for c in ("loss", SAMPLE_IDS, SAMPLE_LOGPROBS, SAMPLE_RANKS)), strict=True
    ):
        if len(doc) < 2:
            assert (drawn == -1).all() and np.isnan(logprob).all()
            continue
        reference = torch.from_numpy(windowed_direct_logprobs(model, doc, MAX_LENGTH, STRIDE)[1:])
        uniforms = torch.from_numpy(draws.document_uniforms(doc, K, EXTRAS.sample_seed)[1:])
        expected = draws.draw_ids(draws.cumulative(reference), uniforms).numpy()
        # an id may differ only where a uniform falls within rounding of a cumulative boundary
        assert (drawn[1:] == expected).mean() > 0.99
        same = drawn[1:] == expected
        picked = np.take_along_axis(reference.numpy(), drawn[1:], axis=1)
        np.testing.assert_allclose(logprob[1:], picked, atol=1e-5)
        ranks = vocabulary_ranks(reference).numpy()
        assert (np.take_along_axis(ranks, drawn[1:], axis=1)[same] == rank[1:][same]).all()
        assert (drawn[0] == -1).all() and np.isnan(logprob[0]).all() and np.isnan(loss[0])


def test_the_draws_do_not_depend_on_the_batching(teacher):
    """Other batches round the logits otherwise (a few 1e-7), never the draws here; a rerun of
    the same batches gives the same bits."""
    _, _, small = scored(teacher, batch_tokens=32)
    _, _, large = scored(teacher, batch_tokens=256)
    _, _, again = scored(teacher, batch_tokens=32)
    for name in (SAMPLE_IDS, SAMPLE_LOGPROBS, SAMPLE_RANKS):
        for ours, theirs, rerun in zip(small[name], large[name], again[name], strict=True):
            np.testing.assert_array_equal(ours, rerun)
            if name == SAMPLE_LOGPROBS:
                np.testing.assert_allclose(ours, theirs, atol=1e-5)
            else:
                np.testing.assert_array_equal(ours, theirs)
    other = HeadExtras(topk=K, sampled=True, sample_seed=8)
    _, _, reseeded = scored(teacher, extras=other)
    assert not np.array_equal(reseeded[SAMPLE_IDS][0], small[SAMPLE_IDS][0])


def test_a_sampled_table_passes_the_row_checks(teacher):
    tokenizer, _, columns = scored(teacher)
    losses = columns.pop("loss")
    settings = CacheSettings(topk_probs=K, topk_id_dtype="uint16", topk_mode="sampled", sample_seed=7)
    table = build_unit_table(
        [str(i) for i in range(len(TEXTS))], TEXTS, [sha256_text(t) for t in TEXTS],
        tokenizer.encode_batch(TEXTS), losses, "float16", columns, settings,
    )  # fmt: skip
    assert table.column_names[-3:] == [SAMPLE_IDS, SAMPLE_LOGPROBS, SAMPLE_RANKS]
    batch = table.to_batches()[0]
    rows = np.arange(batch.num_rows)
    check_extra_columns("s", batch, rows, check_rows("s", batch, rows).lengths)
    assert (token_values(batch, SAMPLE_IDS)[0] == -1).all()
    logprobs = columns[SAMPLE_LOGPROBS][0].copy()
    logprobs[3, 2] = 0.5  # a log-probability above 0: named
    changed = build_unit_table(
        [str(i) for i in range(len(TEXTS))], TEXTS, [sha256_text(t) for t in TEXTS],
        tokenizer.encode_batch(TEXTS), losses, "float16",
        columns | {SAMPLE_LOGPROBS: [logprobs, *columns[SAMPLE_LOGPROBS][1:]]}, settings,
    ).to_batches()[0]  # fmt: skip
    with pytest.raises(CacheError, match=r"row 0 token 3: sample_logprobs out of range \(above"):
        check_extra_columns("s", changed, rows, check_rows("s", changed, rows).lengths)


def test_the_sampled_mode_takes_the_plain_head_only(teacher):
    with pytest.raises(ConfigError, match=r"^--topk-mode sampled draws from the plain head's "
                       r"softmax: use --head-kernel plain, not fused$"):  # fmt: skip
        scored(teacher, head_kernel="fused")


def test_auto_keeps_head_chunks_fixed_for_the_draws_even_on_a_gpu(teacher, monkeypatch):
    """A sampled head holds ~3x the plain head's bytes a logit, beyond what sized chunks budget
    for: under auto, a GPU (as `on_device` answers there) keeps fixed chunks for it."""
    from pipeline.scoring import resolve

    monkeypatch.setattr(resolve, "on_device", lambda choice, device, gpu, cpu: gpu
                        if choice == "auto" else choice)  # fmt: skip
    assert scored_scorer(teacher, EXTRAS).switches.head_chunks == "fixed"
    assert scored_scorer(teacher, HeadExtras(topk=K)).switches.head_chunks == "sized"


def scored_scorer(folder, extras: HeadExtras) -> HFScorer:
    return HFScorer(
        resolve_teacher(str(folder)), max_length=MAX_LENGTH, stride=STRIDE, batch_tokens=64,
        device="cpu", extras=extras, asked=Asked("float32", HeadSwitches(row_packing="padded")),
    ).load()  # fmt: skip
