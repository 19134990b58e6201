"""A checkpoint is trusted only when it is whole: its marker records every file's size and digest,
a resume checks them first, names what is damaged in one line and goes back to the newest whole
checkpoint, whose continuation equals the uninterrupted run; export checks the same."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.file_digests import file_digest, share_problems
from stage2_train.checkpoint import MARKER, complete_checkpoints, step_dir
from stage2_train.checkpoint_digests import checkpoint_files, recorded_digests
from stage2_train.export import main as export
from stage2_train.train import main as train
from tests.cache_fixtures import build_cache
from tests.stage2_runs import read_metrics, train_args

OPTIONS = ("--max-steps", "6", "--save-every", "2", "--num-workers", "0")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cache")
    build_cache(path, teacher_tokenizer="qwen2.5", num_documents=16, docs_per_shard=8)
    return path


@pytest.fixture(scope="module")
def uninterrupted(cache, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "out"
    assert train(train_args(cache, out, *OPTIONS)) == 0
    return out


@pytest.fixture
def stopped(cache, tmp_path) -> Path:
    """A run stopped after its step-4 checkpoint (step-2 and step-4 on disk)."""
    out = tmp_path / "out"
    assert train(train_args(cache, out, *OPTIONS, "--stop-at-step", "4")) == 0
    assert [step for step, _ in complete_checkpoints(out)] == [2, 4]
    return out


def state_file(checkpoint: Path) -> Path:
    return next(p for p in sorted((checkpoint / "state").iterdir()) if p.suffix == ".distcp")


def flip_two_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle] ^= 0xFF
    data[middle + 1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_the_marker_records_every_file_of_the_checkpoint(uninterrupted):
    checkpoint = step_dir(uninterrupted, 6)
    recorded = recorded_digests(checkpoint)
    assert sorted(recorded) == checkpoint_files(checkpoint)
    assert {"state/.metadata", "rank-0.pt", "trainer.pt", "config.json"} <= recorded.keys()
    for name, digest in recorded.items():
        assert digest == file_digest(checkpoint / name), name
    assert json.loads((checkpoint / MARKER).read_text())["step"] == 6


@pytest.mark.parametrize(
    "damage, said",
    [
        (lambda c: flip_two_bytes(state_file(c)), "does not match its recorded digest"),
        (
            lambda c: state_file(c).write_bytes(state_file(c).read_bytes()[:1000]),
            "is truncated: 1,000 bytes",
        ),
        (lambda c: (c / "rank-0.pt").write_bytes(b"x" * 100), "is truncated: 100 bytes"),
        (
            lambda c: (c / "trainer.pt").write_bytes((c / "trainer.pt").read_bytes() + b"\0"),
            "bytes, recorded",
        ),
        (lambda c: (c / "trainer.pt").unlink(), "trainer.pt is missing"),
    ],
    ids=["flipped", "truncated-state", "truncated-rank", "longer", "missing"],
)
def test_each_kind_of_damage_is_named_with_its_file(uninterrupted, tmp_path, damage, said):
    checkpoint = tmp_path / "step-6"
    shutil.copytree(step_dir(uninterrupted, 6), checkpoint)
    assert share_problems(checkpoint, recorded_digests(checkpoint), 0, 1) == []
    damage(checkpoint)
    problems = share_problems(checkpoint, recorded_digests(checkpoint), 0, 1)
    assert len(problems) == 1 and said in problems[0] and str(checkpoint) in problems[0]
    # split over two ranks, the shares together find the same
    shares = [share_problems(checkpoint, recorded_digests(checkpoint), r, 2) for r in (0, 1)]
    assert sorted(shares[0] + shares[1]) == problems and all(len(s) <= 1 for s in shares)


def test_a_damaged_checkpoint_is_named_and_the_run_goes_back_to_the_newest_whole_one(
    cache, stopped, uninterrupted, capsys
):
    flip_two_bytes(state_file(step_dir(stopped, 4)))  # the marker intact, as on a flaky disk
    assert train(train_args(cache, stopped, *OPTIONS)) == 0
    err = capsys.readouterr().err
    damaged = [line for line in err.splitlines() if "is damaged" in line]
    assert len(damaged) == 1 and str(step_dir(stopped, 4)) in damaged[0]
    assert "does not match its recorded digest" in damaged[0]
    assert f"resuming from {step_dir(stopped, 2)}, the newest whole checkpoint" in err
    # from step 2 on, exactly what the uninterrupted run did (step 4 trained again)
    assert read_metrics(stopped) == read_metrics(uninterrupted)
    assert (stopped / "final" / "model.safetensors").read_bytes() == (
        uninterrupted / "final" / "model.safetensors"
    ).read_bytes()


def test_no_whole_checkpoint_is_one_line_and_exit_2_with_nothing_deleted(cache, stopped, capsys):
    for step in (2, 4):
        flip_two_bytes(state_file(step_dir(stopped, step)))
    before = sorted(p.relative_to(stopped) for p in stopped.rglob("*"))
    assert train(train_args(cache, stopped, *OPTIONS)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert sum(line.startswith("stage 2: checkpoint ") for line in err) == 2
    assert "no checkpoint in" in err[-1] and "nothing was deleted" in err[-1]
    assert sorted(p.relative_to(stopped) for p in stopped.rglob("*")) == before


def test_an_explicit_damaged_checkpoint_is_refused(cache, stopped, capsys):
    flip_two_bytes(state_file(step_dir(stopped, 4)))
    args = train_args(cache, stopped, *OPTIONS, "--resume", str(step_dir(stopped, 4)))
    assert train(args) == 2
    assert "does not match its recorded digest" in capsys.readouterr().err


def test_a_checkpoint_from_before_digests_resumes_with_a_warning(cache, stopped, uninterrupted):
    (step_dir(stopped, 4) / MARKER).write_text("step 4\n")  # as markers were written before
    with pytest.warns(UserWarning, match="records no digests"):
        assert train(train_args(cache, stopped, *OPTIONS)) == 0
    assert read_metrics(stopped) == read_metrics(uninterrupted)


def test_a_marker_cut_in_half_is_damage_not_a_checkpoint_from_before_digests(
    cache, stopped, uninterrupted, tmp_path, capsys
):
    """Before: a COMPLETE cut in half did not parse, was read as a marker from before digests,
    and its damaged files were resumed unverified. Only `step N` may resume unverified."""
    marker = step_dir(stopped, 4) / MARKER
    marker.write_bytes(marker.read_bytes()[: marker.stat().st_size // 2])
    flip_two_bytes(state_file(step_dir(stopped, 4)))  # what the marker can no longer tell
    checkpoint = tmp_path / "copy"
    shutil.copytree(step_dir(stopped, 4), checkpoint)
    assert export([str(checkpoint), "--out", str(tmp_path / "model")]) == 2
    assert f"{checkpoint / MARKER} is damaged: it does not parse" in capsys.readouterr().err
    args = train_args(cache, stopped, *OPTIONS, "--resume", str(step_dir(stopped, 4)))
    assert train(args) == 2
    assert f"{marker} is damaged: it does not parse" in capsys.readouterr().err
    assert train(train_args(cache, stopped, *OPTIONS)) == 0
    err = capsys.readouterr().err
    said = f"stage 2: checkpoint {step_dir(stopped, 4)} is damaged: {marker} is damaged"
    assert said in err
    assert f"resuming from {step_dir(stopped, 2)}, the newest whole checkpoint" in err
    assert read_metrics(stopped) == read_metrics(uninterrupted)


def test_export_refuses_a_damaged_checkpoint(stopped, tmp_path, capsys):
    checkpoint = tmp_path / "copy"
    shutil.copytree(step_dir(stopped, 4), checkpoint)
    flip_two_bytes(state_file(checkpoint))
    assert export([str(checkpoint), "--out", str(tmp_path / "model")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not match its recorded digest" in err[0]
    assert not (tmp_path / "model").exists()


def test_a_model_folder_records_its_files_and_eval_refuses_one_damaged_since(
    uninterrupted, tmp_path, capsys
):
    """final/ (and an export, written by the same code) records every file's digest in its
    vocagno.json; `vocagno eval` (any load of a model folder: a teacher, a student's --init)
    checks them first. Before: a flipped byte in final/ evaluated without a word."""
    from apps.cli import main as vocagno
    from pipeline.file_digests import folder_files
    from pipeline.models.model_folder import PROVENANCE_NAME

    model = tmp_path / "final"
    shutil.copytree(uninterrupted / "final", model)
    provenance = json.loads((model / PROVENANCE_NAME).read_text())
    assert sorted(provenance["files"]) == folder_files(model, leave_out=PROVENANCE_NAME)
    assert "model.safetensors" in provenance["files"]
    evaluate = ["eval", "--model", str(model), "--num-docs", "2", "--answer-problems", "0",
                "--accuracy-problems", "0"]  # fmt: skip
    assert vocagno(evaluate) == 0
    capsys.readouterr()
    flip_two_bytes(model / "model.safetensors")
    assert vocagno(evaluate) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1, err
    assert f"the folder is damaged: {model / 'model.safetensors'} does not match its recorded" in err[0]
    del provenance["files"], provenance["digest"]  # as before digests: loaded, with a warning
    (model / PROVENANCE_NAME).write_text(json.dumps(provenance))
    shutil.copy(uninterrupted / "final" / "model.safetensors", model / "model.safetensors")
    assert vocagno(evaluate) == 0
    assert f"its {PROVENANCE_NAME} records no digests: loaded unverified" in capsys.readouterr().err


def test_a_cut_off_metrics_log_is_repaired_on_resume_with_one_line(cache, stopped, capsys):
    log = stopped / "metrics.jsonl"
    data = log.read_bytes()
    log.write_bytes(data[: data.rindex(b'{"step": 4') + 20])  # cut inside step 4's record
    assert train(train_args(cache, stopped, *OPTIONS)) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "was cut off" in line]
    assert len(said) == 1
    assert "kept the records of steps up to 3; no record of step 4 (trained, not logged)" in said[0]
    assert [record["step"] for record in read_metrics(stopped)] == [1, 2, 3, 5, 6]


def test_a_cut_off_vocagno_json_is_damage_not_a_folder_from_before_digests(
    uninterrupted, tmp_path, capsys
):
    """Before: a vocagno.json cut off did not parse and its folder was "loaded unverified"."""
    from apps.cli import main as vocagno
    from pipeline.models.model_folder import PROVENANCE_NAME

    model = tmp_path / "final"
    shutil.copytree(uninterrupted / "final", model)
    record = model / PROVENANCE_NAME
    record.write_bytes(record.read_bytes()[: record.stat().st_size // 2])
    assert vocagno(["eval", "--model", str(model), "--num-docs", "1", "--answer-problems", "0",
                    "--accuracy-problems", "0"]) == 2  # fmt: skip
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and f"{record} is damaged: it does not parse" in err[0], err
