"""experiments/dose_response.py: the pre-registered differences and sentences computed from
made-up evaluations (fast), a bad design refused in one line before anything runs, and the whole
experiment end to end on a tiny teacher, a rerun redoing nothing (slow)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from apps.demo.config import PreRegistration
from experiments.dose.config import DoseConfig
from experiments.dose.report import (
    DOSE_NAME,
    arm_name,
    heldout_path,
    plateau,
    rung_folder,
    write_dose_report,
)
from pipeline.io import atomic_write_json
from tests.stage1_helpers import make_tiny_teacher

REPO = Path(__file__).resolve().parents[1]


def evaluation(bits: np.ndarray, characters: np.ndarray) -> dict:
    """What `vocagno eval` writes for answer bits, per problem."""
    return {"answer_bits": {"per_problem_bits": bits.tolist(),
                            "per_problem_characters": characters.tolist()}}  # fmt: skip


def selection(share: float) -> dict:
    return {"statistics": {
        "kept_loss_share": share, "random_loss_share": 0.4, "excess_vs_student_loss": 0.3,
        "excess_vs_minus_teacher_loss": 0.6,
        "seldom_kept": {"types": 3, "token_share": 0.2, "loss_share": 0.1},
    }}  # fmt: skip


def test_the_report_gives_each_difference_per_warm_start_and_seed_and_states_the_verdicts(tmp_path):
    config = DoseConfig(out=tmp_path, warm_start_ladder=[4, 8], seeds=[0], longest_seeds=[0, 1],
                        arms=["none", "token", "random"])  # fmt: skip
    prereg = PreRegistration(secondary=[], comparisons=["token-none", "token-random"],
                             resamples=200)  # fmt: skip
    rng = np.random.default_rng(0)
    characters = rng.integers(5, 40, 30).astype(float)
    base = rng.uniform(1.0, 3.0, 30) * characters
    # token is 0.2 bits/char worse than none after the short warm start, 0.1 better after the long
    shift = {(4, "token"): 0.2, (8, "token"): -0.1}
    for steps, curve in ((4, [(4, 5.0)]), (8, [(4, 4.5), (6, 4.2), (8, 4.15)])):
        rung = rung_folder(tmp_path, steps)
        history = [{"step": s, "loss": 1.0, "heldout_loss": h} for s, h in curve]
        atomic_write_json(rung / "warm-start" / "warm_start.json", {"history": history})
        atomic_write_json(rung / "selection" / "selection.json", selection(0.45))
        atomic_write_json(rung / "eval" / "warm-start.json", evaluation(base, characters))
        for seed in config.seeds_at(steps):
            for arm in config.arms:
                per_char = shift.get((steps, arm), 0.0)
                atomic_write_json(rung / "eval" / f"{arm_name(arm, seed)}.json",
                                  evaluation(base + per_char * characters, characters))  # fmt: skip
    report = write_dose_report(config, tmp_path / "m.toml", prereg, {"stage1": 60})
    points = json.loads((tmp_path / DOSE_NAME).read_text())["points"]
    assert len(points) == (1 + 2) * 2  # (seeds at 4 + at 8) x comparisons
    found = {(p["warm_start_steps"], p["seed"], p["comparison"]): p for p in points}
    assert found[4, 0, "token-none"]["difference"] == pytest.approx(0.2)
    assert found[8, 1, "token-none"]["difference"] == pytest.approx(-0.1)
    assert found[8, 0, "token-none"]["heldout_loss"] == 4.15
    text = report.read_text()
    assert "- Warm start 4: `token-none` +0.2000 (1 of 1 excluding 0)" in text
    # 4.2 at step 6 (the last at or before 3/4 of 8) -> 4.15: a 1.19% fall, under 2%
    assert "Plateau test passed (held-out loss 4.2000 at step 6 -> 4.1500 at step 8" in text
    assert "longest warm start (8 steps) is below zero in every seed with its interval" in text
    assert "`token-none` is smaller at the longest warm start than at the shortest (4 steps; " \
        "-0.3000 between their means)" in text
    assert "| 8 | 4.1500 |" in text and (tmp_path / "dose.png").stat().st_size > 0

    # A later run of one longer rung reads this one's points as `earlier`: its longest is set
    # against their shortest, and none of theirs counts as its own.
    later = DoseConfig(out=tmp_path / "later", warm_start_ladder=[16], longest_seeds=[0],
                       arms=config.arms, earlier=[str(tmp_path / DOSE_NAME)])  # fmt: skip
    rung = rung_folder(later.out, 16)
    history = [{"step": s, "loss": 1.0, "heldout_loss": h} for s, h in ((8, 4.0), (16, 3.99))]
    atomic_write_json(rung / "warm-start" / "warm_start.json", {"history": history})
    atomic_write_json(rung / "selection" / "selection.json", selection(0.5))
    for name, per_char in (("warm-start", 0.0), ("none-seed0", 0.0), ("token-seed0", 0.05),
                           ("random-seed0", 0.0)):  # fmt: skip
        atomic_write_json(rung / "eval" / f"{name}.json",
                          evaluation(base + per_char * characters, characters))  # fmt: skip
    text = write_dose_report(later, tmp_path / "m.toml", prereg, {}).read_text()
    mine = json.loads((later.out / DOSE_NAME).read_text())["points"]
    assert {p["warm_start_steps"] for p in mine} == {16} and len(mine) == 2
    assert "longest warm start (16 steps) is above zero in every seed" in text
    assert "`token-none` is smaller at the longest warm start than at the shortest (4 steps, " \
        "an earlier run's; -0.1500 between their means)" in text
    assert "- Warm start 4" not in text  # the earlier run's rungs are its own report's
    assert f"The plot also draws the warm starts of earlier runs, each measured by its own run: " \
        f"`{tmp_path / DOSE_NAME}`." in text


def test_a_missing_earlier_run_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="earlier names no dose.json at"):
        DoseConfig(out=tmp_path, earlier=[str(tmp_path / "nowhere" / DOSE_NAME)])


def test_a_bogus_earlier_run_is_refused_before_the_first_step(tmp_path, capsys):
    """Before: a file named by `earlier` was only checked to exist, and the final report, after
    every step had run, raised a KeyError on it."""
    from experiments.dose_response import main

    bogus = tmp_path / DOSE_NAME
    bogus.write_text(json.dumps({"points": [{"warm_start_steps": 4, "comparison": "token-none"}]}))
    demo = REPO / "manifests" / "demo.toml"  # the dose's own run scores top-k: the demo's does not
    out = tmp_path / "out"
    assert main(["--manifest", str(demo), "--out", str(out), "--earlier", str(bogus)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"[dose] earlier {bogus} is no dose.json" in err[0], err
    assert "(no 'heldout_loss')" in err[0] and not out.exists()


def test_an_arm_that_reads_columns_stage1_does_not_score_is_refused_before_anything_runs(
    tmp_path, capsys
):
    """Before: a `kld` arm under a [stage1] that scores no top-k started: the teacher scored,
    the warm start and the `none` arm trained and were evaluated, then the arm failed in a
    torchrun traceback. The tables are checked against each other first."""
    from experiments.dose_response import main

    manifest, out = REPO / "manifests" / "demo.toml", tmp_path / "out"  # its [stage1]: no top-k
    assert main(["--manifest", str(manifest), "--out", str(out), "--arms", "none", "kld"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and not out.exists(), err
    assert (
        f"--guidance kld reads the teacher's topk_probs, topk_ids, topk_rest, which the cache "
        f"{manifest} [stage1] scores does not hold"
    ) in err[0]


def test_the_plateau_test_fails_when_the_loss_still_falls():
    flat = plateau([(40, 6.0), (80, 5.0), (120, 4.8), (160, 4.5)], 0.02)
    assert flat["from_step"] == 120 and flat["flattened"] is False
    assert flat["relative_fall"] == pytest.approx(0.3 / 4.8)


def test_a_bad_design_is_refused_in_one_line_before_anything_runs(tmp_path):
    manifest = tmp_path / "dose.toml"
    manifest.write_text(f'[dose]\nout = "{tmp_path / "out"}"\nwarm_start_docs = 9900\n'
                        '[stage2]\nstudent_tokenizer = "tinyllama"\n')  # fmt: skip
    command = [sys.executable, "experiments/dose_response.py", "--manifest", str(manifest)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "warm_start_docs + heldout_docs must be at most 10,000" in result.stderr
    assert result.stderr.count("\n") == 1 and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_dose_response_runs_end_to_end_and_a_rerun_redoes_nothing(tmp_path):
    teacher = make_tiny_teacher(tmp_path / "teacher", "smollm2")
    out = tmp_path / "dose"
    manifest = tmp_path / "dose.toml"
    manifest.write_text(
        f"""
[dose]
out = "{out}"
teacher = "{teacher}"
train_docs = 12
warm_start_docs = 8
warm_start_warmup = 1
warm_start_ladder = [2, 4]
heldout_docs = 4
heldout_every = 2
arms = ["none", "token", "uld", "alm"]
seeds = [0]
longest_seeds = [0, 1]
selection_tokens = 256
[preregistered]
secondary = []
comparisons = ["token-none", "uld-none", "alm-none"]
resamples = 200
[stage1]
docs_per_shard = 6
num_workers = 2
max_length = 256
batch_tokens = 2048
topk_probs = 4
topk_ids = false
space_logprob = true
[stage2]
student_tokenizer = "tinyllama"
seq_len = 64
micro_batch_size = 2
global_batch_tokens = 256
max_steps = 2
warmup_steps = 1
save_every = 2
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
    command = [sys.executable, "experiments/dose_response.py", f"--manifest={manifest}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    for steps, seeds in ((2, [0]), (4, [0, 1])):
        rung = rung_folder(out, steps)
        history = json.loads((rung / "warm-start" / "warm_start.json").read_text())["history"]
        assert [h["step"] for h in history if "heldout_loss" in h] == [2, 4][: steps // 2]
        assert (rung / "selection" / "selection.json").exists()
        for seed in seeds:
            for arm in ("none", "token", "uld", "alm"):
                measured = json.loads((rung / "eval" / f"{arm_name(arm, seed)}.json").read_text())
                assert len(measured["answer_bits"]["per_problem_bits"]) == 6
                assert not (rung / "arms" / arm_name(arm, seed) / "checkpoints").exists()
    points = json.loads((out / DOSE_NAME).read_text())["points"]
    assert len(points) == (1 + 2) * 3
    report = (out / "report.md").read_text()
    assert "Plateau test" in report and (out / "dose.png").exists()

    timings = json.loads((out / "timings.json").read_text())
    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "stage 2 for" not in again.stderr and "Ray cluster up" not in again.stderr
    assert json.loads((out / "timings.json").read_text()) == timings


@pytest.mark.slow
def test_the_gpu_form_runs_at_a_tiny_shape_from_a_carried_cache_with_a_rate_sweep(tmp_path):
    """manifests/dose-response-gpu.toml's form on the CPU: a cache made elsewhere (no teacher, no
    Ray), one warm start, every arm at two seeds and two rates, each compared at the rate whose
    model has the lower held-out loss; split across two calls (a leased machine's), the first
    stopped by stop_after_seconds after the warm start, the second continuing from there."""
    import tomllib

    from tests.cache_fixtures import build_cache

    cache = tmp_path / "cache"
    build_cache(cache, teacher_tokenizer="smollm2", num_documents=12, docs_per_shard=6,
                topk=4, space_logprob=True)  # fmt: skip
    gpu = tomllib.loads((REPO / "manifests" / "dose-response-gpu.toml").read_text())
    out = tmp_path / "dose"
    manifest = tmp_path / "dose.toml"
    manifest.write_text(
        f"""
[dose]
out = "{out}"
cache = "{cache}"
student = "llama-tiny"
warm_start_docs = 8
warm_start_warmup = 1
warm_start_ladder = [4]
heldout_docs = 4
heldout_every = 2
arms = {json.dumps(gpu["dose"]["arms"])}
seeds = [0, 1]
longest_seeds = [0, 1]
arm_lrs = {json.dumps(gpu["dose"]["arm_lrs"])}
selection_tokens = 256
nproc_per_node = 1
[preregistered]
secondary = []
comparisons = {json.dumps(gpu["preregistered"]["comparisons"])}
resamples = 200
[stage2]
student_tokenizer = "tinyllama"
seq_len = 64
micro_batch_size = 2
global_batch_tokens = 128
max_steps = 2
warmup_steps = 1
save_every = 2
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
    command = [sys.executable, "experiments/dose_response.py", f"--manifest={manifest}"]
    first = subprocess.run([*command, "--stop-after-seconds=1"], cwd=REPO, capture_output=True,
                           text=True, timeout=1500)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    assert re.search(r"stopped before .*, \d+ s into this call \(stop_after_seconds 1\): run "
                     "the same command again to continue", first.stderr), first.stderr[-3000:]
    assert not (out / "report.md").exists()
    timings = out / "timings.json"
    done = json.loads(timings.read_text()) if timings.exists() else {}
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Ray cluster up" not in result.stderr and not (out / "cache").exists()
    # what the first call finished is reused, not done again (its times stay its own)
    after = json.loads(timings.read_text())
    assert all(after[step] == seconds for step, seconds in done.items() if step != "cpu")
    rung = rung_folder(out, 4)
    dose = json.loads((out / DOSE_NAME).read_text())
    assert len(dose["points"]) == 2 * 4  # seeds x comparisons
    for point in dose["points"]:
        for run, arm in zip(point["runs"], point["comparison"].split("-"), strict=True):
            losses = {
                lr: json.loads(heldout_path(rung, arm_name(arm, point["seed"], lr)).read_text())[
                    "heldout_loss"
                ]
                for lr in gpu["dose"]["arm_lrs"]
            }
            assert run == arm_name(arm, point["seed"], min(losses, key=losses.get))
    assert "(lr " in (out / "report.md").read_text()


def test_an_arm_starts_torchrun_as_the_interpreters_module(monkeypatch, tmp_path):
    """A GPU machine's system Python has torch but no `torchrun` script beside the interpreter,
    where the arms looked for one: each arm's stage 2 now starts `python -m
    torch.distributed.run`, which any Python with torch has."""
    from types import SimpleNamespace

    import apps.demo.arms as arms

    started = []
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python3"))  # nothing beside it
    monkeypatch.setattr(arms.subprocess, "run",
                        lambda command, **kwargs: started.append(command) or SimpleNamespace(
                            returncode=0))  # fmt: skip
    config = SimpleNamespace(nproc_per_node=1, student_tokenizer="tinyllama", out=tmp_path)
    arms.run_stage2(config, tmp_path / "m.toml", tmp_path, tmp_path, arms.ArmRun("o", "none"))
    assert started[0][:3] == [str(tmp_path / "python3"), "-m", "torch.distributed.run"]
