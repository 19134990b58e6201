"""Stage 1 on a Ray cluster of several nodes, submitted from outside it as on a real cluster.

The cluster is three raylets on this machine, started as on a VM cluster: a head with no CPUs
(`ray start --head`, it runs the job's driver) and two worker nodes of one CPU each (`ray start
--address`, distinct `--resources`). The job goes in with `ray job submit --working-dir SRC`,
where SRC is a copy of the code plus a corpus of three files and the teacher, deleted as soon as
Ray has taken it: the job can only run from Ray's copies, with paths relative to them; only the
cache folder (--out) is a path every node sees, as a shared filesystem is on a real cluster. (The
driver's copy is deleted when it joins Ray: the corpus's second file failed to open before the run
held its files elsewhere.)

- Undisturbed, the units are scored on both worker nodes (the run record names each unit's node).
- One worker node killed (every process of it SIGKILLed, as when a machine is lost) once the
  first shard is published, at a moment when its worker is inside a unit: the job still
  succeeds, the lost worker's units are scored again on the other node, and the cache equals the
  undisturbed run's byte for byte.
- `--out` inside the shipped working directory is refused in one line: the job found Ray's copy.

Marked slow: three nodes and two jobs on 2 shared cores take minutes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from apps.demo.ray_cluster import follow, local_ray_cluster, submit, worker_node
from pipeline.cache.manifest import RUN_RECORD_NAME
from pipeline.cache.verify import TEMPORARY_GLOB, verify_cache
from pipeline.errors import VocagnoError
from tests.stage1_helpers import make_tiny_teacher, shipped_documents, write_jsonl_corpus
from tests.test_fault_stage1 import UNNICED_WORKERS, busy, frozen
from tests.test_stage1_run import snapshot

REPO = Path(__file__).resolve().parents[1]
NUM_DOCS, DOCS_PER_SHARD = 24, 3  # 8 units for 2 workers
CORPUS_FILES = 3
NODES = ("node_a", "node_b")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Head (0 CPUs) plus two worker nodes of 1 CPU; yields (cluster, {resource: node process})."""
    pytest.importorskip("ray")
    from ray.util.state import list_nodes

    logs = tmp_path_factory.mktemp("ray-logs")
    with pytest.MonkeyPatch.context() as patch, contextlib.ExitStack() as stack:
        # The nodes import nothing from this checkout: the job's code is Ray's copy.
        patch.delenv("PYTHONPATH", raising=False)
        patch.setenv("OMP_NUM_THREADS", "1")
        # This process's Ray client may have read its (default) mode already: the cluster follows.
        patch.setenv("RAY_AUTH_MODE", "disabled")
        # A raylet registers in 30 s by default, too short on 2 cores shared with other jobs.
        patch.setenv("RAY_raylet_start_wait_time_s", "300")
        patch.setenv(*UNNICED_WORKERS)
        head = stack.enter_context(local_ray_cluster(0, logs / "head.log"))
        nodes = {}
        for count, name in enumerate(NODES, start=2):  # one at a time: each raylet registers
            log = logs / f"{name}.log"
            nodes[name] = stack.enter_context(worker_node(head, 1, {name: 1}, log))
            deadline = time.monotonic() + 300
            while len(list_nodes(address=head.address, filters=[("state", "=", "ALIVE")])) < count:
                assert nodes[name].poll() is None, log.read_text()[-2000:]
                assert time.monotonic() < deadline, f"{name} did not join"
                time.sleep(1)
        yield head, nodes


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """What the submitting machine ships: the code, a corpus and a tiny teacher."""
    src = tmp_path_factory.mktemp("src")
    for package in ("pipeline", "stage1_score"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    # A corpus of several files: the driver opens the first before it joins Ray and the others
    # after, when its node's copy of the working directory must still be there.
    documents = shipped_documents(NUM_DOCS)
    (src / "corpus").mkdir()
    for part in range(CORPUS_FILES):
        write_jsonl_corpus(src / "corpus" / f"part-{part}.jsonl", documents[part::CORPUS_FILES])
    make_tiny_teacher(src / "teacher", "tinyllama")
    return src


def entrypoint(out: Path) -> list[str]:
    """The job's command, run in Ray's copy of the working dir: corpus and teacher are relative."""
    return [
        sys.executable, "stage1_score/run.py", "--teacher", "teacher", "--corpus", "corpus",
        "--out", str(out), "--id-column", "id", "--docs-per-shard", str(DOCS_PER_SHARD),
        "--max-length", "64", "--stride", "32", "--batch-tokens", "64", "--num-workers", "2",
        "--progress-seconds", "1",
    ]  # fmt: skip


def submit_copy(cluster, name: str, source: Path, out: Path, tmp: Path) -> None:
    """Submit from a copy of `source` and delete the copy once Ray holds its own."""
    shipped = tmp / "shipped"
    shutil.copytree(source, shipped)
    submit(cluster, name, entrypoint(out), shipped)
    shutil.rmtree(shipped)


def run_record(out: Path) -> dict:
    return json.loads((out / RUN_RECORD_NAME).read_text())


def assert_verified(out: Path) -> None:
    assert not list(out.glob(TEMPORARY_GLOB))
    manifest, problems = verify_cache(out)
    assert problems == []
    assert manifest.total_rows == NUM_DOCS


@pytest.fixture(scope="module")
def reference(cluster, source, tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    """The undisturbed job's cache, scored on both worker nodes."""
    head, _ = cluster
    tmp = tmp_path_factory.mktemp("reference")
    out = tmp / "cache"
    submit_copy(head, "stage1-undisturbed", source, out, tmp)
    follow(head, "stage1-undisturbed")
    return out, snapshot(out)


def test_units_are_spread_over_the_nodes_and_written_to_the_shared_output(reference):
    out, _ = reference
    assert_verified(out)
    record = run_record(out)
    assert sorted(int(unit) for unit in record["units"]) == list(range(NUM_DOCS // DOCS_PER_SHARD))
    assert record["lost_workers"] == 0
    nodes = {placement["node"] for placement in record["units"].values()}
    assert len(nodes) == 2  # every unit on a worker node, both of them busy


def test_an_output_in_the_shipped_working_dir_is_refused_in_one_line(
    cluster, source, tmp_path, capsys
):
    """The real job finds Ray's copy of its working directory (tests/test_stage1_cluster.py sets
    what Ray's job supervisor sets by hand): --out relative to it is refused before any work."""
    head, _ = cluster
    submit_copy(head, "stage1-out-in-shipped", source, Path("cache"), tmp_path)
    with pytest.raises(VocagnoError, match="FAILED"):
        follow(head, "stage1-out-in-shipped")
    logs = capsys.readouterr().out
    assert "Traceback" not in logs, logs[-3000:]
    refused = re.search(r"stage1: error: --out cache lies in .* for this job \((.+?)\)", logs)
    assert refused, logs[-3000:]
    shipped = Path(refused[1])  # Ray's copy on the node, not the folder it was submitted from
    assert shipped.is_relative_to(head.temp_dir) and shipped.name.startswith("_ray_pkg_")
    assert logs.strip().splitlines()[-1] == (
        f"stage1: error: --out cache lies in the working directory Ray shipped for this job "
        f"({shipped}), a temporary copy on one node that is deleted when the job ends: give "
        "--out as an absolute path on storage that every node sees"
    )


def node_processes(node) -> list[psutil.Process]:
    """Every process of the worker node whose `ray start --block` is `node`: it, the raylet and
    what the raylet started, the node's actors among them (each in a process group of its own)."""
    leader = psutil.Process(node.pid)
    return [leader, *leader.children(recursive=True)]


def kill_node_while_it_scores(node, out: Path) -> None:
    """Once a shard is published, SIGKILL every process of `node` at a moment when a scorer on
    it is inside a unit: the node is stopped while it is looked at, so that unit cannot finish
    (its result goes back only once Ray titles the actor idle again) and the driver loses it."""
    deadline = time.monotonic() + 300
    while True:
        assert time.monotonic() < deadline, "no published shard while the node held a unit"
        processes = node_processes(node)
        if list(out.glob("shard-*.json")) and any(busy(p.pid) for p in processes):
            with frozen(*(p.pid for p in processes)):
                if any(busy(p.pid) for p in processes):
                    for process in processes:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(process.pid, signal.SIGKILL)
                    return
        time.sleep(0.05)


def test_a_node_killed_mid_job_costs_only_its_units_and_the_cache_is_identical(
    cluster, source, reference, tmp_path
):
    head, nodes = cluster
    _, expected = reference
    out = tmp_path / "cache"
    started = time.monotonic()
    submit_copy(head, "stage1-node-killed", source, out, tmp_path)
    kill_node_while_it_scores(nodes[NODES[1]], out)
    finished_before_kill = len(list(out.glob("shard-*.json")))
    follow(head, "stage1-node-killed")  # raises unless the job SUCCEEDED
    print(f"node-kill job: {time.monotonic() - started:.1f} s wall")

    assert snapshot(out) == expected  # byte for byte, manifest included
    assert_verified(out)
    record = run_record(out)
    assert record["lost_workers"] >= 1
    retried = {unit: p for unit, p in record["units"].items() if p["attempts"] > 1}
    print(f"units finished before the kill: {finished_before_kill}; scored again: {retried}")
    assert retried, record["units"]
    survivors = {p["node"] for p in retried.values()}
    assert len(survivors) == 1  # all on the node that is left
