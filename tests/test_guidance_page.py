"""vocagno cache inspect: the page shows exactly the selection stage 2 would make."""

from __future__ import annotations

import re

import numpy as np
import pytest

from apps.cli import main
from pipeline.guidance import selection_size
from tests.cache_fixtures import build_cache, read_cache_rows
from tests.stage1_helpers import make_tiny_teacher


@pytest.fixture(scope="module")
def cache_and_student(tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect")
    build_cache(root / "cache", teacher_tokenizer="qwen2.5", num_documents=6, docs_per_shard=3)
    student = make_tiny_teacher(root / "student", "tinyllama")  # any causal LM serves as student
    return root / "cache", student


def _spans(page: str) -> list[tuple[str, str]]:
    return re.findall(r'<span class="(kept|dropped|context)"[^>]*title="([^"]*)"', page)


def test_page_marks_the_top_k_of_mapped_tokens_plus_every_unmapped(cache_and_student, tmp_path):
    cache, student = cache_and_student
    doc_id = sorted(read_cache_rows(cache))[4]
    out = tmp_path / "page.html"
    args = ["cache", "inspect", str(cache), "--student", str(student), "--doc-id", doc_id]
    assert main([*args, "--out", str(out)]) == 0
    page = out.read_text()
    assert doc_id in page
    spans = _spans(page)
    states = np.array([state for state, _ in spans])
    mapped = np.array(["teacher nan" not in tip for _, tip in spans])
    trained = states != "context"
    assert states[0] == "context"  # BOS: nothing predicts it
    kept = (states == "kept").sum()
    # include: all unmapped trained tokens, plus ceil(0.4 x mapped) of the mapped ones.
    expected = selection_size(int((mapped & trained).sum()), 0.4) + int((~mapped & trained).sum())
    assert kept == expected
    # Kept mapped tokens have the highest excess loss among the mapped ones.
    excess = np.array([float(re.search(r"excess (\S+);", t).group(1)) for _, t in spans])
    kept_mapped = excess[(states == "kept") & mapped]
    dropped = excess[(states == "dropped") & mapped]
    assert kept_mapped.min() >= dropped.max()


def test_unknown_document_is_one_clear_error(cache_and_student, tmp_path, capsys):
    cache, student = cache_and_student
    args = ["cache", "inspect", str(cache), "--student", str(student), "--doc-id", "nope"]
    assert main([*args, "--out", str(tmp_path / "x.html")]) == 2
    assert "'nope' is not in" in capsys.readouterr().err
