"""`make demo`'s orchestration end to end on a tiny teacher: a private Ray cluster and a real
`ray job submit` for stage 1, `torchrun` x2 per arm, evaluation, and the report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stage1_helpers import make_tiny_teacher

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_runs_every_stage_and_reports_what_it_measured(tmp_path):
    teacher = make_tiny_teacher(tmp_path / "teacher", "smollm2")
    out = tmp_path / "demo"
    manifest = tmp_path / "demo.toml"
    manifest.write_text(
        f"""
[demo]
out = "{out}"
teacher = "{teacher}"
train_docs = 12
arms = ["none", "token"]
[stage1]
docs_per_shard = 6
num_workers = 2
max_length = 256
batch_tokens = 2048
[stage2]
student_tokenizer = "tinyllama"
seq_len = 64
micro_batch_size = 2
global_batch_tokens = 256
max_steps = 4
warmup_steps = 1
save_every = 2
num_workers = 0
lr = 1e-3
min_lr = 1e-4
[eval]
num_docs = 3
accuracy_problems = 2
shots = 1
max_new_tokens = 8
max_length = 256
"""
    )
    command = [sys.executable, "scripts/demo.py", "--manifest", str(manifest)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Job 'vocagno-demo-stage1-" in result.stdout + result.stderr  # a real Ray job
    cache_manifest = json.loads((out / "cache" / "manifest.json").read_text())
    assert cache_manifest["totals"]["rows"] == 12
    for arm in ("none", "token"):
        metrics = (out / "arms" / arm / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in metrics] == [1, 2, 3, 4]
        assert (out / "arms" / arm / "final" / "model.safetensors").exists()
    token_kept = [
        json.loads(line)["kept_fraction"]
        for line in (out / "arms/token/metrics.jsonl").read_text().splitlines()
    ]
    assert all(k < 0.9 for k in token_kept)  # guidance really selects
    report = (out / "report.md").read_text()
    for name in ("teacher", "student-init", "student-none", "student-token"):
        measured = json.loads((out / "eval" / f"{name}.json").read_text())
        bpc = measured["bits_per_character"]["bits_per_character"]
        assert f"| {name} | {bpc:.4f} |" in report
    for figure in ("training_curves.png", "bits_per_character.png", "inspect.html"):
        assert (out / figure).stat().st_size > 0
    timings = json.loads((out / "timings.json").read_text())
    assert {"stage1", "stage2-none", "stage2-token", "eval"} <= set(timings)

    # A rerun reuses every finished step and keeps the timings of the run that did the work.
    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Ray cluster up" not in again.stderr
    assert json.loads((out / "timings.json").read_text())["stage1"] == timings["stage1"]


@pytest.mark.parametrize("bad", [["--train-docs", "0"], ["--arms", "bogus"]])
def test_bad_demo_options_are_one_line_and_exit_2(bad):
    result = subprocess.run(
        [sys.executable, "scripts/demo.py", *bad], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stderr.startswith("demo: error: ") and result.stderr.count("\n") == 1
