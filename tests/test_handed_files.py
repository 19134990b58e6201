"""Nothing in a folder a user was handed can run code: every file a resume, an export, an eval
or a teacher load reads is read by a loader that builds only data. Each test plants a pickle that
would create a file (the canary) in one such file, records its digest as a crafter would (a digest
is no signature), and sees the command refuse in one line naming the file, the canary absent."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from stage2_train.checkpoint import step_dir
from stage2_train.export import main as export
from stage2_train.train import main as train
from tests.cache_fixtures import build_cache
from tests.stage2_runs import record_digests_again, train_args

OPTIONS = ("--max-steps", "4", "--save-every", "2", "--num-workers", "0")


class RunsCode:
    """Unpickled by a plain loader, it creates `canary`."""

    def __init__(self, canary: Path):
        self.canary = canary

    def __reduce__(self):
        return (Path.touch, (self.canary,))


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cache")
    build_cache(path, teacher_tokenizer="qwen2.5", num_documents=8, docs_per_shard=8)
    return path


@pytest.fixture(scope="module")
def stopped(cache, tmp_path_factory) -> Path:
    """A run stopped after its step-2 checkpoint."""
    out = tmp_path_factory.mktemp("run") / "out"
    assert train(train_args(cache, out, *OPTIONS, "--stop-at-step", "2")) == 0
    return out


def crafted_copy(stopped: Path, tmp_path: Path, plant) -> tuple[Path, Path]:
    """A copy of the run whose step-2 checkpoint `plant(checkpoint, canary)` changed, its marker
    recording the new digests; (the run, the canary)."""
    out, canary = tmp_path / "out", tmp_path / "code-ran"
    shutil.copytree(stopped, out)
    plant(step_dir(out, 2), canary)
    record_digests_again(step_dir(out, 2))
    return out, canary


def plant_metadata(checkpoint: Path, canary: Path) -> None:
    (checkpoint / "state" / ".metadata").write_bytes(pickle.dumps(RunsCode(canary)))


def plant_stored_value(checkpoint: Path, canary: Path) -> None:
    """The optimizer's learning rate, a value DCP stores pickled, replaced by the crafted one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    state = checkpoint / "state"
    dcp_to_torch_save(state, checkpoint / "flat.pt")  # our own checkpoint: trusted to read
    flat = torch.load(checkpoint / "flat.pt", weights_only=True)
    (checkpoint / "flat.pt").unlink()
    flat["optimizer"]["param_groups"][0]["lr"] = RunsCode(canary)
    shutil.rmtree(state)
    dcp.save(flat, checkpoint_id=state, no_dist=True)


def plant_trainer_state(checkpoint: Path, canary: Path) -> None:
    torch.save({"scheduler": RunsCode(canary)}, checkpoint / "trainer.pt")


@pytest.mark.parametrize(
    "plant, named",
    [
        (plant_metadata, "state/.metadata"),
        (plant_stored_value, "state/__0_0.distcp"),
        (plant_trainer_state, "trainer.pt"),
    ],
    ids=["dcp-metadata", "dcp-stored-value", "trainer-state"],
)
def test_a_checkpoint_file_that_would_run_code_is_refused_by_resume_and_export(
    cache, stopped, tmp_path, capsys, plant, named
):
    """Before: `state/.metadata` and DCP's stored values were unpickled by plain pickle, so a
    crafted checkpoint ran its code on `--resume` and on export."""
    out, canary = crafted_copy(stopped, tmp_path, plant)
    checkpoint = step_dir(out, 2)
    capsys.readouterr()
    assert train(train_args(cache, out, *OPTIONS, "--resume", str(checkpoint))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(checkpoint / named) in err[0], err
    assert "could run code" in err[0]
    # export reads the model's part of the state only: the metadata, never the optimizer's values
    exported = export([str(checkpoint), "--out", str(tmp_path / "model")])
    if named == "state/.metadata":
        assert exported == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(checkpoint / named) in err[0], err
        assert not (tmp_path / "model").exists()
    else:
        assert exported == 0
    assert not canary.exists()


def test_a_model_folders_weights_that_would_run_code_are_refused_by_eval(
    stopped, tmp_path, capsys
):
    """A model folder's `pytorch_model.bin` is read by the unpickler that builds only tensors, as
    the header check and transformers both read it: one line naming the file."""
    from apps.cli import main as vocagno

    model, canary = export_of(stopped, tmp_path), tmp_path / "code-ran"
    (model / "model.safetensors").unlink()
    (model / "vocagno.json").unlink()  # a folder from elsewhere: no digests to check
    torch.save({"model.embed_tokens.weight": RunsCode(canary)}, model / "pytorch_model.bin")
    capsys.readouterr()
    assert vocagno(["eval", "--model", str(model), "--num-docs", "1", "--answer-problems", "0",
                    "--accuracy-problems", "0"]) == 2  # fmt: skip
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and str(model / "pytorch_model.bin") in err[0], err
    assert "could run code" in err[0]
    assert not canary.exists()


def export_of(stopped: Path, tmp_path: Path) -> Path:
    """A model folder: the step-2 checkpoint exported."""
    dest = tmp_path / "model"
    assert export([str(step_dir(stopped, 2)), "--out", str(dest)]) == 0
    assert json.loads((dest / "vocagno.json").read_text())["files"]
    return dest
