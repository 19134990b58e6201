"""stage2_train/export.py: a stage-2 checkpoint as a model folder. The last step's checkpoint exported
is the run's final model tensor for tensor; an earlier one is a model of its own that
transformers loads; what is no complete checkpoint, or would overwrite a folder, is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.errors import ConfigError
from pipeline.models.model_folder import PROVENANCE_NAME
from stage2_train.checkpoint import MARKER, step_dir
from stage2_train.export import export_checkpoint
from stage2_train.export import main as export
from stage2_train.train import main as train
from tests.cache_fixtures import build_cache
from tests.stage2_runs import train_args


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    build_cache(cache, teacher_tokenizer="qwen2.5", num_documents=16, docs_per_shard=8)
    out = tmp_path_factory.mktemp("run") / "out"
    options = ("--max-steps", "4", "--save-every", "2", "--num-workers", "0")
    assert train(train_args(cache, out, *options)) == 0
    return out


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def test_the_last_checkpoint_exported_is_the_final_model(run, tmp_path):
    dest = export_checkpoint(step_dir(run, 4), tmp_path / "step-4")
    exported, final = weights(dest), weights(run / "final")
    assert exported.keys() == final.keys()
    for name, tensor in final.items():
        assert torch.equal(exported[name], tensor), name
    assert json.loads((dest / PROVENANCE_NAME).read_text())["step"] == 4


def test_an_earlier_checkpoint_is_a_model_of_its_own_that_transformers_loads(run, tmp_path):
    from transformers import AutoModelForCausalLM

    dest = tmp_path / "step-2"
    assert export([str(step_dir(run, 2)), "--out", str(dest)]) == 0
    exported, final = weights(dest), weights(run / "final")
    assert any(not torch.equal(exported[name], final[name]) for name in final)
    provenance = json.loads((dest / PROVENANCE_NAME).read_text())
    assert provenance["step"] == 2 and provenance["config"]["max_steps"] == 4
    model = AutoModelForCausalLM.from_pretrained(dest)
    ids = torch.tensor([[5, 6, 7]])
    assert model(input_ids=ids).logits.shape[-1] == model.config.vocab_size
    # an existing folder is not overwritten without a word
    before = (dest / "model.safetensors").read_bytes()
    with pytest.raises(
        ConfigError, match="holds an earlier export; choose another folder, or pass"
    ):
        export_checkpoint(step_dir(run, 4), dest)
    assert (dest / "model.safetensors").read_bytes() == before
    assert export([str(step_dir(run, 4)), "--out", str(dest), "--overwrite"]) == 0
    assert json.loads((dest / PROVENANCE_NAME).read_text())["step"] == 4


def test_a_folder_that_is_no_complete_checkpoint_is_refused_in_one_line(run, tmp_path, capsys):
    partial = tmp_path / "step-2"
    shutil.copytree(step_dir(run, 2), partial)
    (partial / MARKER).unlink()  # as a save cut off before its last file
    assert export([str(partial), "--out", str(tmp_path / "model")]) != 0
    assert f"is no complete stage-2 checkpoint (no {MARKER} file)" in capsys.readouterr().err
    assert not (tmp_path / "model").exists()


def tree(folder: Path) -> dict[str, bytes]:
    """Every file below `folder` with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    "where, holds",
    [
        (lambda run, tmp: run, "holds the checkpoint being exported"),
        (lambda run, tmp: run / "checkpoints", "holds the checkpoint being exported"),
        (lambda run, tmp: step_dir(run, 4), "is the checkpoint being exported"),
        (lambda run, tmp: step_dir(run, 2), "is inside the stage-2 run"),
        (lambda run, tmp: tmp / "checkpoint-copy", "holds a stage-2 checkpoint"),
        (lambda run, tmp: run / "final", "is inside the stage-2 run"),
        (lambda run, tmp: run / "exports" / "step-4", "is inside the stage-2 run"),
        (lambda run, tmp: tmp / "cache", "holds a teacher-loss cache"),
        (lambda run, tmp: tmp / "other-run", "holds a stage-2 run"),
        (lambda run, tmp: tmp / "final-copy", "holds a model stage 2 wrote"),
        (lambda run, tmp: tmp / "notes", "holds files export did not write (a.txt)"),
    ],
    ids=[
        "run",
        "checkpoints",
        "source",
        "checkpoint",
        "checkpoint-copy",
        "final",
        "inside-run",
        "cache",
        "another-run",
        "final-copy",
        "files",
    ],
)
def test_export_never_writes_over_what_it_did_not_write(run, tmp_path, capsys, where, holds):
    """--overwrite or not: a run, a checkpoint, a cache, a model or anyone's files stay as they
    were, and the refusal is one line naming what the folder holds."""
    shutil.copytree(run, tmp_path / "other-run")
    shutil.copytree(run / "final", tmp_path / "final-copy")
    shutil.copytree(step_dir(run, 2), tmp_path / "checkpoint-copy")
    build_cache(tmp_path / "cache", teacher_tokenizer="qwen2.5", num_documents=2, docs_per_shard=2)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    dest = where(run, tmp_path)
    before = {"run": tree(run), "tmp": tree(tmp_path)}
    assert export([str(step_dir(run, 4)), "--out", str(dest), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and holds in err[0], err
    assert {"run": tree(run), "tmp": tree(tmp_path)} == before


def test_a_file_at_out_is_refused_and_an_empty_folder_is_written(run, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert export([str(step_dir(run, 4)), "--out", str(tmp_path / "file")]) == 2
    assert "is a file; give a folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert export([str(step_dir(run, 4)), "--out", str(tmp_path / "empty")]) == 0
    assert (tmp_path / "empty" / PROVENANCE_NAME).exists()


def test_overwrite_replaces_an_earlier_export_only_when_it_holds_nothing_else(
    run, tmp_path, capsys
):
    """Before: --overwrite onto an earlier export deleted the user's files in it (notes.txt,
    eval_results/). It replaces only what the export wrote (the files its vocagno.json records)
    and refuses, naming them, where the folder holds others."""
    dest = tmp_path / "model"
    assert export([str(step_dir(run, 2)), "--out", str(dest)]) == 0
    (dest / "notes.txt").write_text("mine")
    (dest / "eval_results").mkdir()
    before = tree(dest)
    capsys.readouterr()
    assert export([str(step_dir(run, 4)), "--out", str(dest), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "files it did not write (eval_results, notes.txt)" in err[0], err
    assert tree(dest) == before and (dest / "eval_results").is_dir()
    (dest / "notes.txt").unlink()
    (dest / "eval_results").rmdir()
    assert export([str(step_dir(run, 4)), "--out", str(dest), "--overwrite"]) == 0
    assert json.loads((dest / PROVENANCE_NAME).read_text())["step"] == 4
