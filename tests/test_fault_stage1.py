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

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.cache.verify import TEMPORARY_GLOB, verify_cache
from stage1_score.pool import UNITS_IN_FLIGHT_PER_WORKER
from stage1_score.run import main
from tests.stage1_helpers import make_tiny_teacher, shipped_documents, write_jsonl_corpus
from tests.test_stage1_run import snapshot

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "stage1_score" / "run.py"
# 16 units of 3 documents; one-window forward batches keep a unit busy long enough to be hit.
NUM_DOCS, DOCS_PER_SHARD = 48, 3
NUM_UNITS = NUM_DOCS // DOCS_PER_SHARD
# Set, to a value of its own, for the processes of a module's Ray cluster (its raylet, the
# workers and the engines they start inherit it): process scans count no other run's.
MARK = "VOCAGNO_TEST_RAY_CLUSTER"
SCORER = b"ray::UnitScorer"  # Ray titles an actor's process so, ".score_unit" added while busy
# Ray starts its workers at nice 15: beside any other load they starve (a worker scored 8-17 tok/s
# beside two busy processes, 138 alone; two finished units missed the 240 s deadline) and the
# deadlines here would time the load. A test cluster's workers compete on equal terms.
UNNICED_WORKERS = ("RAY_worker_niceness", "0")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    return make_tiny_teacher(tmp_path_factory.mktemp("teacher") / "tiny-llama", "tinyllama")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    return write_jsonl_corpus(path, shipped_documents(NUM_DOCS))


@contextlib.contextmanager
def marked_ray_cluster():
    """A local Ray cluster (2 CPUs) whose processes carry MARK; yields its address."""
    import ray

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(MARK, uuid.uuid4().hex)
        patch.setenv(*UNNICED_WORKERS)
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
        try:
            yield ray.get_runtime_context().gcs_address
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def ray_address():
    pytest.importorskip("ray")
    with marked_ray_cluster() as address:
        yield address


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


PACKED = ("--row-packing", "packed", "--attention", "dense")


@pytest.fixture(scope="module")
def packed_reference(ray_address, teacher, corpus, tmp_path_factory) -> dict[str, bytes]:
    """The uninterrupted run's cache with packed rows (whose losses differ from padded rows' by
    fp32 rounding, so its own reference)."""
    out = tmp_path_factory.mktemp("packed-reference") / "cache"
    assert main([*args(teacher, corpus, out, ray_address), *PACKED]) == 0
    return snapshot(out)


def start_run(command: list[str], log: Path) -> subprocess.Popen:
    """The run, started as a shell script's background job (`run.py &`, how CI runners and batch
    scripts often start it) is: with SIGINT ignored, an ignored signal staying so across exec.
    Stage 1 must still stop cleanly on Ctrl-C, as stage 2 does."""
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return subprocess.Popen(
            [sys.executable, str(RUN), *command],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    finally:
        signal.signal(signal.SIGINT, ignored)


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


def marked_pids(*titles: bytes, matches=None) -> list[int]:
    """Processes of the current marked Ray cluster whose title starts with one of `titles`, or
    whose command line `matches(cmdline)` accepts."""
    matches = matches or (lambda cmdline: cmdline.startswith(titles))
    mark = f"{MARK}={os.environ[MARK]}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            title = (entry / "cmdline").read_bytes()
            if matches(title) and mark in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return pids


def busy(pid: int) -> bool:
    """Whether the scorer actor `pid` is running a unit (Ray titles it ray::UnitScorer.score_unit
    until the call returns, before the result goes back to the driver)."""
    try:
        return b"score_unit" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@contextlib.contextmanager
def frozen(*pids: int):
    """The processes stopped (SIGSTOP) for the body, so that what it observes of them still holds
    when it acts: a condition checked in here cannot be overtaken before a signal lands."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # one that ended meanwhile
            os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def act_while_stopped(
    pids: list[int],
    condition,
    action,
    what: str,
    process: subprocess.Popen,
    output,
    timeout: float,
    slice_seconds: float = 0.005,
) -> None:
    """Run `action` once `condition()` holds, looked at only while the processes `pids` are
    stopped (SIGSTOP): what it saw still holds when the action lands. Between looks they run in
    slices of `slice_seconds`, and nothing of a look runs while they do, so a state lasting longer
    than a slice is seen however fast the machine works (polling them while they run can step
    over it: vLLM's tiny teacher scored a unit in 0.1 s on a CI machine, and plain polling saw
    none of the 12 states in time). Fails, naming `what` with `output()`, if `process` ends first
    or `timeout` seconds pass (then `process` is killed)."""
    deadline = time.monotonic() + timeout
    while True:
        with frozen(*pids):
            if process.poll() is not None:
                pytest.fail(f"the run ended (exit {process.returncode}) before {what}: {output()}")
            if condition():
                action()
                return
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"no {what} after {timeout:.0f} s: {output()}")
        time.sleep(slice_seconds)


def signal_mid_run(
    process: subprocess.Popen,
    signum: int,
    condition,
    what: str,
    log: Path,
    unit_finished,
    also_stop=list,
    timeout: float = 240.0,
    slice_seconds: float = 0.01,
) -> None:
    """Send `signum` to the run once `condition()` holds (act_while_stopped), looked at only while
    the driver and the processes `also_stop()` lists once a unit has finished are stopped. The
    driver writes the manifest and hands out the units, so with the driver stopped only the units
    already in flight can still finish. `timeout` covers the wait for the first unit too."""
    deadline = time.monotonic() + timeout
    wait_for(unit_finished, "a finished unit", process, log, timeout)
    act_while_stopped(
        [process.pid, *also_stop()], condition, lambda: process.send_signal(signum), what,
        process, log.read_text, deadline - time.monotonic(), slice_seconds,
    )  # fmt: skip


def mid_run(out: Path, least: int, units: int = NUM_UNITS) -> bool:
    """At least `least` of the run's `units` finished, and units left to score even once the
    ones the driver handed its one worker have finished (so no manifest either)."""
    return least <= len(finished_units(out)) < units - UNITS_IN_FLIGHT_PER_WORKER


def finished_shards(out: Path) -> dict[str, int]:
    """The finished units' shards (a sidecar says finished), with their modification times."""
    shards = (sidecar.with_suffix(".parquet") for sidecar in finished_units(out))
    return {shard.name: shard.stat().st_mtime_ns for shard in shards}


def gone_within(pids: list[int], seconds: float) -> bool:
    """Whether every one of `pids` has ended within `seconds`."""
    deadline = time.monotonic() + seconds
    while any(Path(f"/proc/{pid}").exists() for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def seen_when(condition, seen: list[int], *titles: bytes):
    """`condition`, which also records into `seen` the marked processes alive when it held (looked
    at while the run is stopped: they were alive when the signal landed)."""

    def check() -> bool:
        if not condition():
            return False
        seen[:] = marked_pids(*titles)
        return True

    return check


def none_left(*titles: bytes, timeout: float = 60.0) -> None:
    """No marked process with these titles is left within `timeout` (Ray ends a dead driver's
    actors, and with them their engines, in its own time); see wait_until_gone for the form
    that first saw them alive."""
    deadline = time.monotonic() + timeout
    while marked_pids(*titles) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marked_pids(*titles) == []


def wait_until_gone(seen: list[int], *titles: bytes, timeout: float = 60.0) -> None:
    """Ray ends a dead driver's actors (and with them their engines) in its own time: the ones
    `seen` alive at the kill end, and no other with these titles is left."""
    assert seen, "no marked process was seen alive at the kill: nothing to see gone"
    assert gone_within(seen, timeout), "the killed run's processes live on"
    none_left(*titles, timeout=timeout)


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
    scorers: list[int] = []
    signal_mid_run(
        process,
        signal.SIGKILL,
        seen_when(lambda: mid_run(out, 2), scorers, SCORER),
        "two finished units",
        log,
        lambda: finished_units(out),
    )
    process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL
    # Ray ends the dead driver's actors; the rerun must not race a leftover writer.
    wait_until_gone(scorers, SCORER)
    assert not (out / "manifest.json").exists()  # killed mid-run, not after it
    # Every unit the killed run finished, its actor's last writes included.
    kept = finished_shards(out)
    assert 2 <= len(kept) < NUM_UNITS

    assert main(command) == 0  # the flock died with the driver: no stale lock
    assert_equal_to_reference(out, reference, corpus)
    # Every finished unit was kept, none scored again.
    assert {name: (out / name).stat().st_mtime_ns for name in kept} == kept


# with --unit-overlap on, the killed worker held two units at once, both to be scored again; and
# with packed rows too (both GPU defaults)
@pytest.mark.parametrize(
    "switches",
    [("--unit-overlap", "off"), ("--unit-overlap", "on"), ("--unit-overlap", "on", *PACKED)],
    ids=["serial", "overlap", "overlap-packed"],
)
def test_worker_killed_mid_unit_recovers_or_fails_clearly_and_rerun_is_identical(
    ray_address, teacher, corpus, reference, packed_reference, tmp_path, switches
):
    if "packed" in switches:
        reference = packed_reference
    out, log = tmp_path / "cache", tmp_path / "run.log"
    command = [*args(teacher, corpus, out, ray_address), *switches]
    process = start_run(command, log)
    wait_for(lambda: finished_units(out), "a finished unit", process, log)

    def busy_scorers() -> list[int]:
        return [pid for pid in marked_pids(SCORER) if busy(pid)]

    while True:  # until a scorer is caught busy: stopped, it cannot finish before the kill
        victim = wait_for(busy_scorers, "a busy scorer", process, log)[0]
        with frozen(victim):
            if busy(victim):
                os.kill(victim, signal.SIGKILL)
                break
    process.wait(timeout=300)
    output = log.read_text()
    assert "Traceback" not in output, output[-3000:]
    if process.returncode != 0:  # Ray gave up on the actor: one clear line, finished units kept
        last = output.strip().splitlines()[-1]
        assert last.startswith("stage1: error: a scoring worker died while scoring unit"), output
        assert "run the same command again to resume" in last
        assert main(command) == 0
    # Here the pool gives the lost worker's units to a replacement: the run finishes by itself;
    # either way the cache is the uninterrupted one.
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
    signal_mid_run(
        process,
        signum,
        lambda: mid_run(out, 2),
        "two finished units",
        log,
        lambda: finished_units(out),
    )
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
