"""apps/demo/arms.py: an arm's run reaches stage 2 as the options it describes over [stage2], and
a finished arm is kept (never trained twice) with its checkpoints removed unless asked to keep
them. The torchrun command itself: tests/test_dose_response.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from apps.demo import arms
from stage2_train.config import parse_train_config


def test_an_arm_runs_stage_2_with_its_seed_rates_steps_and_table_over_the_manifest(tmp_path):
    manifest = tmp_path / "m.toml"
    manifest.write_text('[stage2]\nstudent_tokenizer = "tinyllama"\nmax_steps = 9\nlr = 1e-3\n'
                        "min_lr = 1e-4\nseed = 5\ntopk = 0.4\nwarmup_steps = 1\n")  # fmt: skip
    run = arms.ArmRun("rho1-lr0.003-seed1", "token", seed=1, lr=3e-3, min_lr=3e-3 / 10,
                      max_steps=37, options={"topk": 0.6, "loss_normalization": "kept"})  # fmt: skip
    given = ["--manifest", str(manifest), "--cache", "c", "--student", "s", "--out", "o"]
    config = parse_train_config([*given, *run.arguments()])
    optimizer, guidance = config.optimizer, config.guidance
    assert (optimizer.seed, optimizer.lr, optimizer.min_lr, optimizer.max_steps) == (
        1, 3e-3, 3e-3 / 10, 37)  # fmt: skip
    assert (guidance.mode, guidance.topk, guidance.loss_normalization) == ("token", 0.6, "kept")
    plain = parse_train_config([*given, *arms.ArmRun("none", "none").arguments()])
    assert (plain.optimizer.seed, plain.optimizer.lr, plain.optimizer.max_steps) == (5, 1e-3, 9)
    with pytest.raises(ValueError, match="a peak lr and its min_lr come together"):
        arms.ArmRun("token", "token", lr=1e-3)


@pytest.mark.parametrize("keep", [False, True])
def test_a_finished_arm_is_not_trained_again_and_its_checkpoints_go_unless_kept(
    monkeypatch, tmp_path, keep
):
    config = SimpleNamespace(out=tmp_path, nproc_per_node=1, student_tokenizer="tinyllama")
    folder = arms.arm_folder(config, "token-seed0")
    (folder / "final").mkdir(parents=True)
    (folder / "final" / "config.json").write_text("{}")
    (folder / "checkpoints" / "step-4").mkdir(parents=True)
    monkeypatch.setattr(arms.subprocess, "run", lambda *a, **k: pytest.fail("trained again"))
    run = arms.ArmRun("token-seed0", "token", seed=0)
    assert arms.train_arm(config, tmp_path / "m.toml", tmp_path, tmp_path, run, keep) == folder
    assert (folder / "final" / "config.json").exists()
    assert (folder / "checkpoints").exists() == keep
