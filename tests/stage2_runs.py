"""Shared by the stage 2 training tests: a tiny, fast training command and its metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TRAIN = Path(__file__).resolve().parents[1] / "stage2_train" / "train.py"
# Every field a resumed run must reproduce exactly.
LOSS_FIELDS = (
    "step",
    "loss",
    "loss_all",
    "kept_fraction",
    "mapped_fraction",
    "tokens",
    "lr",
    "grad_norm",
)


def train_args(cache: Path, out: Path, *extra: str) -> list[str]:
    """A llama-tiny student on the real tinyllama tokenizer, 6 steps of 2 x 32-token sequences
    from a 2-consumer stream (the test caches are small); `extra` options win over these
    (argparse keeps the last value given)."""
    return [
        "--cache",
        str(cache),
        "--student",
        "llama-tiny",
        "--student-tokenizer",
        "tinyllama",
        "--out",
        str(out),
        "--max-steps",
        "6",
        "--warmup-steps",
        "1",
        "--seq-len",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-tokens",
        "128",
        "--lr",
        "1e-3",
        "--min-lr",
        "1e-4",
        "--save-every",
        "100",
        "--data-consumers",
        "2",
        *extra,
    ]


def read_metrics(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: json.loads(line)[k] for k in LOSS_FIELDS} for line in lines]


def record_digests_again(checkpoint: Path) -> None:
    """Rewrite a checkpoint's marker for its files as they are now: a checkpoint whose files were
    replaced together with its marker (what the digests cannot tell from a whole one)."""
    from pipeline.file_digests import digest_share
    from stage2_train.checkpoint_digests import MARKER, checkpoint_files, marker_text

    step = json.loads((checkpoint / MARKER).read_text())["step"]
    digests = digest_share(checkpoint, checkpoint_files(checkpoint), 0, 1)
    (checkpoint / MARKER).write_text(marker_text(step, digests))


def tensorboard_scalars(out: Path) -> dict[str, list[tuple[int, float]]]:
    """Each TensorBoard tag of a run in OUT with its (step, value) pairs, as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    return {
        tag: [(event.step, event.value) for event in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
    }


def wandb_history(out: Path) -> list[dict]:
    """Each offline wandb run in OUT/wandb, oldest first, as wandb's own reader of its .wandb log
    (`wandb leet inspect`) gives it: run_id, project, config, and history, a (step, {key: value})
    per logged step (wandb's own `_` keys left out)."""
    import subprocess
    import sys

    runs = []
    for log in sorted((out / "wandb").glob("offline-run-*/run-*.wandb")):
        inspect = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)]
        lines = subprocess.run(inspect, check=True, capture_output=True, text=True).stdout
        run: dict = {"history": []}
        for line in lines.splitlines():
            entry = json.loads(line)
            if entry["type"] == "run":
                config = entry["run"]["config"]["update"]
                run |= {k: entry["run"][k] for k in ("run_id", "project")}
                run["config"] = {k: v for k, v in config.items() if k != "_wandb"}
            elif entry["type"] == "history":
                items = entry["history"]["item"]
                logged = {k: v for k, v in items.items() if not k.startswith("_")}
                run["history"].append((entry["history"]["step"]["num"], logged))
        runs.append(run)
    return runs


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    """wandb with no account: offline, its settings and cache kept out of the user's home (the
    locks install wandb; an environment without the `wandb` extra skips)."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_SILENT", "true")
