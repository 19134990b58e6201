"""`--head-kernel triton` (pipeline/scoring/triton_head.py) in Triton's interpreter, the kernel's
only form on a CPU. Run by tests/test_stage1_triton_head.py in a process of its own, started with
TRITON_INTERPRET=1 (it must be set before triton is first imported); not collected otherwise.

What a user relies on: the kernel's columns are those of an fp32 product of the same head (plain
log-softmax), for every shape its blocks and masks handle; a scorer with it caches what the plain
one caches, and so does the stage-1 job, which records it; and it is refused in one line where its
columns would not be the teacher's."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.cache.verify import verify_cache
from pipeline.errors import ConfigError
from pipeline.scoring import hf, triton_head
from pipeline.scoring.head import TINY, exact_columns
from pipeline.scoring.teacher import resolve_teacher
from pipeline.scoring.triton_head import triton_head_columns
from stage1_score.run import main
from tests.stage1_helpers import (
    assert_within_one_float16_step,
    columns_of,
    make_tiny_teacher,
    shipped_documents,
    write_jsonl_corpus,
)

assert triton_head.INTERPRETED, "run with TRITON_INTERPRET=1 (tests/test_stage1_triton_head.py)"


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    return {name: make_tiny_teacher(root / name, name) for name in ("smollm2", "tinyllama")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "positions, vocab, width",
    [
        (300, 70_000, 100),  # two blocks of positions, nine spans (the last short), a ragged width
        (5, 1000, 128),  # one partial block and tile; a width the blocks tile (no mask along it)
        (600, 10_000, 32),  # three blocks: a group of two, then a group of one; two spans
        (0, 1000, 64),  # an empty batch
    ],
)
def test_the_kernel_gives_an_fp32_products_columns(dtype, positions, vocab, width):
    generator = torch.Generator().manual_seed(positions + vocab)
    hidden = torch.randn(positions, width, generator=generator).to(dtype)
    weight = (torch.randn(vocab, width, generator=generator) * 4 / width**0.5).to(dtype)
    targets = torch.randint(0, vocab, (positions,), generator=generator)
    space = (torch.rand(vocab, generator=generator) < 0.3).to(torch.int8)
    for bias in (None, torch.randn(vocab, generator=generator).to(dtype)):
        for mask in (None, space):
            ours = triton_head_columns(hidden, weight, bias, targets, mask)
            exact = exact_columns(hidden, weight, bias, targets, mask)
            assert ours.keys() == exact.keys()
            for name, value in exact.items():
                # a bf16 product is exact in fp32: only the order of the sums differs
                torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=5e-5)


def test_the_space_column_has_the_others_floor():
    """No space mass (an empty mask), or one far below fp32's smallest normal, reads as that
    bound, log(1.18e-38) = -87.34, as the plain and fused kernels store it."""
    width, vocab = 16, 300
    weight = torch.zeros(vocab, width)
    weight[:, 0] = -300.0  # every id 300 nats below the one favoured id
    weight[7, 0] = 0.0
    hidden = torch.zeros(2, width)
    hidden[:, 0] = 1.0
    targets = torch.tensor([7, 3])
    only_far = torch.zeros(vocab, dtype=torch.int8)
    only_far[3] = 1
    for mask in (torch.zeros(vocab, dtype=torch.int8), only_far):
        column = triton_head_columns(hidden, weight, None, targets, mask)["space_logprob"]
        torch.testing.assert_close(column, torch.full((2,), float(np.log(TINY))))


@pytest.mark.parametrize("name", ["smollm2", "tinyllama"])  # byte-level, SentencePiece
def test_the_triton_head_caches_what_the_plain_one_does(teachers, name):
    scorer, ours = columns_of(teachers[name], topk=0, head_kernel="triton")
    _, plain = columns_of(teachers[name], topk=0, head_kernel="plain")
    assert scorer.describe()["head_kernel"] == "triton"
    assert ours.keys() == plain.keys() == {"loss", "space_logprob"}
    for column in ("loss", "space_logprob"):
        assert_within_one_float16_step(ours[column], plain[column], column)
        np.testing.assert_allclose(ours[column], plain[column], rtol=1e-5, atol=2e-6)


def test_triton_is_refused_in_one_line_where_its_columns_would_not_be_the_teachers(
    teachers, tmp_path, monkeypatch
):
    settings = dict(dtype="float32", max_length=16, stride=6, batch_tokens=64, device="cpu")
    with pytest.raises(ConfigError, match=r"^--head-kernel triton computes the loss and the space "
                       r"column, not top-k: use --head-kernel fused with --topk-probs$"):  # fmt: skip
        columns_of(teachers["smollm2"], topk=8, head_kernel="triton")
    capped = resolve_teacher(str(make_tiny_teacher(tmp_path / "gemma2", "smollm2", arch="gemma2")))
    with pytest.raises(ConfigError, match=r"^--head-kernel triton: this teacher's logits are not "
                       r"its head applied .*; use --head-kernel fused$"):  # fmt: skip
        hf.HFScorer(capped, head_kernel="triton", **settings)
    # the load probe catches a kernel whose columns are wrong (planted: one nat off) ...
    columns = triton_head.triton_head_columns
    monkeypatch.setattr(
        triton_head, "triton_head_columns",
        lambda *args: {name: value + 1 for name, value in columns(*args).items()},
    )  # fmt: skip
    teacher = resolve_teacher(str(teachers["smollm2"]))
    with pytest.raises(ConfigError, match=r"^--head-kernel triton: on a probe its columns differ "
                       r"from an fp32 product's by 1 \(more than 0.01\); use --head-kernel fused$"):  # fmt: skip
        hf.HFScorer(teacher, head_kernel="triton", **settings)

    # ... or NaN for one kind of batch only (planted: the one-position launch, compiled apart)
    monkeypatch.setattr(
        triton_head, "triton_head_columns",
        lambda *args: {name: value if len(value) > 1 else value * float("nan")
                       for name, value in columns(*args).items()},
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"^--head-kernel triton: on a probe its columns differ "
                       r"from an fp32 product's by nan "):  # fmt: skip
        hf.HFScorer(teacher, head_kernel="triton", **settings)

    # ... and one that fails to build or run (planted: a compiler's error)
    def failing(*args):
        raise RuntimeError("PassManager::run failed\nmore detail")

    monkeypatch.setattr(triton_head, "triton_head_columns", failing)
    with pytest.raises(ConfigError, match=r"^--head-kernel triton: the kernel failed on a probe "
                       r"\(RuntimeError: PassManager::run failed\); use --head-kernel fused$"):  # fmt: skip
        hf.HFScorer(teacher, head_kernel="triton", **settings)


def test_the_stage1_job_caches_with_it_what_plain_caches_and_records_it(teachers, tmp_path):
    """Through the real job (a local Ray, whose workers inherit TRITON_INTERPRET=1): the cache
    verifies, `stage1-run.json` records the kernel, and every stored loss and space column is the
    plain run's within one float16 step."""
    ray = pytest.importorskip("ray")
    corpus = write_jsonl_corpus(tmp_path / "docs.jsonl", shipped_documents(12))
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        caches = {}
        for kernel in ("triton", "plain"):
            caches[kernel] = out = tmp_path / kernel
            assert main([
                "--teacher", str(teachers["smollm2"]), "--corpus", str(corpus), "--out", str(out),
                "--id-column", "id", "--docs-per-shard", "6", "--max-length", "64",
                "--stride", "24", "--space-logprob", "--head-kernel", kernel,
            ]) == 0  # fmt: skip
            assert verify_cache(out)[1] == []
            backend = json.loads((out / "stage1-run.json").read_text())["backend"]
            assert backend["head_kernel"] == kernel
    finally:
        ray.shutdown()
    tables = {k: pq.read_table(sorted(out.glob("*.parquet"))) for k, out in caches.items()}
    assert tables["triton"]["doc_id"] == tables["plain"]["doc_id"]
    for column in ("loss", "space_logprob"):
        ours, plain = (
            np.concatenate([np.asarray(v, np.float32) for v in tables[k][column].to_pylist()])
            for k in ("triton", "plain")
        )
        assert len(ours) > 1000
        assert_within_one_float16_step(ours, plain, column)
