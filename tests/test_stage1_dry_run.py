"""Stage 1's --dry-run (stage1_score/dry_run.py): the plan of a real tiny teacher on a real corpus,
printed without Ray, the teacher's weights or --out."""

from __future__ import annotations

import re
import sys

import pytest

from pipeline.cache.settings import CacheSettings
from pipeline.tokenizer import load_tokenizer
from stage1_score.dry_run import token_bytes
from stage1_score.run import main
from tests.stage1_helpers import make_tiny_teacher, shipped_documents, write_jsonl_corpus

DOCUMENTS = 23


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return make_tiny_teacher(tmp_path_factory.mktemp("teacher") / "tiny-llama", "tinyllama")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    documents = shipped_documents(DOCUMENTS)
    return write_jsonl_corpus(tmp_path_factory.mktemp("corpus") / "c.jsonl", documents)


def plan_of(capsys, teacher, corpus, out, *extra) -> dict[str, str]:
    argv = ["--teacher", str(teacher), "--corpus", str(corpus), "--out", str(out),
            "--id-column", "id", "--docs-per-shard", "10", "--max-length", "64", "--dry-run",
            *extra]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "[stage1.corpus]" in printed and 'id_column = "id"' in printed
    plan = printed.split("# the plan\n")[1]
    return dict(line.split(": ", 1) for line in plan.splitlines())


def test_the_dry_run_counts_documents_and_units_writing_nothing(capsys, teacher, corpus, tmp_path):
    out = tmp_path / "cache"
    plan = plan_of(capsys, teacher, corpus, out)
    assert plan["documents"].startswith(f"{DOCUMENTS} (")
    assert plan["units"].startswith("3 of up to 10 documents")
    assert not out.exists()
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    assert "dtype auto -> float32" in plan["auto switches"]  # this machine has no GPU
    # every document is in the sample, so the estimate is the count the workers would store:
    # the teacher's tokenizer, BOS and all
    tokenizer = load_tokenizer("tinyllama")
    texts = [text for _, text in shipped_documents(DOCUMENTS)]
    tokens = sum(len(e) for e in tokenizer.encode_batch(texts))
    assert re.match(rf"about {tokens:,} ", plan["teacher tokens"])

    sliced = plan_of(capsys, teacher, corpus, out, "--max-docs", "7")
    assert sliced["documents"].startswith("7 (") and sliced["units"].startswith("1 of")
    assert "its first 7 records" in sliced["corpus"]
    assert not out.exists()


def test_a_token_takes_the_bytes_of_the_schemas_per_token_columns():
    # token_ids, token_start, token_end (int32) and the loss
    assert token_bytes(CacheSettings(loss_dtype="float16"), "float16") == 4 + 4 + 4 + 2
    # compact top-8 with uint16 ids: 9 bytes of codes, 8 x 2 of id ranks, a float16 rest
    topk = CacheSettings(topk_probs=8, topk_id_dtype="uint16", topk_encoding="compact")
    assert token_bytes(topk, "float32") == 4 + 4 + 4 + 4 + 9 + 16 + 2
    # as float16: 8 probabilities and 8 ids of 2 bytes each
    assert token_bytes(CacheSettings(topk_probs=8, topk_id_dtype="uint16"), "float16") == 14 + 34


def test_print_config_lists_each_option_with_its_source(capsys, teacher, corpus, tmp_path):
    argv = ["--teacher", str(teacher), "--corpus", str(corpus), "--out", str(tmp_path / "c"),
            "--max-docs", "7", "--print-config"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert re.search(r"^max_docs = 7 +# flag$", printed, re.M)
    assert re.search(r"^docs_per_shard = 1000 +# default$", printed, re.M)
    assert "# the plan" not in printed and not (tmp_path / "c").exists()
