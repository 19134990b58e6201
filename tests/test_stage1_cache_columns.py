"""The optional stage-1 columns (docs/cache-columns.md): the space mask of a byte-level and a
SentencePiece tokenizer, the space log-probability and the top-k view against a plain transformers
forward pass, and the checks `vocagno cache verify` runs on them."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from pipeline.cache.rows import check_extra_columns, check_rows
from pipeline.cache.settings import CacheSettings
from pipeline.cache.writer import build_unit_table
from pipeline.errors import CacheError
from pipeline.io import sha256_text
from pipeline.scoring.head import HeadExtras
from pipeline.scoring.hf import HFScorer
from pipeline.scoring.resolve import Asked
from pipeline.scoring.teacher import resolve_teacher
from pipeline.space_mask import space_mask
from pipeline.tokenizer import load_tokenizer
from tests.stage1_helpers import load_model, make_tiny_teacher, windowed_direct_logprobs

TEXTS = [
    "Question: Tom has 3 apples\nand buys 12 more.\tHow many? Answer: 15 " * 3,
    "x",
    "Ünïcödé, emoji 🙂 and  two  spaces.",
]
MAX_LENGTH, STRIDE = 16, 6


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    return {name: make_tiny_teacher(root / name, name) for name in ("smollm2", "tinyllama")}


def test_space_masks_hold_blank_markers_and_special_tokens():
    for name, scheme, blank in (
        ("smollm2", "byte-level", "Ġthe"),
        ("tinyllama", "sentencepiece", "▁the"),
    ):
        tokenizer = load_tokenizer(name)
        vocab = tokenizer.vocab()
        mask, identity = space_mask(tokenizer, tokenizer.vocab_size + 5)
        assert identity["scheme"] == scheme and identity["mode"] == "space+tab+newline+special"
        assert mask.size == tokenizer.vocab_size + 5 and not mask[-5:].any()  # padded head ids
        assert mask[vocab[blank]] and not mask[vocab["the"]]
        assert mask[tokenizer.eos_id] and identity["tokens"] == mask.sum()
        newline = "Ċ" if scheme == "byte-level" else "<0x0A>"
        assert mask[vocab[newline]]
        assert space_mask(tokenizer, mask.size)[1] == identity  # deterministic, hashed


def score(folder, extras):
    tokenizer = load_tokenizer(str(folder))
    ids = [e.ids for e in tokenizer.encode_batch(TEXTS)]
    scorer = HFScorer(
        resolve_teacher(str(folder)), asked=Asked("float32"), max_length=MAX_LENGTH,
        stride=STRIDE, batch_tokens=64, device="cpu", extras=extras,
    ).load()  # fmt: skip
    return tokenizer, ids, scorer.score_columns(ids)


@pytest.mark.parametrize("name", ["smollm2", "tinyllama"])
def test_space_logprob_equals_logsumexp_of_a_plain_forward_over_the_mask(teachers, name):
    tokenizer = load_tokenizer(str(teachers[name]))
    mask, _ = space_mask(tokenizer, tokenizer.vocab_size)
    _, ids, columns = score(teachers[name], HeadExtras(space_mask=mask))
    model = load_model(teachers[name])
    assert set(columns) == {"loss", "space_logprob"}
    for doc, space in zip(ids, columns["space_logprob"], strict=True):
        logprobs = torch.from_numpy(windowed_direct_logprobs(model, doc, MAX_LENGTH, STRIDE))
        expected = torch.logsumexp(logprobs[:, torch.from_numpy(mask)], dim=-1).numpy()
        stored = space.astype(np.float16).astype(np.float32)  # as the cache holds it
        np.testing.assert_allclose(stored[1:], expected[1:], atol=2e-3, rtol=0)
        assert np.isnan(space[0]) and (space[1:] <= 0).all()


def test_the_columns_leave_the_loss_bit_for_bit_as_without_them(teachers):
    tokenizer = load_tokenizer(str(teachers["smollm2"]))
    mask, _ = space_mask(tokenizer, tokenizer.vocab_size)
    plain = score(teachers["smollm2"], HeadExtras())[2]["loss"]
    both = score(teachers["smollm2"], HeadExtras(topk=8, space_mask=mask))[2]["loss"]
    # one code path either way (pipeline.cross_entropy.token_log_probs_and_loss): exactly equal
    for without, with_columns in zip(plain, both, strict=True):
        np.testing.assert_array_equal(with_columns, without)


def test_topk_columns_equal_softmax_of_a_plain_forward(teachers):
    _, ids, columns = score(teachers["smollm2"], HeadExtras(topk=8))
    model = load_model(teachers["smollm2"])
    for doc, loss, probs, top, rest in zip(
        ids, *(columns[c] for c in ("loss", "topk_probs", "topk_ids", "topk_rest")), strict=True
    ):
        reference = np.exp(windowed_direct_logprobs(model, doc, MAX_LENGTH, STRIDE))
        assert np.isnan(probs[0]).all() and (top[0] == -1).all() and np.isnan(rest[0])
        expected = -np.sort(-reference[1:], axis=1)[:, :8]
        np.testing.assert_allclose(probs[1:], expected, atol=1e-6)
        picked = np.take_along_axis(reference[1:], top[1:], axis=1)  # ties may reorder ids
        np.testing.assert_allclose(picked, probs[1:], atol=1e-6)
        np.testing.assert_allclose(rest[1:], 1 - expected.sum(1), atol=1e-5)
        # the loss is -log of the probability of token t in the distribution stored at t
        truth = reference[np.arange(1, len(doc)), doc[1:]]
        np.testing.assert_allclose(loss[1:], -np.log(truth), atol=1e-4)


def test_a_cache_table_with_the_columns_passes_the_row_checks_and_tampering_is_named(teachers):
    tokenizer = load_tokenizer(str(teachers["smollm2"]))
    mask, identity = space_mask(tokenizer, tokenizer.vocab_size)
    _, _, columns = score(teachers["smollm2"], HeadExtras(topk=8, space_mask=mask))
    settings = CacheSettings(topk_probs=8, topk_id_dtype="uint16", space_logprob=identity)
    losses = columns.pop("loss")
    encodings = tokenizer.encode_batch(TEXTS)
    table = build_unit_table(
        [str(i) for i in range(len(TEXTS))], TEXTS, [sha256_text(t) for t in TEXTS], encodings,
        losses, "float16", columns, settings,
    )  # fmt: skip
    assert table.column_names[-4:] == ["topk_probs", "topk_ids", "topk_rest", "space_logprob"]
    assert table.schema.field("topk_ids").type.value_type == pa.list_(pa.uint16(), 8)
    first = table.column("topk_probs").to_pylist()[0]
    assert first[0] is None and len(first[1]) == 8  # token 0: a null entry
    batch = table.to_batches()[0]
    rows = np.arange(batch.num_rows)
    check_extra_columns("s", batch, rows, check_rows("s", batch, rows).lengths)

    def tampered(name, edit):
        values = columns[name][0].copy()
        edit(values)
        changed = build_unit_table(
            [str(i) for i in range(len(TEXTS))], TEXTS, [sha256_text(t) for t in TEXTS],
            encodings, losses, "float16", columns | {name: [values, *columns[name][1:]]}, settings,
        ).to_batches()[0]  # fmt: skip
        with pytest.raises(CacheError, match=r"row 0 token 3") as error:
            check_extra_columns("s", changed, rows, check_rows("s", changed, rows).lengths)
        return str(error.value)

    def swap(v):
        v[3, [0, 1]] = v[3, [1, 0]]

    assert "descending" in tampered("topk_probs", swap)
    assert "repeated" in tampered("topk_ids", lambda v: v.__setitem__((3, 1), v[3, 0]))
    assert "mass" in tampered("topk_rest", lambda v: v.__setitem__(3, 0.5))
    assert "space_logprob" in tampered("space_logprob", lambda v: v.__setitem__(3, 0.25))
