"""Stage 1 never hangs (issue #26 item 3), run as a user runs it: `python stage1_score/run.py`
as a real process.

- A Ray address where nothing answers (`--ray-address` or RAY_ADDRESS) is refused in one line
  naming it, exit 2, before the output folder is made; without the check, ray.init retried such
  an address for many minutes, printing only warnings. So is a TMPDIR too long for a local
  Ray's sockets, naming RAY_TMPDIR.
- SIGTERM while Ray starts, while the first unit is scored, or after units were finished ends the
  run within STOP_SECONDS (one line, exit 143) and leaves nothing a rerun or `vocagno cache`
  could misread: no output folder when no unit was finished (also once the killed scorer is
  gone, so no unit lands after the cleanup), the finished units when some were, and the rerun
  resumes from them.

The refusals need no Ray and run by default (2 s each, 7 s for the long TMPDIR, 12 s for the
address that drops connections); the stop signals need a Ray cluster and a run that starts its
workers (15 to 30 s each on 2 shared cores, 75 s for the three with the cluster), so they are
marked slow.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

from pipeline.cache.manifest import PRODUCER_NAME
from pipeline.cache.verify import verify_cache
from stage1_score.cluster import PROBE_SECONDS
from stage1_score.run import main
from tests.stage1_helpers import make_tiny_teacher, shipped_documents, write_jsonl_corpus
from tests.test_fault_stage1 import frozen, gone_within, wait_for

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "stage1_score" / "run.py"
NUM_DOCS = 12
# A deadline for a refusal that tells it from a hang: Ray's own behaviour at a dead address is
# minutes of retries (its first attempt alone takes 41 s). Measured: 2 s on a quiet machine, or
# PROBE_SECONDS more where packets drop; a run started beside a busy experiment took over 30 s
# to import and exit, so the bound is loose and the refusal's path is what each test checks (its
# line, PROBE_SECONDS in it, and no Ray retry in the log).
REFUSAL_SECONDS = 120.0
# From SIGTERM to the exit; measured 3 to 7 s on 2 cores under a load of about 10.
STOP_SECONDS = 15.0
INTERRUPTED = "stage1: interrupted; rerun the same command to resume"
MARK = "VOCAGNO_NO_HANG_RUN"  # in the environment of a test's runs and of the Ray they start
SCORER = b"ray::UnitScorer"


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    return make_tiny_teacher(tmp_path_factory.mktemp("teacher") / "tiny-llama", "tinyllama")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    return write_jsonl_corpus(path, shipped_documents(NUM_DOCS))


def args(teacher: Path, corpus: Path, out: Path, docs_per_shard: int, *extra: str) -> list[str]:
    return [
        "--teacher", str(teacher), "--corpus", str(corpus), "--out", str(out),
        "--id-column", "id", "--docs-per-shard", str(docs_per_shard), "--max-length", "64",
        "--stride", "32", "--batch-tokens", "64", "--num-workers", "1", *extra,
    ]  # fmt: skip


def start_run(command: list[str], log: Path, **env: str | None) -> subprocess.Popen:
    """`run.py command` with `env` added to this process's environment (None: removed)."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    environment = {name: value for name, value in environment.items() if value is not None}
    return subprocess.Popen(
        [sys.executable, str(RUN), *command],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=environment,
    )


def ended_within(process: subprocess.Popen, seconds: float, log: Path) -> float:
    """Seconds the process took to end; fails (and kills it) past `seconds`."""
    start = time.monotonic()
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        pytest.fail(f"still running {seconds:.0f} s later: {log.read_text()[-3000:]}")
    return time.monotonic() - start


def last_line(log: Path) -> str:
    output = log.read_text()
    assert "Traceback" not in output, output[-3000:]
    return output.strip().splitlines()[-1]


def marked_pids(mark: str, title: bytes = b"") -> list[int]:
    """Processes whose title starts with `title` and whose environment carries MARK=mark: those
    of one run, or of the test's cluster."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if (entry / "cmdline").read_bytes().startswith(title):
                if f"{MARK}={mark}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
        except OSError:
            continue
    return pids


# --- an address where nothing answers -------------------------------------------------------


@pytest.mark.parametrize("given_by", ["RAY_ADDRESS", "--ray-address"])
def test_a_ray_address_where_nothing_listens_is_one_line_naming_it(
    teacher, corpus, tmp_path, given_by
):
    """Port 1 on this machine: nothing listens (binding it needs root), so the connection is
    refused at once."""
    out, log, address = tmp_path / "cache", tmp_path / "run.log", "127.0.0.1:1"
    if given_by == "RAY_ADDRESS":
        process = start_run(args(teacher, corpus, out, 3), log, RAY_ADDRESS=address)
    else:
        command = args(teacher, corpus, out, 3, "--ray-address", address)
        process = start_run(command, log, RAY_ADDRESS=None)
    seconds = ended_within(process, REFUSAL_SECONDS, log)
    assert process.returncode == 2, log.read_text()
    line = last_line(log)
    assert line.startswith(f"stage1: error: no Ray cluster answers at {address} ({given_by}"), line
    assert "Connection refused" in line, line
    assert "Failed to connect" not in log.read_text()  # no Ray retry ran
    assert not out.exists()
    print(f"refused in {seconds:.1f} s: {line}")


def leftover_address(monkeypatch, tmp_path) -> str:
    """What `ray start --head` leaves in RAY_TMPDIR/ray/ray_current_cluster, for a cluster whose
    processes have since died (no `ray stop`): an address where nothing listens."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:1\n")
    from stage1_score.cluster import ray_target

    return ray_target(None).host_port  # as ray.init(None) would try it: this machine's address


def test_a_dead_local_clusters_leftover_address_is_passed_over_for_a_new_local_ray(
    monkeypatch, tmp_path
):
    """Before: refused (`no Ray cluster answers at ... (the Ray cluster last started on this
    machine: Connection refused)`), though --help promises a new local Ray where none runs. An
    address the user gives is still refused (the tests above)."""
    from stage1_score.cluster import ray_target, reachable_ray_address

    address = leftover_address(monkeypatch, tmp_path)
    assert address.endswith(":1")
    said = []
    assert reachable_ray_address(None, said.append) == "local"
    assert ray_target("local").host_port is None  # ray.init("local") starts a new Ray
    assert len(said) == 1 and said[0].startswith(
        f"the Ray cluster last started on this machine ({address}) no longer answers "
        "(Connection refused): starting a new local Ray for this run"
    ), said


@pytest.mark.slow
def test_a_run_beside_a_dead_local_clusters_address_scores_on_a_new_local_ray(
    teacher, corpus, tmp_path, monkeypatch
):
    folder = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths
    try:
        address = leftover_address(monkeypatch, folder)
        out, log = tmp_path / "cache", tmp_path / "run.log"
        process = start_run(args(teacher, corpus, out, 6), log, **{MARK: uuid.uuid4().hex})
        ended_within(process, 240, log)
        output = log.read_text()
        assert process.returncode == 0, output[-3000:]
        assert f"({address}) no longer answers (Connection refused)" in output
        assert verify_cache(out)[1] == []
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def black_hole():
    """An address that drops connection requests, as a host gone or a firewall does: a listener
    whose queue of unaccepted connections is full (Linux then drops further SYNs). Bound to every
    interface, since Ray reaches 127.0.0.1 through the machine's own address."""
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    filler = socket.create_connection(("127.0.0.1", port), timeout=5)
    control = socket.socket()
    control.settimeout(1.0)
    with pytest.raises(TimeoutError):  # the control: the address really drops connections
        control.connect(("127.0.0.1", port))
    control.close()
    yield f"127.0.0.1:{port}"
    filler.close()
    listener.close()


def test_a_ray_address_that_drops_connections_is_refused_after_the_probe(
    teacher, corpus, tmp_path, black_hole
):
    out, log = tmp_path / "cache", tmp_path / "run.log"
    command = args(teacher, corpus, out, 3, "--ray-address", black_hole)
    process = start_run(command, log, RAY_ADDRESS=None)
    seconds = ended_within(process, REFUSAL_SECONDS, log)
    assert process.returncode == 2, log.read_text()
    line = last_line(log)
    assert line.startswith(f"stage1: error: no Ray cluster answers at {black_hole} "), line
    assert f"no answer in {PROBE_SECONDS:.0f} s" in line, line
    assert "Failed to connect" not in log.read_text()  # no Ray retry ran
    assert not out.exists()
    print(f"refused in {seconds:.1f} s: {line}")


def test_a_temporary_folder_too_long_for_rays_sockets_is_one_line_naming_the_fix(
    teacher, corpus, tmp_path
):
    """A local Ray puts its sockets under TMPDIR, and a socket's path takes at most 107 bytes:
    ray.init raised an OSError naming the path; the run says which setting moves them."""
    out, log, temporary = tmp_path / "cache", tmp_path / "run.log", tmp_path / ("t" * 60)
    temporary.mkdir()
    process = start_run(args(teacher, corpus, out, 3), log, RAY_ADDRESS=None, RAY_TMPDIR=None,
                        TMPDIR=str(temporary))  # fmt: skip
    ended_within(process, REFUSAL_SECONDS, log)
    assert process.returncode == 2, log.read_text()
    line = last_line(log)
    assert line.startswith("stage1: error: ") and "AF_UNIX" in line, line
    assert line.endswith("set RAY_TMPDIR to a shorter folder, e.g. RAY_TMPDIR=/tmp"), line
    assert not out.exists()


# --- SIGTERM ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_address():
    """A local Ray cluster (2 CPUs) owned by the test process, joined by the runs as a cluster
    is under `ray job submit`; its processes carry this process's MARK."""
    ray = pytest.importorskip("ray")
    os.environ[MARK] = uuid.uuid4().hex
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        del os.environ[MARK]


def child_named(pid: int, name: str) -> bool:
    """Whether process `pid` has a child process called `name`."""
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            command, after = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") :]
            if command == name and after.split()[2] == str(pid):
                return True
    return False


@pytest.mark.slow
def test_sigterm_while_ray_starts_ends_the_run_and_leaves_no_folder(teacher, corpus, tmp_path):
    """`--ray-address local`: the run starts a Ray of its own, and SIGTERM lands inside ray.init
    (whose own SIGTERM handler exits 15 at once, skipping the cleanup and the line)."""
    out, log, mark = tmp_path / "cache", tmp_path / "run.log", uuid.uuid4().hex
    process = start_run(
        args(teacher, corpus, out, 3, "--ray-address", "local"), log, **{MARK: mark}
    )
    wait_for(lambda: child_named(process.pid, "gcs_server"), "Ray's GCS process", process, log)
    # the run's descendants: Ray's processes it started (GCS, raylet, ...), seen before the signal
    started = [child.pid for child in psutil.Process(process.pid).children(recursive=True)]
    assert started, "no Ray process of the run was seen: the check below would hold vacuously"
    with frozen(process.pid):  # the signal lands before ray.init has returned
        assert "Ray cluster at" not in log.read_text()
        process.send_signal(signal.SIGTERM)
    seconds = ended_within(process, STOP_SECONDS, log)
    assert process.returncode == 128 + signal.SIGTERM, log.read_text()[-3000:]
    assert last_line(log) == INTERRUPTED
    assert not out.exists()
    assert gone_within(started, 30.0), "the Ray processes the run started outlived it"
    print(f"stopped in {seconds:.1f} s")


@pytest.mark.slow
def test_sigterm_while_the_first_unit_is_scored_leaves_no_folder(
    ray_address, teacher, corpus, tmp_path
):
    """One unit of every document, so it is in flight when the signal lands (its scorer stopped
    meanwhile). Once the driver has cleaned up and printed its line, the driver is stopped and
    the scorer let go on: a scorer left alive would publish its unit into the removed folder.
    (The driver leaves Ray before it cleans up, and Ray ends the actors of a driver that left.)"""
    out, log = tmp_path / "cache", tmp_path / "run.log"
    process = start_run(args(teacher, corpus, out, NUM_DOCS, "--ray-address", ray_address), log)
    scorer = wait_for(
        lambda: [p for p in marked_pids(os.environ[MARK], SCORER) if _scoring(p)],
        "a scorer on the first unit",
        process,
        log,
    )
    with frozen(*scorer):
        assert not list(out.glob("shard-*"))  # and none can be finished while it is stopped
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        wait_for(lambda: INTERRUPTED in log.read_text(), "the stop's line", process, log)
        cleaned_up = time.monotonic() - signalled
        os.kill(process.pid, signal.SIGSTOP)
    try:  # the scorer runs again; the driver has not exited
        assert gone_within(scorer, 60.0), "the stopped run's scorer lives on"
        assert not out.exists(), sorted(p.name for p in out.iterdir())
    finally:
        os.kill(process.pid, signal.SIGCONT)
    exiting = ended_within(process, STOP_SECONDS, log)
    assert cleaned_up < STOP_SECONDS, cleaned_up
    assert process.returncode == 128 + signal.SIGTERM, log.read_text()[-3000:]
    assert last_line(log) == INTERRUPTED
    assert not out.exists()
    print(f"stopped in {cleaned_up + exiting:.1f} s ({cleaned_up:.1f} s to its line)")


def _scoring(pid: int) -> bool:
    """Whether the scorer actor `pid` is running a unit (Ray titles it ray::UnitScorer.score_unit
    until the call returns)."""
    try:
        return b"score_unit" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@pytest.mark.slow
def test_sigterm_after_a_finished_unit_keeps_it_and_the_rerun_resumes(
    ray_address, teacher, corpus, tmp_path, capsys
):
    out, log = tmp_path / "cache", tmp_path / "run.log"
    command = args(teacher, corpus, out, 3, "--ray-address", ray_address)
    process = start_run(command, log)
    wait_for(lambda: list(out.glob("shard-*.json")), "a finished unit", process, log)
    process.send_signal(signal.SIGTERM)
    seconds = ended_within(process, STOP_SECONDS, log)
    assert process.returncode == 128 + signal.SIGTERM, log.read_text()[-3000:]
    assert last_line(log) == INTERRUPTED
    assert (out / PRODUCER_NAME).is_file() and not (out / "manifest.json").exists()
    units = len(list(out.glob("shard-*.json")))  # sidecars: a unit is finished once it has one
    kept = {p.name: p.read_bytes() for p in out.glob("shard-*")}  # shards and sidecars
    assert units >= 1

    assert main(command) == 0  # the same command, in-process on the same cluster
    assert f"({units} from an earlier run)" in capsys.readouterr().err
    assert {name: (out / name).read_bytes() for name in kept} == kept
    manifest, problems = verify_cache(out)
    assert problems == [] and manifest.total_rows == NUM_DOCS
    print(f"stopped in {seconds:.1f} s, keeping {units} unit(s) that the rerun resumed")
