"""A file system that fills while stage 1 writes a shard or stage 2 saves a checkpoint is one line:
where, how much was free (and needed), and what is kept; what is kept verifies and the run goes on
from it once there is space. Needs a small tmpfs, so root (skipped elsewhere)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from pipeline.cache.verify import verify_cache
from pipeline.file_digests import share_problems
from stage1_score.run import main as score
from stage2_train.checkpoint import complete_checkpoints
from stage2_train.checkpoint_digests import recorded_digests
from stage2_train.train import main as train
from tests.cache_fixtures import build_cache
from tests.stage1_helpers import make_tiny_teacher, shipped_documents, write_jsonl_corpus
from tests.stage2_runs import read_metrics, train_args
from tests.test_stage1_run import ray_cluster  # noqa: F401 (a module-scoped fixture)

ROOM_LEFT = 64 << 10  # bytes left free on the small disk for stage 1: unit 0 fits, unit 1 not
OPTIONS = ("--max-steps", "6", "--save-every", "2", "--num-workers", "0")


def mounted_tmpfs(mount, size: str):
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                          capture_output=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    """A 70 MiB tmpfs: room for one checkpoint of the tiny student (48 MiB), not two."""
    yield from mounted_tmpfs(tmp_path / "small", "70M")


def one_error_line(capsys) -> str:
    said = capsys.readouterr().err
    err = [line for line in said.splitlines() if "error:" in line]
    assert len(err) == 1 and "Traceback" not in said, said
    return err[0]


@pytest.mark.usefixtures("ray_cluster")
def test_a_disk_that_fills_while_stage1_writes_a_shard_is_one_line_and_the_rerun_resumes(
    tmp_path, capsys
):
    """Before: Ray's remote traceback (ray::UnitScorer.score_unit() ...) ending in pyarrow's
    OSError, naming no path. One short document in unit 0, a long one in unit 1, one worker: the
    disk is filled so that unit 0 fits and unit 1 does not."""
    teacher = make_tiny_teacher(tmp_path / "teacher", "tinyllama")
    short, *rest = shipped_documents(40)
    long = ("long", "\n\n".join(text for _, text in rest) * 2)
    corpus = write_jsonl_corpus(tmp_path / "docs.jsonl", [short, long])
    options = ["--teacher", str(teacher), "--corpus", str(corpus), "--id-column", "id",
               "--docs-per-shard", "1", "--max-length", "64", "--num-workers", "1",
               "--topk-probs", "8", "--topk-encoding", "float16"]  # fmt: skip  # the larger shards
    disk = mounted_tmpfs(tmp_path / "small", "8M")
    mount = next(disk)
    filler = mount / "filler"
    free = os.statvfs(mount)
    filler.write_bytes(b"\0" * (free.f_bavail * free.f_frsize - ROOM_LEFT))
    out = mount / "cache"
    try:
        assert score([*options, "--out", str(out)]) == 2
        err = one_error_line(capsys)
        assert f"no space left on the file system of {out} while writing unit 1's shard" in err
        assert "MiB free); the finished units are kept: free space and run the same command" in err
        units = sorted(p.name for p in out.iterdir() if p.name.startswith("shard"))
        assert units == ["shard-000000.json", "shard-000000.parquet"]  # unit 0's shard, sidecar
        assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]  # no temporary
        kept = out / "shard-000000.parquet"
        before = (kept.read_bytes(), kept.stat().st_mtime_ns)
        filler.unlink()
        assert score([*options, "--out", str(out)]) == 0
        assert verify_cache(out)[1] == []
        assert (kept.read_bytes(), kept.stat().st_mtime_ns) == before  # kept, not written again
        sizes = [(out / f"shard-00000{i}.parquet").stat().st_size for i in (0, 1)]
        assert sizes[0] < ROOM_LEFT // 4 and sizes[1] > 2 * ROOM_LEFT, sizes  # the design held
    finally:
        next(disk, None)


def test_a_disk_that_fills_during_a_save_is_one_line_and_the_run_resumes_elsewhere(
    small_disk, tmp_path, capsys
):
    cache = tmp_path / "cache"
    build_cache(cache, teacher_tokenizer="qwen2.5", num_documents=16, docs_per_shard=8)
    out = small_disk / "out"
    assert train(train_args(cache, out, *OPTIONS)) == 2
    err = one_error_line(capsys)
    assert f"no space left on the file system of {out / 'checkpoints'}" in err
    assert "while writing checkpoint step-4" in err and "MiB needed" in err
    assert "the checkpoints up to step 2 and metrics.jsonl are kept" in err
    [(step, kept)] = complete_checkpoints(out)
    assert step == 2 and share_problems(kept, recorded_digests(kept), 0, 1) == []
    # with space (the run moved to a larger disk), the same command goes on from step 2
    moved = tmp_path / "out"
    shutil.copytree(out, moved, ignore=shutil.ignore_patterns(".step-*.partial"))
    assert train(train_args(cache, moved, *OPTIONS)) == 0
    uninterrupted = tmp_path / "uninterrupted"
    assert train(train_args(cache, uninterrupted, *OPTIONS)) == 0
    assert read_metrics(moved) == read_metrics(uninterrupted)
