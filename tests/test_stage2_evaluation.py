"""Stage 2's held-out evaluation (--eval-every): it measures what `vocagno eval` measures, refuses
held-out documents the cache trains on, gives the same values on 1 and 2 torchrun ranks (gloo),
logs at the same steps with the same values after a resume, and leaves training as it was."""

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
from stage2_train.train import main
from tests.cache_fixtures import build_cache, corpus_documents
from tests.stage1_helpers import make_tiny_teacher, shipped_documents, write_jsonl_corpus
from tests.stage2_runs import read_metrics, train_args

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


EVAL_FIELDS = ("eval_loss", "eval_bits_per_char")


def eval_records(out: Path) -> dict[int, tuple]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: tuple(r[f] for f in EVAL_FIELDS) for r in records if "eval_loss" in r}


EVALUATED = ("--eval-every", "4", "--eval-docs", "5")


@pytest.fixture(scope="module")
def heldout_run(tmp_path_factory) -> dict:
    """6 steps evaluated every 4, so at 4 and at the last, 6."""
    root = tmp_path_factory.mktemp("eval-runs")
    cache = root / "cache"
    build_cache(cache, documents=corpus_documents(8), docs_per_shard=4)
    corpus = write_jsonl_corpus(root / "heldout.jsonl", corpus_documents(6, skip=8))
    run = {"cache": cache, "args": (*EVALUATED, "--eval-data", str(corpus)), "out": root / "whole"}
    assert main(train_args(cache, run["out"], *run["args"])) == 0
    return run


def test_the_held_out_figures_reach_metrics_and_tensorboard(heldout_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    whole = eval_records(heldout_run["out"])
    assert sorted(whole) == [4, 6]
    assert all(0 < loss < 20 and 0 < bits < 20 for loss, bits in whole.values())
    events = EventAccumulator(str(heldout_run["out"] / "tensorboard"))
    events.Reload()
    for index, tag in enumerate(("eval/loss", "eval/bits_per_char")):
        logged = {e.step: e.value for e in events.Scalars(tag)}
        assert logged == pytest.approx({step: values[index] for step, values in whole.items()})


@pytest.mark.slow
def test_a_resumed_run_evaluates_at_the_same_steps_with_the_same_values(heldout_run, tmp_path):
    out = tmp_path / "parts"
    assert (
        main(train_args(heldout_run["cache"], out, *heldout_run["args"], "--stop-at-step", "5"))
        == 0
    )
    assert sorted(eval_records(out)) == [4]
    assert main(train_args(heldout_run["cache"], out, *heldout_run["args"])) == 0
    assert eval_records(out) == eval_records(heldout_run["out"])  # floats compared exactly


@pytest.mark.slow
def test_evaluating_leaves_training_as_it_was(heldout_run, tmp_path):
    plain = tmp_path / "plain"
    assert main(train_args(heldout_run["cache"], plain)) == 0
    assert read_metrics(heldout_run["out"]) == read_metrics(plain)
    assert (heldout_run["out"] / "final" / "model.safetensors").read_bytes() == (
        plain / "final" / "model.safetensors"
    ).read_bytes()


def test_a_run_whose_held_out_documents_are_trained_on_is_refused_before_it_writes(
    heldout_run, tmp_path, capsys
):
    trained = write_jsonl_corpus(tmp_path / "trained.jsonl", corpus_documents(2, skip=3))
    out = tmp_path / "out"
    args = ("--eval-every", "2", "--eval-data", str(trained))
    assert main(train_args(heldout_run["cache"], out, *args)) == 2
    err = capsys.readouterr().err.strip()
    assert "held-out document 'trained.jsonl:0' is trained on" in err and "\n" not in err
    assert not out.exists()
    assert main(train_args(heldout_run["cache"], out, "--eval-every", "2")) == 2
    assert "--eval-every N and --eval-data" in capsys.readouterr().err
