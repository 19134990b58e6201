"""The private Ray cluster's commands (apps/demo/ray_cluster.py) give each component its own port.

A guidance-curve run failed to start its head: `ray start` refused "port number 60953 that is used
by other components", the GCS and the dashboard both given it, because each port was chosen by
binding a socket, closing it, and binding the next, which the kernel may answer with the port just
released. The ports are now chosen with every socket held until all are bound.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from apps.demo.ray_cluster import RayCluster, _free_ports, head_command, worker_command

REPO = Path(__file__).resolve().parents[1]


def ports_of(command: list[str]) -> list[int]:
    """The ports a command gives its components (not a worker node's range for its workers)."""
    flags = re.findall(r"^--([\w-]*port)=(\d+)$", "\n".join(command), re.M)
    return [int(port) for flag, port in flags if not flag.endswith("worker-port")]


def worker_range(command: list[str]) -> range:
    low, high = (int(re.search(rf"--{end}-worker-port=(\d+)", " ".join(command))[1])
                 for end in ("min", "max"))  # fmt: skip
    return range(low, high + 1)


def test_free_ports_are_distinct_even_when_many_are_asked_for():
    """(Sockets bound and closed one after another gave a port twice in 3 of 20 such batches.)"""
    for _ in range(50):
        ports = _free_ports(64)
        assert len(set(ports)) == 64


def test_a_head_and_a_worker_node_give_each_component_its_own_port():
    for _ in range(20):
        command, dashboard, gcs = head_command(2, "/tmp/x")
        ports = ports_of(command)
        assert len(ports) == 7 and len(set(ports)) == 7, command
        assert {dashboard, gcs} <= set(ports) and dashboard != gcs
        cluster = RayCluster("http://127.0.0.1:1", {}, f"127.0.0.1:{gcs}", "/tmp/x")
        command = worker_command(cluster, 1, {"node_a": 1.0})
        ports = ports_of(command)  # node manager, object manager, the four every node runs
        assert len(ports) == 6 and len(set(ports)) == 6, command
        workers = worker_range(command)  # neither the head's workers' (10002-19999) nor theirs
        assert len(workers) == 100 and 20000 <= workers[0] and workers[-1] < 32768, command
        assert not set(ports) & set(workers)


# Run in a process of its own: Ray reads its auth mode and token once per process.
STARTS_AND_ANSWERS = """
import sys
from pathlib import Path

from apps.demo.ray_cluster import local_ray_cluster

with local_ray_cluster(1, Path(sys.argv[1])) as cluster:
    from ray.job_submission import JobSubmissionClient  # after the cluster set Ray's mode, as demo

    print("jobs", JobSubmissionClient(cluster.address).list_jobs())
    print("session", cluster.temp_dir)
"""


def test_a_private_cluster_starts_on_a_machine_that_never_ran_ray(tmp_path):
    """`make demo` on a fresh machine failed at its first Ray step: the private cluster runs in
    token mode, and `ray start`, unlike `ray.init`, makes no token where none exists (no
    ~/.ray/auth_token), so the head refused to start. With a home that never ran Ray and no token
    in the environment, the cluster starts with a token of its own, its job API answers a client
    that carries it, and nothing is written to the home (the demo's whole job: tests/test_demo.py,
    slow). And where TMPDIR is too long for Ray's socket paths (a CI run with TMPDIR under a fresh
    folder: the head's dashboard failed, and the job API never answered), the session folder goes
    under /tmp; a cluster that stopped cleanly leaves none behind."""
    home, temporary = tmp_path / "home", tmp_path / "a-temporary-folder-as-a-cluster-gives-a-job"
    home.mkdir()
    temporary.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_AUTH")}
    env |= {"HOME": str(home), "PYTHONPATH": str(REPO), "TMPDIR": str(temporary)}
    run = subprocess.run(
        [sys.executable, "-c", STARTS_AND_ANSWERS, str(tmp_path / "head.log")],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    said = run.stdout + run.stderr
    assert run.returncode == 0, said + (tmp_path / "head.log").read_text()[-3000:]
    assert "jobs []" in run.stdout, said
    assert not (home / ".ray").exists()
    session = Path(re.search(r"^session (.+)$", run.stdout, re.M)[1])
    assert session.parent == Path("/tmp") and not session.exists(), said
