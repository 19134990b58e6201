"""Stage 2's --logger on real runs: every number metrics.jsonl holds reaches wandb (the real
package, offline, read back from its .wandb log) with the run's config; `none` writes
metrics.jsonl alone; a missing wandb is one line. (TensorBoard, the default:
tests/test_stage2_train.py::test_metrics_and_final_model.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pipeline.loggers import scalars
from stage2_train.train import main
from tests.cache_fixtures import build_cache
from tests.stage2_runs import train_args, wandb_history, wandb_offline  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cache")
    build_cache(path, teacher_tokenizer="qwen2.5", num_documents=8, docs_per_shard=4)
    return path


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.usefixtures("wandb_offline")
def test_wandb_gets_every_number_of_metrics_jsonl_and_the_runs_config(cache, tmp_path):
    """(A resumed run continuing the same wandb run: tests/test_loggers.py.)"""
    out = tmp_path / "out"
    args = train_args(cache, out, "--max-steps", "2", "--num-workers", "0", "--logger", "wandb",
                      "--wandb-project", "vocagno-test")  # fmt: skip
    assert main(args) == 0
    (run,) = wandb_history(out)
    assert run["project"] == "vocagno-test"
    assert run["history"] == [(r["step"], scalars(r)) for r in records(out)]
    assert {"train/tokens_per_second", "train/grad_norm"} <= run["history"][0][1].keys()
    assert run["config"] == json.loads((out / "config.json").read_text())
    assert not (out / "tensorboard").exists()


def test_logger_none_writes_metrics_jsonl_and_no_curves(cache, tmp_path):
    out = tmp_path / "out"
    args = train_args(cache, out, "--max-steps", "2", "--num-workers", "0", "--logger", "none")
    assert main(args) == 0
    assert [r["step"] for r in records(out)] == [1, 2]
    assert not (out / "tensorboard").exists() and not (out / "wandb").exists()


def test_logger_wandb_without_the_package_is_one_line_before_anything_is_written(
    cache, tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what find_spec and import see without it
    out = tmp_path / "out"
    assert main(train_args(cache, out, "--logger", "wandb")) == 2
    said = capsys.readouterr().err
    assert said == (
        "stage2_train/train.py: error: --logger wandb needs the wandb package: "
        "pip install 'vocagno[wandb]'\n"
    )
    assert not out.exists()
