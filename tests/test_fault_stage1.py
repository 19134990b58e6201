"""Stage 1 under real faults: the driver SIGKILLed mid-run, a Ray worker SIGKILLed mid-unit, and
the driver stopped by SIGINT or SIGTERM. Each way the same command run again finishes the cache, and it equals an uninterrupted run's
byte for byte: every shard, sidecar, producer record and the manifest, no document twice or
missing, no temporary file left.

The test process owns one local Ray cluster (2 CPUs); the killed runs are real
`python stage1_score/run.py` processes that join it with --ray-address, so killing them never
orphans a cluster. Covered elsewhere, cited in docs/fault-tolerance.md: two runs on one folder
(test_stage1_run.py::test_a_second_run_on_a_locked_folder_refuses), damaged shards
(test_cache_verify.py, test_stage2_data.py, test_fuzz_shards.py).

Marked slow: three 16-unit runs and the cluster take minutes on 2 shared cores (4.6 min
measured here under load). The default run keeps the resume proofs that need no kill
(test_stage1_run.py::test_rerun_is_byte_identical_and_recomputes_only_a_missing_shard).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.cache.verify import TEMPORARY_GLOB, verify_cache
from stage1_score.run import main
from tests.stage1_helpers import make_tiny_teacher, shipped_documents, write_jsonl_corpus
from tests.test_stage1_run import snapshot

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "stage1_score" / "run.py"
# 16 units of 3 documents; one-window forward batches keep a unit busy long enough to be hit.
NUM_DOCS, DOCS_PER_SHARD = 48, 3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    return make_tiny_teacher(tmp_path_factory.mktemp("teacher") / "tiny-llama", "tinyllama")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    return write_jsonl_corpus(path, shipped_documents(NUM_DOCS))


@pytest.fixture(scope="module")
def ray_address():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def args(teacher: Path, corpus: Path, out: Path, address: str) -> list[str]:
    return [
        "--teacher", str(teacher), "--corpus", str(corpus), "--out", str(out),
        "--id-column", "id", "--docs-per-shard", str(DOCS_PER_SHARD), "--max-length", "64",
        "--stride", "32", "--batch-tokens", "64", "--num-workers", "1",
        "--progress-seconds", "1", "--ray-address", address,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def reference(ray_address, teacher, corpus, tmp_path_factory) -> dict[str, bytes]:
    """The uninterrupted run's cache (in-process: it joins the same cluster)."""
    out = tmp_path_factory.mktemp("reference") / "cache"
    assert main(args(teacher, corpus, out, ray_address)) == 0
    return snapshot(out)


def start_run(command: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(RUN), *command],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def wait_for(condition, what: str, process: subprocess.Popen, log: Path, timeout=240.0):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        if process.poll() is not None:
            pytest.fail(
                f"the run ended (exit {process.returncode}) before {what}: {log.read_text()}"
            )
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"no {what} after {timeout:.0f} s: {log.read_text()}")
        time.sleep(0.05)
    return found


def scorer_pids(busy_only: bool = False) -> list[int]:
    """Ray actor processes of the scorer (Ray titles them ray::UnitScorer[.method])."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if title.startswith("ray::UnitScorer") and (not busy_only or "score_unit" in title):
            pids.append(int(entry.name))
    return pids


def finished_units(out: Path) -> list[Path]:
    return sorted(out.glob("shard-*.json"))


def assert_equal_to_reference(out: Path, reference: dict[str, bytes], corpus: Path) -> None:
    assert not list(out.glob(TEMPORARY_GLOB))
    assert snapshot(out) == reference  # byte for byte, manifest included
    manifest, problems = verify_cache(out)
    assert problems == []
    ids = [i for s in manifest.shards for i in pq.read_table(out / s.file)["doc_id"].to_pylist()]
    expected = [json.loads(line)["id"] for line in corpus.read_text().splitlines()]
    assert ids == expected  # each document once, in corpus order


def test_driver_killed_mid_run_then_rerun_equals_the_uninterrupted_cache(
    ray_address, teacher, corpus, reference, tmp_path
):
    out, log = tmp_path / "cache", tmp_path / "killed.log"
    command = args(teacher, corpus, out, ray_address)
    process = start_run(command, log)
    wait_for(lambda: len(finished_units(out)) >= 2, "two finished units", process, log)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL
    assert not (out / "manifest.json").exists()  # killed mid-run, not after it
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.parquet")}
    assert 2 <= len(kept) < NUM_DOCS // DOCS_PER_SHARD
    # Ray ends the dead driver's actors; the rerun must not race a leftover writer.
    deadline = time.monotonic() + 60
    while scorer_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert scorer_pids() == []

    assert main(command) == 0  # the flock died with the driver: no stale lock
    assert_equal_to_reference(out, reference, corpus)
    # Finished units were kept, not scored again.
    assert any((out / name).stat().st_mtime_ns == mtime for name, mtime in kept.items())


def test_worker_killed_mid_unit_recovers_or_fails_clearly_and_rerun_is_identical(
    ray_address, teacher, corpus, reference, tmp_path
):
    out, log = tmp_path / "cache", tmp_path / "run.log"
    command = args(teacher, corpus, out, ray_address)
    process = start_run(command, log)
    wait_for(lambda: finished_units(out), "a finished unit", process, log)
    victim = wait_for(lambda: scorer_pids(busy_only=True), "a busy scorer", process, log)[0]
    os.kill(victim, signal.SIGKILL)
    process.wait(timeout=300)
    output = log.read_text()
    assert "Traceback" not in output, output[-3000:]
    if process.returncode != 0:  # Ray gave up on the actor: one clear line, finished units kept
        last = output.strip().splitlines()[-1]
        assert last.startswith("stage1: error: a scoring worker died while scoring unit"), output
        assert "run the same command again to resume" in last
        assert main(command) == 0
    # Here Ray restarts the actor and retries the unit (max_restarts/max_task_retries): the run
    # finishes by itself; either way the cache is the uninterrupted one.
    assert_equal_to_reference(out, reference, corpus)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_ends_the_run_cleanly_and_the_rerun_equals_the_uninterrupted_cache(
    ray_address, teacher, corpus, reference, tmp_path, signum
):
    """Ctrl-C or SIGTERM (Slurm, Kubernetes, `ray job stop`): no traceback, one line saying how to
    resume, exit 128 + signal, finished units kept and no partial file left."""
    out, log = tmp_path / "cache", tmp_path / "stopped.log"
    command = args(teacher, corpus, out, ray_address)
    process = start_run(command, log)
    wait_for(lambda: len(finished_units(out)) >= 2, "two finished units", process, log)
    process.send_signal(signum)
    process.wait(timeout=120)
    output = log.read_text()
    assert process.returncode == 128 + signum, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert output.strip().splitlines()[-1] == (
        "stage1: interrupted; rerun the same command to resume"
    )
    assert not list(out.glob(TEMPORARY_GLOB)) and not (out / "manifest.json").exists()
    assert main(command) == 0  # the lock was released
    assert_equal_to_reference(out, reference, corpus)
