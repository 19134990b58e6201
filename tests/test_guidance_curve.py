"""experiments/guidance_curve.py: the pre-registered differences computed from each checkpoint's
evaluation and stated as measured (fast, from made-up evaluations), a design whose last checkpoint
is not the run's end refused in one line, and the whole experiment end to end on a tiny teacher,
resumed without redoing anything (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from apps.demo.config import PreRegistration
from experiments.curve.config import CurveConfig
from experiments.curve.report import CURVE_NAME, point_name, write_curve_report
from tests.stage1_helpers import make_tiny_teacher

REPO = Path(__file__).resolve().parents[1]


def evaluation(bits: np.ndarray, characters: np.ndarray) -> dict:
    """What `vocagno eval` writes for answer bits, per problem."""
    return {"answer_bits": {"per_problem_bits": bits.tolist(),
                            "per_problem_characters": characters.tolist()}}  # fmt: skip


def test_the_report_gives_each_difference_per_checkpoint_and_seed_and_says_who_led(tmp_path):
    config = CurveConfig(out=tmp_path, seeds=[0, 1], checkpoints=[2, 4])
    prereg = PreRegistration(secondary=[], comparisons=["token-none", "random-none"], resamples=200)
    generator = np.random.default_rng(0)
    characters = generator.integers(5, 40, 30).astype(float)
    base = generator.uniform(1.0, 3.0, 30) * characters
    # token is better than none by 0.1 bits/char at step 4 in both seeds; random worse in seed 0
    # and better in seed 1
    shift = {("token", 4): -0.1, ("random", 4, 0): 0.05, ("random", 4, 1): -0.02}
    results = {"warm-start": evaluation(base, characters)}
    for seed in (0, 1):
        for arm in ("none", "token", "random"):
            for step in (2, 4):
                per_char = shift.get((arm, step), shift.get((arm, step, seed), 0.0))
                results[point_name(arm, seed, step)] = evaluation(
                    base + per_char * characters, characters
                )
    report = write_curve_report(config, tmp_path / "m.toml", prereg, results, {"stage1": 60}, 2048)
    points = json.loads((tmp_path / CURVE_NAME).read_text())["points"]
    assert len(points) == 2 * 2 * 2  # checkpoints x seeds x comparisons
    last = {(p["comparison"], p["seed"]): p for p in points if p["step"] == 4}
    assert last["token-none", 0]["difference"] == pytest.approx(-0.1)
    assert last["token-none", 0]["tokens"] == 4 * 2048
    assert last["random-none", 1]["difference"] == pytest.approx(-0.02)
    assert all(p["difference"] == pytest.approx(0) for p in points if p["step"] == 2)
    text = report.read_text()
    assert "At the largest budget (step 4), `token` had the best" in text
    assert "`token-none` at step 4: mean -0.1000; negative in 2 of 2 seeds, the seeds agree" in text
    assert "`random-none` at step 4: mean +0.0150; negative in 1 of 2 seeds, the seeds disagree" in text
    assert "| 4 | 8,192 |" in text and (tmp_path / "curve.png").stat().st_size > 0


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--checkpoints", "4", "2"], "checkpoints must be increasing steps"),
        (["--checkpoints", "2", "8"], "max_steps is 4, but the last of [curve] checkpoints is 8"),
    ],
)
def test_a_bad_design_is_refused_in_one_line_before_anything_runs(tmp_path, bad, message):
    manifest = tmp_path / "curve.toml"
    manifest.write_text(
        f'[curve]\nout = "{tmp_path / "out"}"\ncheckpoints = [2, 4]\n'
        '[stage2]\nstudent_tokenizer = "tinyllama"\nmax_steps = 4\nwarmup_steps = 1\n'
    )
    command = [sys.executable, "experiments/guidance_curve.py", "--manifest", str(manifest), *bad]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and result.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_curve_runs_end_to_end_and_a_rerun_redoes_nothing(tmp_path):
    teacher = make_tiny_teacher(tmp_path / "teacher", "smollm2")
    out = tmp_path / "curve"
    manifest = tmp_path / "curve.toml"
    manifest.write_text(
        f"""
[curve]
out = "{out}"
teacher = "{teacher}"
train_docs = 12
warm_start_docs = 8
warm_start_steps = 3
warm_start_warmup = 1
arms = ["none", "token"]
seeds = [0]
checkpoints = [2, 4]
[preregistered]
secondary = []
comparisons = ["token-none"]
resamples = 200
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
save_every = 4
num_workers = 0
data_consumers = 2
[eval]
num_docs = 0
answer_problems = 6
accuracy_problems = 0
shots = 1
max_length = 256
"""
    )
    command = [sys.executable, "experiments/guidance_curve.py", f"--manifest={manifest}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    for arm in ("none", "token"):
        run = out / "arms" / f"{arm}-seed0"
        steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2, 3, 4]  # one run, continued from its step-2 checkpoint
        assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-4"]  # older removed
        for step in (2, 4):
            measured = json.loads((out / "eval" / f"{arm}-seed0-step{step}.json").read_text())
            assert len(measured["answer_bits"]["per_problem_bits"]) == 6
    assert not any((out / "models").iterdir())  # exported models are removed once evaluated
    points = json.loads((out / CURVE_NAME).read_text())["points"]
    assert [(p["comparison"], p["step"], p["tokens"]) for p in points] == [
        ("token-none", 2, 512), ("token-none", 4, 1024)
    ]  # fmt: skip
    report = (out / "report.md").read_text()
    assert "At the largest budget (step 4)" in report and (out / "curve.png").exists()

    timings = json.loads((out / "timings.json").read_text())
    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "stage 2 to step" not in again.stderr and "Ray cluster up" not in again.stderr
    assert json.loads((out / "timings.json").read_text()) == timings
