"""`--head-kernel onepass` (pipeline/scoring/triton_head.py) in Triton's interpreter, its
kernel's only form on a CPU. Run by tests/test_stage1_triton_head.py in a process of its own,
started with TRITON_INTERPRET=1 (it must be set before triton is first imported); not collected
otherwise.

What a user relies on: onepass's columns are those of the plain kernel on the same logits, for
every shape its blocks and masks handle; a scorer with it caches what the plain one caches, and
so does the stage-1 job, which records it; and it is refused in one line where its columns would
not be the teacher's."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.cache.verify import verify_cache
from pipeline.errors import ConfigError
from pipeline.scoring import hf, triton_head
from pipeline.scoring.head import head_kernel_function
from pipeline.scoring.head_kernels import TINY, TOPK_BLOCK
from pipeline.scoring.resolve import Asked
from pipeline.scoring.switches import HeadSwitches
from pipeline.scoring.teacher import resolve_teacher
from stage1_score.run import main
from tests.stage1_helpers import (
    assert_same_topk_ids_but_ties,
    assert_within_one_float16_step,
    columns_of,
    make_tiny_teacher,
    shipped_documents,
    write_jsonl_corpus,
)

assert triton_head.INTERPRETED, "run with TRITON_INTERPRET=1 (tests/test_stage1_triton_head.py)"
# The scorer tests' teachers: byte-level, and SentencePiece (slow: it changes only the space mask's
# ids, which the kernels read as any mask)
SCORER_TEACHERS = ["smollm2", pytest.param("tinyllama", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    return {name: make_tiny_teacher(root / name, name) for name in ("smollm2", "tinyllama")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows, vocab",
    [
        (7, 150_000),  # three of the interpreter's row blocks, the last short
        (3, 1000),  # one partial block
        (0, 1000),  # an empty chunk
    ],
)
def test_onepass_gives_the_plain_kernels_columns_on_the_same_logits(dtype, rows, vocab):
    """Each logit read once, the max and the sums together: the plain kernel's loss, top-k and
    space column of the same logits (as fused reads them: in their own dtype, and here rows
    strided apart, as a slice of a wider chunk is), computed in float64. Against plain's fp32 the
    difference would be plain's own rounding: at 150k logits of this spread its loss is 3.3e-5
    from float64's, onepass's 1.2e-6."""
    generator = torch.Generator().manual_seed(rows + vocab)
    wider = (torch.randn(rows, vocab + 3, generator=generator) * 4).to(dtype)
    logits = wider[:, 1 : vocab + 1]
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    space = torch.rand(vocab, generator=generator) < 0.3
    onepass = head_kernel_function("onepass", torch.device("cpu"))
    for topk in (0, 8):
        for mask in (None, space):
            ours = onepass(logits, targets, topk, None if mask is None else mask.to(torch.int8))
            exact = plain_in_float64(logits, targets, topk, mask)
            assert ours.keys() == exact.keys()
            for name, value in exact.items():
                if name == "topk_ids":  # equal logits (bf16 ties) to the lower id in both
                    assert torch.equal(ours[name], value)
                else:
                    torch.testing.assert_close(ours[name], value.float(), rtol=1e-5, atol=2e-6)


def test_the_exponentials_earlier_form_gives_the_same_columns():
    """bench_stage1_head.py times the row kernel's exponentials as runs 7-15 measured them (natural,
    not in base 2) beside today's, so that a GPU run says what the change is worth: both forms
    give the float64 columns of the same logits, the block maxima included."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(7, 150_000, generator=generator) * 4
    targets = torch.randint(0, 150_000, (7,), generator=generator)
    space = torch.rand(150_000, generator=generator) < 0.3
    exact = plain_in_float64(logits, targets, 0, space)
    maxima = {}
    for natural_exp in (False, True):
        maxima[natural_exp] = torch.empty(7, 150_000 // TOPK_BLOCK)
        ours, _ = triton_head.logit_row_sums(logits, targets, space.to(torch.int8),
                                             maxima[natural_exp], natural_exp)  # fmt: skip
        assert ours.keys() == exact.keys()
        for name, value in exact.items():
            torch.testing.assert_close(ours[name], value.float(), rtol=1e-5, atol=2e-6)
    assert torch.equal(maxima[False], maxima[True])


@pytest.mark.slow  # a benchmark's rows; the kernels' columns are tested above
def test_the_head_bench_times_onepass_beside_its_earlier_exponentials(capsys):
    """Where onepass runs (CUDA; here, the interpreter), bench_stage1_head.py times it with the
    exponentials runs 7-15 measured beside today's, each row a time and a ratio, so that the next
    GPU run does not meet that path first."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_stage1_head

    assert bench_stage1_head.main(["--shape", "tiny", "--repeats", "1"]) == 0
    said = capsys.readouterr().out
    earlier = [label for label, _ in bench_stage1_head.NATURAL_EXP_ROWS]
    for label in ["onepass loss", "onepass +space", *earlier]:
        row = re.search(rf"^{re.escape(label)} +([\d.]+) +([\d.]+)$", said, re.M)
        assert row and float(row[1]) > 0 and float(row[2]) > 0, said


def plain_in_float64(logits, targets, topk, space):
    """plain_columns's definitions (pipeline.scoring.head_kernels), computed in float64."""
    log_probs = logits.double().log_softmax(dim=-1)
    columns = {"loss": -log_probs.gather(1, targets[:, None]).squeeze(1)}
    if topk:
        # ties to the lower id, as ranked_topk: float64 keeps distinct logits apart
        values, ids = (
            part[:, :topk] for part in log_probs.sort(dim=-1, descending=True, stable=True)
        )
        probs = values.exp()
        columns |= {"topk_probs": probs, "topk_ids": ids, "topk_rest": (1 - probs.sum(-1)).clamp(0)}
    if space is not None:
        columns["space_logprob"] = log_probs[:, space].logsumexp(-1).clamp(min=np.log(TINY))
    return columns


def test_onepass_has_the_space_columns_floor():
    logits = torch.zeros(2, 300)
    logits[:, 3] = -300.0
    only_far = torch.zeros(300, dtype=torch.int8)
    only_far[3] = 1
    onepass = head_kernel_function("onepass", torch.device("cpu"))
    for mask in (torch.zeros(300, dtype=torch.int8), only_far):
        column = onepass(logits, torch.tensor([7, 3]), 0, mask)["space_logprob"]
        torch.testing.assert_close(column, torch.full((2,), float(np.log(TINY))))


@pytest.mark.parametrize("name", SCORER_TEACHERS)
def test_onepass_caches_every_column_the_plain_head_does(teachers, name):
    scorer, ours = columns_of(teachers[name], head_kernel="onepass")
    _, plain = columns_of(teachers[name], head_kernel="plain")
    assert scorer.describe()["head_kernel"] == "onepass"
    assert ours.keys() == plain.keys() == {
        "loss", "topk_probs", "topk_ids", "topk_rest", "space_logprob"
    }  # fmt: skip
    for column in ("loss", "topk_probs", "topk_rest", "space_logprob"):
        assert_within_one_float16_step(ours[column], plain[column], column)
        np.testing.assert_allclose(ours[column], plain[column], rtol=1e-5, atol=2e-6)
    assert_same_topk_ids_but_ties(ours, plain)


def test_onepass_is_checked_at_load_against_the_plain_kernel(teachers, tmp_path, monkeypatch):
    """onepass reads the teacher's own logits, so a soft-capped teacher (Gemma 2) caches with it
    what plain caches; its kernel is probed at load (planted: one nat off, and a compiler's
    error)."""
    capped = make_tiny_teacher(tmp_path / "gemma2", "smollm2", arch="gemma2")
    _, ours = columns_of(capped, topk=0, head_kernel="onepass")
    _, plain = columns_of(capped, topk=0, head_kernel="plain")
    for column in ("loss", "space_logprob"):
        np.testing.assert_allclose(ours[column], plain[column], rtol=1e-5, atol=2e-6)
    settings = dict(max_length=16, stride=6, batch_tokens=64, device="cpu")
    onepass = Asked("float32", HeadSwitches(head_kernel="onepass"))
    teacher = resolve_teacher(str(teachers["smollm2"]))
    row_sums = triton_head.logit_row_sums

    def one_nat_off(*args):
        columns, log_z = row_sums(*args)
        return {name: value + 1 for name, value in columns.items()}, log_z

    monkeypatch.setattr(triton_head, "logit_row_sums", one_nat_off)
    with pytest.raises(ConfigError, match=r"^--head-kernel onepass: on a probe its columns "
                       r"differ from the plain kernel's by 1 \(more than 0.01\); use "
                       r"--head-kernel fused$"):  # fmt: skip
        hf.HFScorer(teacher, asked=onepass, **settings).load()

    def failing(*args):
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(triton_head, "logit_row_sums", failing)
    with pytest.raises(ConfigError, match=r"^--head-kernel onepass: the kernel failed on a probe"):
        hf.HFScorer(teacher, asked=onepass, **settings).load()


# slow: a Ray job whose workers load and check the kernels in the interpreter (68 s for onepass's
# on 2 cores); the scorer's columns with each kernel are tested above
@pytest.mark.slow
def test_the_stage1_job_caches_with_it_what_plain_caches_and_records_it(teachers, tmp_path):
    """Through the real job (a local Ray, whose workers inherit TRITON_INTERPRET=1), with
    onepass: the cache verifies, `stage1-run.json` records the kernel, and every stored loss
    and space column is the plain run's within one float16 step."""
    ray = pytest.importorskip("ray")
    corpus = write_jsonl_corpus(tmp_path / "docs.jsonl", shipped_documents(12))
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        for name in ("onepass", "plain"):
            out = tmp_path / name
            assert main([
                "--teacher", str(teachers["smollm2"]), "--corpus", str(corpus), "--out", str(out),
                "--id-column", "id", "--docs-per-shard", "6", "--max-length", "64",
                "--stride", "24", "--space-logprob", "--head-kernel", name,
            ]) == 0  # fmt: skip
            assert verify_cache(out)[1] == []
            backend = json.loads((out / "stage1-run.json").read_text())["backend"]
            assert backend["head_kernel"] == name
    finally:
        ray.shutdown()
    ours, plain = (
        pq.read_table(sorted((tmp_path / name).glob("*.parquet"))) for name in ("onepass", "plain")
    )
    assert ours["doc_id"] == plain["doc_id"]
    for column in ("loss", "space_logprob"):
        ours_values, plain_values = (
            np.concatenate([np.asarray(v, np.float32) for v in table[column].to_pylist()])
            for table in (ours, plain)
        )
        assert len(ours_values) > 1000
        assert_within_one_float16_step(ours_values, plain_values, column)
