"""benchmarks/bench_gpu.py cannot rot: its model building and bare-forward timing run here at tiny
shapes (fast), and its whole main at tiny shapes on the CPU (slow: a local Ray and two stages)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_gpu  # noqa: E402

from pipeline.scoring.teacher import load_teacher_model, resolve_teacher  # noqa: E402
from pipeline.tokenizer import load_tokenizer  # noqa: E402


def test_tiny_teacher_bare_forward_and_direct_losses(tmp_path):
    cpu = torch.device("cpu")
    shape = bench_gpu.TEACHERS["tiny"]["qwen2.5-1.5b-like"]
    folder = bench_gpu.build_teacher(tmp_path / "teacher", shape, cpu, torch.float32)
    model = load_teacher_model(resolve_teacher(str(folder)), "float32", "cpu")
    assert model.config.vocab_size == shape["vocab_size"] >= load_tokenizer("qwen2.5").vocab_size
    ids = [np.arange(1, n, dtype=np.int64) * 7 for n in (40, 90, 15)]
    batches, scored = bench_gpu.device_batches(ids, 32, 16, 64, cpu)
    assert scored == sum(len(i) - 1 for i in ids)
    assert bench_gpu.bare_forward_rate(model, batches, scored, 1, cpu) > 0
    # windows of 32 with a stride of 16 give the same loss as one pass where a window holds all
    whole = bench_gpu.direct_losses(model, ids[2], 32, 16, cpu)
    assert np.isnan(whole[0]) and np.isfinite(whole[1:]).all()
    assert bench_gpu.peak_memory(cpu) > 0


@pytest.mark.slow
def test_benchmark_main_at_tiny_shapes_prints_every_row_and_passes_the_loss_check(capsys):
    assert (
        bench_gpu.main(["--shapes", "tiny", "--docs", "16", "--steps", "3", "--repeats", "1"]) == 0
    )
    out = capsys.readouterr().out
    for what, model in [
        ("stage 1 (hf)", "qwen2.5-1.5b-like"),
        ("stage 1 +space", "qwen2.5-1.5b-like"),
        ("bare forward", "qwen2.5-1.5b-like"),
        ("stage 1 (hf)", "qwen2.5-7b-like"),
        ("bare forward", "qwen2.5-7b-like"),
        ("stage 2 none", "llama-tiny"),
        ("stage 2 token", "llama-tiny"),
    ]:
        assert any(line.startswith(what) and model in line for line in out.splitlines()), out
    assert out.count(": passed") == 2 and "FAILED" not in out
