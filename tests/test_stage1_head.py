"""Stage 1's head switches (pipeline/scoring/head.py, head_kernels.py, hf.py, docs/gpu-path.md):
`--head-kernel fused` caches what `plain` caches, every column within the cache's float16
storage, for a byte-level and a SentencePiece teacher; the compiled fused pass (a GPU's) equals
the eager one; `--head-chunks sized` takes its rows from free memory and changes no column; what
`auto` resolved to is recorded with the worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.scoring.head import LOGIT_BUDGET, head_chunk_rows
from pipeline.scoring.head_kernels import (
    TOPK_BLOCK,
    compiled_pass,
    fused_columns,
    plain_columns,
    ranked_topk,
    top_logits,
    topk_blocks,
    topk_columns,
)
from tests.stage1_helpers import (
    assert_same_topk_ids_but_ties,
    assert_within_one_float16_step,
    columns_of,
    make_tiny_teacher,
)


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    return {name: make_tiny_teacher(root / name, name) for name in ("smollm2", "tinyllama")}


@pytest.mark.parametrize("name", ["smollm2", "tinyllama"])  # byte-level, SentencePiece
def test_the_fused_head_caches_every_column_the_plain_one_does(teachers, name):
    plain_scorer, plain = columns_of(teachers[name], head_kernel="plain")
    fused_scorer, fused = columns_of(teachers[name], head_kernel="fused")
    assert plain_scorer.describe()["head_kernel"] == "plain"
    assert fused_scorer.describe()["head_kernel"] == "fused"
    assert fused.keys() == plain.keys() == {
        "loss", "topk_probs", "topk_ids", "topk_rest", "space_logprob"
    }  # fmt: skip
    for column in ("loss", "topk_probs", "topk_rest", "space_logprob"):
        assert_within_one_float16_step(fused[column], plain[column], column)
        # and before storage, the two arithmetics of one quantity differ by fp32 rounding only
        np.testing.assert_allclose(fused[column], plain[column], rtol=1e-5, atol=0)
    assert_same_topk_ids_but_ties(fused, plain)


# Slow (71 s of a cold compile in CI): the default run compiles the fused pass with its top-k and
# space columns in test_stage1_packing.py's compiled-layers test, against the eager pass, which the
# fused-against-plain test above checks; this adds bf16 logits and onepass's top-k
@pytest.mark.slow
def test_the_compiled_fused_pass_equals_the_eager_one_and_the_plain_one():
    """What a GPU runs (torch.compile of fused_columns, and of the top-k columns onepass takes
    beside its Triton kernel, from the block maxima the kernel wrote; the CPU compiles them too) against the eager pass and the plain
    log-softmax, in fp32 and from bf16 logits, on a chunk with a last row of its own size
    (dynamic shapes: no recompile per chunk); 5,000 logits a row, so that the top 8 are taken by
    blocks, with a partial last block."""
    generator = torch.Generator().manual_seed(0)
    space = torch.rand(5000, generator=generator) < 0.3
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (37, 5):
            logits = (torch.randn(rows, 5000, generator=generator) * 4).to(dtype)
            targets = torch.randint(0, 5000, (rows,), generator=generator)
            compiled = compiled_pass(fused_columns)(logits, targets, 8, space)
            eager = fused_columns(logits, targets, 8, space)
            log_z = torch.logsumexp(logits.float(), dim=-1)
            # the block maxima as onepass's kernel writes them: fp32, whole blocks only
            blocks = topk_blocks(5000, 8)
            maxima = logits[:, : blocks * TOPK_BLOCK].unflatten(1, (blocks, -1)).amax(-1).float()
            onepass_topk = compiled_pass(topk_columns)(logits, 8, log_z, maxima)
            plain = plain_columns(logits, targets, 8, space)
            for name, value in plain.items():
                for other in (compiled, eager) + ((onepass_topk,) if name in onepass_topk else ()):
                    if name == "topk_ids":  # ties to the lower id (`ranked_topk`), in each
                        assert torch.equal(other[name], first_of_a_stable_sort(logits, 8))
                    else:
                        torch.testing.assert_close(other[name], value, rtol=1e-5, atol=1e-5)
            # plain ranks the fp32 log-probabilities, which keep bf16 logits apart (fp32 logits a
            # rounding apart can meet there, and rank by index)
            if dtype == torch.bfloat16:
                assert torch.equal(plain["topk_ids"], first_of_a_stable_sort(logits, 8))
            else:
                assert torch.equal(
                    logits.gather(1, plain["topk_ids"]), logits.gather(1, eager["topk_ids"])
                )


def first_of_a_stable_sort(values: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of each row's first k in a stable descending sort: equal values by index."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]


def tied_logits(vocabulary: int, dtype: torch.dtype) -> torch.Tensor:
    """16 rows of logits with ties at every rank: random logits on a grid of halves, and rows
    whose ties straddle the top k's boundary across blocks (the blocks' maxima tie too), sit in
    the last, partial block, or fill one block."""
    generator = torch.Generator().manual_seed(vocabulary)
    logits = ((torch.randn(16, vocabulary, generator=generator) * 4).round() / 2).to(dtype)
    logits[0, -5:] = 40.0  # the last block's (the partial block's on GPT-2's)
    logits[1, 256:288] = torch.linspace(30, 40, 32).to(dtype)  # a block's 32 largest
    logits[2, ::97] = 30.0  # more equal maxima than k, about one a block, at the boundary
    logits[3, -3:] = logits[3, 5] = logits[3, 700] = 30.0  # equal in the first and last blocks
    logits[4] = 1.0  # one value
    return logits


@pytest.mark.parametrize("vocabulary", [151_936, 50_257, 32_000, 1_000])
def test_the_top_logits_by_blocks_are_the_first_of_a_stable_sort(vocabulary):
    """`top_logits` (every head's top k: the k blocks of 128 ranked first by their maxima, then
    the top k of those) and `ranked_topk` (each of its stages, and the whole of a row too short
    for blocks) give the first k of a stable descending sort of the whole row, values and ids,
    ties to the lower id (torch.topk promises neither): on Qwen2.5's vocabulary, GPT-2's (a last
    block of 81), TinyLlama's, and one too small for blocks; bf16 and fp32 logits on a grid of
    halves, so that ties sit at every rank and across blocks."""
    for dtype in (torch.bfloat16, torch.float32):
        logits = tied_logits(vocabulary, dtype)
        expected_values = torch.sort(logits, dim=-1, descending=True, stable=True).values
        for k in (1, 8, 32):
            expected_ids = first_of_a_stable_sort(logits, k)
            for values, ids in (top_logits(logits, k), ranked_topk(logits, k)):
                assert torch.equal(values, expected_values[:, :k]), (dtype, k)
                assert torch.equal(ids, expected_ids), (dtype, k)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 4),
    length=st.integers(1, 1300),
    k=st.integers(1, 40),
    levels=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_any_row_of_few_values_ranks_as_a_stable_sort(rows, length, k, levels, seed):
    """The rule on rows no hand could pick: a few distinct values (so ties everywhere, at any
    rank), any length, any k up to it; by blocks where the row has 4k of them (k <= 2 here)."""
    k = min(k, length)
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(0, levels, (rows, length), generator=generator).float()
    expected = torch.sort(values, dim=-1, descending=True, stable=True)
    for top, ids in (ranked_topk(values, k), top_logits(values, k)):
        assert torch.equal(top, expected.values[:, :k]) and torch.equal(
            ids, expected.indices[:, :k]
        )


@pytest.mark.slow  # a setting for a GPU's speed, not its columns; a cold compile of its own
def test_the_compiled_fused_pass_never_splits_a_reduction():
    """On a GPU Inductor splits a row's reduction where the first chunk it compiles for has under
    2 rows per SM (a padded warm-up's 63), and that one graph serves every later chunk: so
    `compile_head_pass` compiles with no split, as the head bench measured the fused pass, with
    the loss, top-k and space columns. Decided here as for an H200, in a fresh process without
    Inductor's on-disk caches; with splits allowed, the same pass splits."""
    code = "import json, tests.stage1_helpers as h; print(json.dumps(h.fused_reduction_splits()))"
    root = Path(__file__).resolve().parents[1]
    fresh = os.environ | {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=fresh, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    splits = json.loads(run.stdout.strip().splitlines()[-1])
    assert splits["compile_head_pass"] == 1 < splits["splits allowed"], splits


def test_sized_chunks_take_their_rows_from_free_memory_and_change_no_column(teachers):
    vocabulary = 151_936
    fixed = LOGIT_BUDGET // vocabulary
    assert head_chunk_rows(vocabulary, "fixed") == fixed == 110
    # half of 40 GiB free at 12 bytes a logit: 11,776 rows of a 152k head
    assert head_chunk_rows(vocabulary, "sized", free=40 * 2**30) == 20 * 2**30 // (vocabulary * 12)
    assert head_chunk_rows(vocabulary, "sized", free=2**20) == fixed  # never below the fixed
    fixed_scorer, by_fixed = columns_of(teachers["smollm2"], head_chunks="fixed")
    sized_scorer, by_sized = columns_of(teachers["smollm2"], head_chunks="sized")
    assert (fixed_scorer.describe()["head_chunks"], sized_scorer.describe()["head_chunks"]) == (
        "fixed", "sized"
    )  # fmt: skip
    for name, values in by_fixed.items():
        np.testing.assert_allclose(by_sized[name], values, rtol=1e-5, atol=1e-6, err_msg=name)


def test_auto_is_the_plain_path_on_a_cpu(teachers):
    scorer, _ = columns_of(teachers["smollm2"])
    assert (scorer.describe()["head_kernel"], scorer.describe()["head_chunks"]) == (
        "plain", "fixed"
    )  # fmt: skip
