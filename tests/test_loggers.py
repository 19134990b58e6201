"""The loggers stage 2's --logger chooses, with the real packages: TensorBoard's event files read
back with TensorBoard's reader, and wandb in offline mode read back from its .wandb log with
wandb's own reader (`wandb leet inspect`)."""

from __future__ import annotations

import sys

import pytest

from pipeline.errors import ConfigError
from pipeline.loggers import WANDB_FOLDER, WANDB_RUN_ID, check_logger, open_logger, scalars
from tests.stage2_runs import (  # noqa: F401 (wandb_offline: a fixture)
    tensorboard_scalars,
    wandb_history,
    wandb_offline,
)

# A step's record as metrics.jsonl holds it: mfu is None on a CPU, loss None without targets.
RECORD = {"step": 3, "loss": 2.5, "loss_all": 2.75, "kept_fraction": 0.4, "tokens": 192,
          "lr": 1e-3, "grad_norm": 0.75, "tokens_per_second": 1234.5, "mfu": None}  # fmt: skip
CONFIG = {"cache": "cache", "student": "llama-tiny", "max_steps": 6, "lr": 1e-3}


def record(step: int, loss: float | None = 2.5) -> dict:
    return {**RECORD, "step": step, "loss": loss}


def test_a_record_is_logged_as_its_numbers_under_train():
    logged = scalars({**RECORD, "note": "text", "epoch_start": True})
    assert logged == {f"train/{key}": value for key, value in RECORD.items()
                      if key not in ("step", "mfu")}  # fmt: skip


def test_tensorboard_keeps_its_tags_and_a_resume_purges_the_steps_after_its_checkpoint(tmp_path):
    logger = open_logger("tensorboard", tmp_path, 0, CONFIG, "vocagno")
    for step in (1, 2, 3):
        logger.log(record(step, loss=float(step)), step)
    logger.close()
    logger = open_logger("tensorboard", tmp_path, 1, CONFIG, "vocagno")  # resumed at step 1
    logger.log(record(2, loss=20.0), 2)
    logger.close()
    logged = tensorboard_scalars(tmp_path)
    assert set(logged) == set(scalars(RECORD))
    assert logged["train/loss"] == [(1, 1.0), (2, 20.0)]
    assert logged["train/tokens_per_second"][0] == (1, 1234.5)


@pytest.mark.usefixtures("wandb_offline")
def test_wandb_offline_logs_every_number_and_a_resume_continues_the_same_run(tmp_path):
    out = tmp_path / "run"
    logger = open_logger("wandb", out, 0, CONFIG, "vocagno-test")
    for step in (1, 2):
        logger.log(record(step, loss=None if step == 2 else 2.5), step)
    logger.close()
    run_id = (out / WANDB_FOLDER / WANDB_RUN_ID).read_text().strip()
    first = wandb_history(out)
    assert [run["run_id"] for run in first] == [run_id]
    assert first[0]["config"] == CONFIG and first[0]["project"] == "vocagno-test"
    steps = first[0]["history"]
    assert [step for step, _ in steps] == [1, 2]
    assert steps[0][1] == scalars(record(1))
    assert "train/loss" not in steps[1][1]  # no value, not a 0

    logger = open_logger("wandb", out, 2, CONFIG, "vocagno-test")  # resumed after step 2
    logger.log(record(3), 3)
    logger.close()
    resumed = wandb_history(out)
    assert [run["run_id"] for run in resumed] == [run_id, run_id]
    assert [step for step, _ in resumed[1]["history"]] == [3]

    logger = open_logger("wandb", out, 0, CONFIG, "vocagno-test")  # a fresh start: a new run
    logger.close()
    assert (out / WANDB_FOLDER / WANDB_RUN_ID).read_text().strip() != run_id


def test_wandb_not_installed_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what find_spec and import see without it
    with pytest.raises(ConfigError, match=r"^--logger wandb needs the wandb package: "
                       r"pip install 'vocagno\[wandb\]'$"):  # fmt: skip
        check_logger("wandb")
    check_logger("tensorboard")
    check_logger("none")
