"""Stage 2's held-out evaluation: it measures what `vocagno eval` measures, refuses held-out
documents the cache trains on, and gives the same values on 1 and 2 torchrun ranks (gloo)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from apps.evaluation.bits_per_character import bits_per_character
from pipeline.errors import ConfigError
from pipeline.scoring.hf import HFScorer
from pipeline.scoring.resolve import Asked
from pipeline.scoring.teacher import resolve_teacher
from pipeline.tokenizer import load_tokenizer
from stage2_train.data.heldout import check_unseen, read_heldout
from stage2_train.distributed import Runtime
from stage2_train.evaluation import evaluate
from tests.cache_fixtures import build_cache, corpus_documents
from tests.stage1_helpers import make_tiny_teacher, shipped_documents, write_jsonl_corpus

RANKS = Path(__file__).resolve().parent / "evaluate_on_ranks.py"
SHORT = ["Question: 3 + 4?\nAnswer: 7", "Ünïcode ✓ 12,5 and\ttabs  here.", "x", "A short one."]
ONE_RANK = Runtime(0, 0, 1, torch.device("cpu"))


def single(found):
    return [found]


# BOS / no BOS (EOS prefix); each loss kernel
@pytest.mark.parametrize(
    ("tokenizer_name", "loss_kernel"), [("tinyllama", "plain"), ("smollm2", "chunked")]
)
def test_held_out_bits_per_character_are_vocagno_evals(tmp_path, tokenizer_name, loss_kernel):
    """The same documents and context give the number `vocagno eval --max-length` gives: windows
    of 48 tokens over documents of ~200-350 tokens, and short ones packed several to a row."""
    folder = make_tiny_teacher(tmp_path / "m", tokenizer_name)
    tokenizer = load_tokenizer(str(folder))
    documents = [*shipped_documents(2), *enumerate(SHORT)]
    corpus = write_jsonl_corpus(tmp_path / "heldout.jsonl", documents)
    heldout = read_heldout(str(corpus), len(documents), tokenizer, seq_len=48, rows=3)
    assert any((b["segment_ids"].amax(dim=1) > 1).any() for b in heldout.batches)  # packed
    model = AutoModelForCausalLM.from_pretrained(folder).train()
    result = evaluate(model, heldout, ONE_RANK, contextlib.nullcontext, loss_kernel)
    assert model.training  # back in train mode

    scorer = HFScorer(
        resolve_teacher(str(folder)),
        asked=Asked("float32"),
        max_length=48,
        stride=24,
        batch_tokens=256,
    ).load()
    reference = bits_per_character(scorer, tokenizer, [t for _, t in documents])
    assert heldout.characters == reference.characters
    assert heldout.tokens == reference.tokens
    assert result.bits_per_char == pytest.approx(reference.bits_per_character, rel=1e-5)
    assert result.loss == pytest.approx(
        reference.bits_per_token * torch.log(torch.tensor(2.0)).item(), rel=1e-5
    )


def test_held_out_documents_the_cache_trains_on_are_refused_in_one_line(tmp_path):
    cache = tmp_path / "cache"
    manifest = build_cache(cache, documents=corpus_documents(6), docs_per_shard=3)
    tokenizer = load_tokenizer("tinyllama")
    unseen = write_jsonl_corpus(tmp_path / "unseen.jsonl", corpus_documents(3, skip=6))
    heldout = read_heldout(str(unseen), 3, tokenizer, seq_len=32, rows=2)
    check_unseen(heldout, cache, manifest.shards, 0, 1, single)  # passes

    # the fifth training document (second shard, row 1) as the third held-out one
    overlapping = [*corpus_documents(2, skip=6), corpus_documents(6)[4]]
    corpus = write_jsonl_corpus(tmp_path / "overlap.jsonl", overlapping)
    heldout = read_heldout(str(corpus), 3, tokenizer, seq_len=32, rows=2)
    with pytest.raises(ConfigError) as refused:
        check_unseen(heldout, cache, manifest.shards, 0, 1, single)
    message = str(refused.value)
    assert "\n" not in message
    assert (
        "'overlap.jsonl:2'" in message
        and f"row 1 of the cache's {manifest.shards[1].file}" in message
    )
    # split over two ranks, the rank that reads the shard finds it
    finds = []
    for rank in (0, 1):
        with contextlib.suppress(ConfigError):
            check_unseen(heldout, cache, manifest.shards, rank, 2, lambda f: finds.append(f) or [f])
    assert finds[0] is None and finds[1][2] == 1


def test_held_out_data_without_documents_is_refused(tmp_path):
    corpus = tmp_path / "h.jsonl"
    corpus.write_text("")
    with pytest.raises(ConfigError, match="no token of its 0 document"):
        read_heldout(str(corpus), 5, load_tokenizer("qwen2.5"), seq_len=32, rows=2)


def torchrun(script: Path, nproc: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(nproc), str(script), *args],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def finish(process: subprocess.Popen) -> None:
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-4000:]


@pytest.mark.slow
def test_the_evaluation_is_the_same_to_the_bit_on_1_and_2_ranks(tmp_path):
    """Real torchrun (gloo): 1 rank, 2 ranks under DDP and 2 under FSDP give one value; 5 batches,
    so that on 2 ranks one rank runs batch 0 again in the last round and discards it."""
    corpus = write_jsonl_corpus(tmp_path / "heldout.jsonl", shipped_documents(12))
    launches = {"1": (1,), "ddp": (2,), "fsdp": (2, "--fsdp")}
    processes = {
        name: torchrun(RANKS, nproc, str(corpus), "12", "64", "4", str(tmp_path / name), *flags)
        for name, (nproc, *flags) in launches.items()
    }
    for process in processes.values():
        finish(process)
    results = {name: json.loads((tmp_path / name).read_text()) for name in launches}
    assert results["1"]["batches"] % 2 == 1
    assert results["ddp"] == results["1"]
    assert results["fsdp"] == results["1"]
