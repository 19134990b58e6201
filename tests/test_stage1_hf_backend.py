"""The HF backend's losses equal a direct transformers forward pass (fp32, 1e-4), with and
without BOS, in sliding windows, through padded length-grouped batches; NaN where unscored."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.scoring.hf import HFScorer
from pipeline.scoring.resolve import Asked
from pipeline.scoring.teacher import resolve_teacher
from pipeline.tokenizer import load_tokenizer
from tests.stage1_helpers import (
    direct_losses,
    load_model,
    make_tiny_teacher,
    windowed_direct_losses,
)

TEXTS = [
    "Question: Tom has 3 apples and buys 12 more. How many apples does he have?\nAnswer: 3 + 12 = 15",
    "Short.",
    "x",
    "Ünïcödé, emoji 🙂 and full-width ９９ digits.",
    "A longer passage that repeats itself. " * 12,
]


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    return {name: make_tiny_teacher(root / name, name) for name in ("tinyllama", "smollm2")} | {
        "gemma2": make_tiny_teacher(root / "gemma2", "smollm2", arch="gemma2")
    }


def score(folder, texts, *, max_length=256, stride=128, batch_tokens=512):
    tokenizer = load_tokenizer(str(folder))
    ids = [e.ids for e in tokenizer.encode_batch(texts)]
    scorer = HFScorer(
        resolve_teacher(str(folder)),
        max_length=max_length,
        stride=stride,
        batch_tokens=batch_tokens,
        asked=Asked("float32"),
        device="cpu",
    ).load()
    return scorer, ids, scorer.score(ids)


@pytest.mark.parametrize("name", ["tinyllama", "smollm2"])
def test_losses_equal_a_direct_forward_pass(teachers, name):
    scorer, ids, losses = score(teachers[name], TEXTS)
    model = load_model(teachers[name])
    assert scorer.resolved.plain_head
    for doc_ids, loss in zip(ids, losses, strict=True):
        assert loss.dtype == np.float32 and loss.shape == doc_ids.shape
        if len(doc_ids) > 1:
            np.testing.assert_allclose(loss, direct_losses(model, doc_ids), atol=1e-4, rtol=0)
        assert np.isnan(loss[0]) and np.all(np.isfinite(loss[1:]))


def test_bos_is_token_zero_and_the_first_text_token_is_scored(teachers):
    _, ids, losses = score(teachers["tinyllama"], ["x"])
    bos = load_tokenizer("tinyllama").bos_id
    assert ids[0][0] == bos and len(ids[0]) >= 2
    assert np.isnan(losses[0][0]) and np.isfinite(losses[0][1])
    # Without BOS a one-token document has nothing to predict it: all NaN.
    _, ids, losses = score(teachers["smollm2"], ["x"])
    assert len(ids[0]) == 1 and np.isnan(losses[0]).all()


@pytest.mark.parametrize("name", ["tinyllama", "smollm2"])
def test_long_documents_are_scored_in_windows_like_the_reference(teachers, name):
    scorer, ids, losses = score(teachers[name], TEXTS, max_length=16, stride=6, batch_tokens=64)
    model = load_model(teachers[name])
    assert max(len(i) for i in ids) > 5 * 16
    for doc_ids, loss in zip(ids, losses, strict=True):
        if len(doc_ids) > 1:
            expected = windowed_direct_losses(model, doc_ids, 16, 6)
            np.testing.assert_allclose(loss, expected, atol=1e-4, rtol=0)


def test_same_input_gives_bit_identical_losses(teachers):
    _, _, first = score(teachers["smollm2"], TEXTS, max_length=32, stride=16)
    _, _, second = score(teachers["smollm2"], TEXTS, max_length=32, stride=16)
    for a, b in zip(first, second, strict=True):
        assert a.tobytes() == b.tobytes()


def test_a_soft_capped_head_falls_back_to_the_models_forward(teachers):
    scorer, ids, losses = score(teachers["gemma2"], TEXTS[:2])
    assert not scorer.resolved.plain_head
    model = load_model(teachers["gemma2"])
    for doc_ids, loss in zip(ids, losses, strict=True):
        np.testing.assert_allclose(loss, direct_losses(model, doc_ids), atol=1e-4, rtol=0)


def test_dtype_checkpoint_loads_the_weights_as_saved_and_a_named_dtype_casts(tmp_path):
    """--dtype checkpoint keeps the dtype the checkpoint was saved in (what --dtype auto meant
    before auto followed the workers' device); a named dtype casts to it."""
    import torch

    from pipeline.scoring.teacher import load_teacher_model

    folder = make_tiny_teacher(tmp_path / "teacher", "smollm2")
    model = load_model(folder).to(torch.bfloat16)
    model.save_pretrained(folder)
    source = resolve_teacher(str(folder))
    assert load_teacher_model(source, "checkpoint", "cpu").dtype == torch.bfloat16
    assert load_teacher_model(source, "float32", "cpu").dtype == torch.float32
