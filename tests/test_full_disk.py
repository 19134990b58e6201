"""A file system that fills while stage 2 saves is one line: where, how much was free and needed,
and what is kept; the kept checkpoint verifies and the run resumes from it once there is space.
Needs a small tmpfs, so root (skipped elsewhere)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from stage2_train.checkpoint import complete_checkpoints
from stage2_train.checkpoint_digests import recorded_digests, share_problems
from stage2_train.train import main as train
from tests.cache_fixtures import build_cache
from tests.stage2_runs import read_metrics, train_args

OPTIONS = ("--max-steps", "6", "--save-every", "2", "--num-workers", "0")


@pytest.fixture
def small_disk(tmp_path):
    """A 70 MiB tmpfs: room for one checkpoint of the tiny student (48 MiB), not two."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=70M", "tmpfs", str(mount)],
                          capture_output=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_disk_that_fills_during_a_save_is_one_line_and_the_run_resumes_elsewhere(
    small_disk, tmp_path, capsys
):
    cache = tmp_path / "cache"
    build_cache(cache, teacher_tokenizer="qwen2.5", num_documents=16, docs_per_shard=8)
    out = small_disk / "out"
    assert train(train_args(cache, out, *OPTIONS)) == 2
    said = capsys.readouterr().err
    err = [line for line in said.splitlines() if "error:" in line]
    assert len(err) == 1 and "Traceback" not in said, said
    assert f"no space left on the file system of {out / 'checkpoints'}" in err[0]
    assert "while writing checkpoint step-4" in err[0] and "MiB needed" in err[0]
    assert "the checkpoints up to step 2 and metrics.jsonl are kept" in err[0]
    [(step, kept)] = complete_checkpoints(out)
    assert step == 2 and share_problems(kept, recorded_digests(kept), 0, 1) == []
    # with space (the run moved to a larger disk), the same command goes on from step 2
    moved = tmp_path / "out"
    shutil.copytree(out, moved, ignore=shutil.ignore_patterns(".step-*.partial"))
    assert train(train_args(cache, moved, *OPTIONS)) == 0
    uninterrupted = tmp_path / "uninterrupted"
    assert train(train_args(cache, uninterrupted, *OPTIONS)) == 0
    assert read_metrics(moved) == read_metrics(uninterrupted)
