"""A schedule longer than its cache says so at the start and logs the step each new pass over the
cache begins (issue 78, item 4): the stream loops silently otherwise."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipeline.cache.manifest import load_manifest
from pipeline.cache.schema import TEXT, iter_shard_batches
from pipeline.tokenizer import load_tokenizer
from stage2_train.train import main
from tests.cache_fixtures import build_cache
from tests.stage2_runs import train_args


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cache")
    build_cache(path, teacher_tokenizer="qwen2.5", num_documents=8, docs_per_shard=4)
    return path


def cache_student_tokens(cache: Path) -> int:
    """Every document of the cache re-tokenized by the student, as the stream does."""
    tokenizer = load_tokenizer("tinyllama")
    texts = [
        text
        for shard in load_manifest(cache).shards
        for batch in iter_shard_batches(cache / shard.file, [TEXT])
        for text in batch.column(TEXT).to_pylist()
    ]
    return int(tokenizer.encode_concatenated(texts, add_eos=True).lengths.sum())


def test_a_schedule_past_the_cache_says_how_many_epochs_and_logs_each_boundary(
    cache, tmp_path, capfd
):
    out = tmp_path / "out"
    steps, batch_tokens = 24, 128
    argv = train_args(cache, out, "--num-workers", "0", "--max-steps", str(steps),
                      "--record-documents")  # fmt: skip
    assert main(argv) == 0
    err = capfd.readouterr().err

    said = re.search(r"the schedule reads ([\d,]+) tokens, about ([\d.]+) epochs of the cache "
                     r"\(~([\d,]+) student tokens", err)  # fmt: skip
    assert said, err
    assert int(said[1].replace(",", "")) == steps * batch_tokens
    estimate = int(said[3].replace(",", ""))
    exact = cache_student_tokens(cache)
    assert abs(estimate - exact) <= 0.2 * exact  # the ratio is sampled from the first shard
    assert float(said[2]) > 1

    # each logged boundary is the first step whose documents come from that pass
    logged = {int(m[2]): int(m[1]) for m in re.finditer(r"step (\d+): the data stream began "
                                                          r"epoch (\d+) of the cache", err)}  # fmt: skip
    recorded = [json.loads(line) for line in (out / "documents" / "rank-0.jsonl").open()]
    first_step = {}
    for record in recorded:
        for epoch, _ in record["documents"]:
            first_step.setdefault(epoch + 1, record["step"])
    assert 2 in logged, err
    assert logged == {epoch: step for epoch, step in first_step.items() if epoch > 1}


def test_a_schedule_within_the_cache_says_it_reads_less_than_one_epoch(cache, tmp_path, capfd):
    assert main(train_args(cache, tmp_path / "out", "--num-workers", "0", "--max-steps", "2")) == 0
    err = capfd.readouterr().err
    said = re.search(r"about ([\d.]+) epochs of the cache", err)
    assert said and float(said[1]) < 1, err
    assert "began epoch" not in err
