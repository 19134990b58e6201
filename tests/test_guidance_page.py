"""vocagno cache inspect: the page shows exactly the selection stage 2 would make."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from apps.cli import main
from pipeline.tokenizer import load_tokenizer
from tests.cache_fixtures import build_cache, read_cache_rows
from tests.stage1_helpers import make_tiny_teacher
from tests.test_stage2_data import overlap_oracle


@pytest.fixture(scope="module")
def cache_and_student(tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect")
    build_cache(root / "cache", teacher_tokenizer="qwen2.5", num_documents=6, docs_per_shard=3)
    student = make_tiny_teacher(root / "student", "tinyllama")  # any causal LM serves as student
    return root / "cache", student


def _spans(page: str) -> list[tuple[str, str]]:
    return re.findall(r'<span class="(kept|dropped|context)"[^>]*title="([^"]*)"', page)


def student_losses(model_folder: Path, ids: np.ndarray) -> np.ndarray:
    """-log P(x_t | x_<t) of one plain forward pass; NaN at the first token, which nothing
    predicts."""
    model = AutoModelForCausalLM.from_pretrained(model_folder).eval()
    ids = torch.as_tensor(ids, dtype=torch.long)
    with torch.inference_mode():
        logits = model(input_ids=ids[None]).logits[0].double()
    loss = torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="none")
    return np.concatenate(([np.nan], loss.numpy()))


def test_page_marks_the_top_k_of_mapped_tokens_plus_every_unmapped(cache_and_student, tmp_path):
    """The page's kept tokens are, by definition (paper eq. 3-4, the defaults: top 40%, unmapped
    included): every trained token without a teacher loss, plus the ceil(0.4 m) of the m with one
    that have the highest excess loss; here computed from an independent student forward and the
    overlap oracle's teacher losses (max over the teacher tokens sharing a character)."""
    cache, student = cache_and_student
    rows = read_cache_rows(cache)
    doc_id = sorted(rows)[4]
    row = rows[doc_id]
    out = tmp_path / "page.html"
    args = ["cache", "inspect", str(cache), "--student", str(student), "--doc-id", doc_id]
    assert main([*args, "--out", str(out)]) == 0
    page = out.read_text()
    assert doc_id in page

    encoding = load_tokenizer(str(student)).encode(row["text"], add_eos=True)
    teacher = overlap_oracle(encoding, row, "max")
    excess = student_losses(student, encoding.ids) - teacher
    trained = np.arange(len(encoding)) > 0  # BOS is context: nothing predicts it
    mapped = trained & ~np.isnan(teacher)
    ranked = np.flatnonzero(mapped)[np.argsort(-excess[mapped], kind="stable")]
    top = math.ceil(round(0.4 * mapped.sum(), 9))
    # Two kernels' rounding (float32 in the product) could swap near-tied tokens, so the last
    # kept and the first dropped must differ by far more than that for the sets to be exact.
    assert excess[ranked[top - 1]] - excess[ranked[top]] > 1e-3
    expected_kept = np.zeros(len(encoding), dtype=bool)
    expected_kept[ranked[:top]] = True
    expected_kept |= trained & ~mapped
    assert (trained & ~mapped).any() and 0 < top < mapped.sum()  # both rules are exercised

    spans = _spans(page)
    assert len(spans) == len(encoding)  # one span per student token, in order
    states = np.array([state for state, _ in spans])
    np.testing.assert_array_equal(states == "kept", expected_kept)
    np.testing.assert_array_equal(states == "context", ~trained)
    shown = np.array([float(re.search(r"excess (\S+);", tip).group(1)) for _, tip in spans])
    np.testing.assert_allclose(shown[mapped], excess[mapped], atol=0.006)  # printed as %.2f


def test_unknown_document_is_one_clear_error(cache_and_student, tmp_path, capsys):
    cache, student = cache_and_student
    args = ["cache", "inspect", str(cache), "--student", str(student), "--doc-id", "nope"]
    assert main([*args, "--out", str(tmp_path / "x.html")]) == 2
    assert "'nope' is not in" in capsys.readouterr().err


def test_an_out_that_is_a_folder_is_one_line_naming_it(cache_and_student, tmp_path, capsys):
    cache, student = cache_and_student
    folder = tmp_path / "existing"
    folder.mkdir()
    args = ["cache", "inspect", str(cache), "--student", str(student), "--out", str(folder)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"vocagno cache: error: --out {folder} is a folder; give the HTML file to write"]
    assert list(folder.iterdir()) == []  # no temporary left behind
