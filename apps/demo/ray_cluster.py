"""A private local Ray cluster for `ray job submit`, stopped with everything it started.

`ray stop` would kill every Ray process on the machine, including other users' clusters, so the
head runs as `ray start --head --block` in its own process group on free ports and the group is
terminated on exit; so does each worker node added to it (several raylets on one machine, as the
multi-node tests run them).

Jobs are submitted as on a real cluster: `ray job submit --working-dir DIR`, so the job runs in
the copy Ray ships of DIR, never in a path that exists only on the submitting machine.

Ray 2.60 enables token authentication on a head node whenever a token file exists, while its job
clients do not follow unless told: the mode is set explicitly (`RAY_AUTH_MODE=token`, unless the
caller chose one) for the head and for every client, which `RayCluster.env` carries (and this
process's environment, for the job-submission SDK used here). Token mode needs a token, which
`ray start` does not make (`ray.init` does, in ~/.ray/auth_token): where Ray would find none, the
cluster gets one of its own (`RAY_AUTH_TOKEN`, carried the same way), so a machine that never ran
Ray starts it, and nothing is written to the user's home.

The job's outcome is Ray's own job status from the SDK, never a match on the CLI's wording.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import VocagnoError

STARTUP_SECONDS = 180
STOP_SECONDS = 15  # then SIGKILL: a private cluster has nothing worth draining
AGENT_SECONDS = 120
# Ray puts a node's sockets in {temp dir}/session_{date}_{time}_{µs}_{pid}/sockets/, the longest a
# dashboard module's, and AF_UNIX takes paths of at most 107 bytes (103 on macOS). Past that the
# head's dashboard fails ("AF_UNIX path length cannot exceed 107 bytes", in Ray's session logs)
# and its job API never answers: a TMPDIR of 16 characters or more did that to the demo.
RAY_SOCKET_TAIL = len("/session_2026-11-29_02-30-11_121544_4194304/sockets/dash_TaskEventsHead")
SOCKET_PATH_BYTES = 103  # the lower of the two: a folder that fits on macOS fits on Linux
TEMP_PREFIX = "vocagno-ray-"


@dataclass(frozen=True)
class RayCluster:
    address: str  # job-submission address, http://127.0.0.1:PORT
    env: dict[str, str]  # environment for clients (`ray job submit`, drivers)
    gcs_address: str  # where nodes join (`ray start --address`) and drivers connect
    temp_dir: str


def _free_ports(count: int) -> list[int]:
    """`count` distinct ports free now. Each socket is held until all are chosen: a port released
    is the kernel's to give out again, and a head once got one port for two of its components."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def _ray_executable() -> str:
    return str(Path(sys.executable).with_name("ray"))


# A worker node's ports for its workers: WORKER_PORTS of them, within [FROM, BELOW) (worker_command)
WORKER_PORTS, WORKER_PORTS_FROM, WORKER_PORTS_BELOW = 100, 20000, 32768
# What every node runs, each given a free port: Ray's fixed defaults (e.g. the agent's 52365)
# collide with any other node or cluster on this machine.
NODE_PORT_FLAGS = (
    "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
    "--metrics-export-port",
)  # fmt: skip


def _node_ports(ports: list[int]) -> list[str]:
    return [f"{flag}={port}" for flag, port in zip(NODE_PORT_FLAGS, ports, strict=True)]


def head_command(num_cpus: int, temp_dir: str) -> tuple[list[str], int, int]:
    """`ray start --head` on free ports, distinct from one another; with its dashboard's port
    (the job API) and its GCS port (where nodes join)."""
    dashboard_port, gcs_port, client_port, *node = _free_ports(3 + len(NODE_PORT_FLAGS))
    command = [
        _ray_executable(), "start", "--head", "--block", "--disable-usage-stats",
        f"--num-cpus={num_cpus}", "--num-gpus=0", f"--port={gcs_port}",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
        f"--ray-client-server-port={client_port}", f"--temp-dir={temp_dir}", *_node_ports(node),
    ]  # fmt: skip
    return command, dashboard_port, gcs_port


def worker_command(cluster: RayCluster, num_cpus: int, resources: dict[str, float]) -> list[str]:
    """`ray start` of one more node of `cluster`, on free ports distinct from one another."""
    seed, node_manager, object_manager, *node = _free_ports(3 + len(NODE_PORT_FLAGS))
    # worker ports apart from other nodes' (the head's: Ray's default 10002-19999) and below
    # Linux's default range for free ports (32768-60999), from which the ports above come
    low = WORKER_PORTS_FROM + seed % (WORKER_PORTS_BELOW - WORKER_PORTS_FROM - WORKER_PORTS)
    return [
        _ray_executable(), "start", "--block", f"--address={cluster.gcs_address}",
        f"--num-cpus={num_cpus}", "--num-gpus=0", f"--resources={json.dumps(resources)}",
        f"--node-manager-port={node_manager}", f"--object-manager-port={object_manager}",
        f"--min-worker-port={low}", f"--max-worker-port={low + WORKER_PORTS - 1}",
        f"--temp-dir={cluster.temp_dir}", *_node_ports(node),
    ]  # fmt: skip


@contextlib.contextmanager
def local_ray_cluster(num_cpus: int, log_path: Path) -> Iterator[RayCluster]:
    """Start a head node; yield its address and the client environment."""
    # Set here before Ray is imported in this process: Ray reads the mode once. A process that has
    # read it already (a test session) chooses the cluster's mode to match.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if os.environ["RAY_AUTH_MODE"] == "token" and not _ray_token_found():
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    env = dict(os.environ)
    temp_dir = session_folder(env)
    command, dashboard_port, gcs_port = head_command(num_cpus, temp_dir)
    address = f"http://127.0.0.1:{dashboard_port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        head = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while not _jobs_api_ready(address):
            if head.poll() is not None:
                raise VocagnoError(f"ray start exited with {head.returncode}; see {log_path}")
            if time.monotonic() > deadline:
                raise VocagnoError(
                    f"Ray's job API did not come up in {STARTUP_SECONDS} s; see {log_path}"
                )
            time.sleep(1)
        yield RayCluster(address, env, f"127.0.0.1:{gcs_port}", temp_dir)
    except BaseException:
        _stop_node(head)  # the session's logs are kept, for what went wrong
        raise
    _stop_node(head)
    shutil.rmtree(temp_dir, ignore_errors=True)


def session_folder(env: dict[str, str]) -> str:
    """A new folder for the cluster's session: in the temporary folder (TMPDIR) where Ray's socket
    paths fit there, else in /tmp, Ray's own default, and then it is the nodes' TMPDIR too (`env`):
    Python's multiprocessing, which the dashboard uses, puts its sockets in TMPDIR."""
    root = tempfile.gettempdir()
    longest = os.path.join(root, TEMP_PREFIX + "x" * 8)  # mkdtemp adds 8 characters
    if len(os.fsencode(longest)) + RAY_SOCKET_TAIL <= SOCKET_PATH_BYTES:
        return tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=root)
    env["TMPDIR"] = folder = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir="/tmp")
    return folder


def _ray_token_found() -> bool:
    """Whether Ray finds a token where it looks: RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH
    names (a missing one is Ray's error to give), then ~/.ray/auth_token."""
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return True
    return (Path.home() / ".ray" / "auth_token").is_file()


@contextlib.contextmanager
def worker_node(
    cluster: RayCluster, num_cpus: int, resources: dict[str, float], log_path: Path
) -> Iterator[subprocess.Popen]:
    """Join one more node (its own raylet) to `cluster`; yield its `ray start --block` process,
    the leader of the node's process group."""
    command = worker_command(cluster, num_cpus, resources)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        node = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=cluster.env
        )
    try:
        yield node
    finally:
        _stop_node(node)


def _stop_node(node: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(node.pid, signal.SIGTERM)
    try:
        node.wait(timeout=STOP_SECONDS)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, signal.SIGKILL)
        node.wait()


def _jobs_api_ready(address: str) -> bool:
    """Any HTTP answer means the dashboard serves (it may ask the CLI for Ray's auth token)."""
    try:
        with urllib.request.urlopen(f"{address}/api/version", timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def _ray_cli(cluster: RayCluster, verb: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_ray_executable(), "job", verb, f"--address={cluster.address}", *args],
        env=cluster.env,
        capture_output=True,
        text=True,
    )


def submit(
    cluster: RayCluster, submission_id: str, entrypoint: list[str], working_dir: Path
) -> None:
    """`ray job submit --working-dir` the entrypoint and return once Ray has taken the job (and
    its copy of `working_dir`, .gitignore'd files left out).

    The node's job agent comes up some seconds after the dashboard; only that answer is retried.
    """
    deadline = time.monotonic() + AGENT_SECONDS
    while True:
        submitted = _ray_cli(
            cluster, "submit", "--no-wait", f"--submission-id={submission_id}",
            f"--working-dir={working_dir}", "--", *entrypoint,
        )  # fmt: skip
        if submitted.returncode == 0:
            return
        output = submitted.stdout + submitted.stderr
        if "No available agent" not in output or time.monotonic() > deadline:
            raise VocagnoError(f"ray job submit failed:\n{output[-2000:]}")
        time.sleep(2)


def submit_and_follow(
    cluster: RayCluster, submission_id: str, entrypoint: list[str], working_dir: Path
) -> None:
    """Submit the entrypoint (run in Ray's copy of `working_dir`), stream its logs to stdout, and
    raise unless Ray reports it SUCCEEDED."""
    submit(cluster, submission_id, entrypoint, working_dir)
    follow(cluster, submission_id)


def follow(cluster: RayCluster, submission_id: str) -> None:
    """Stream a submitted job's logs to stdout until it ends; raise unless it SUCCEEDED."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(cluster.address)
    asyncio.run(_print_logs(client, submission_id))
    status = client.get_job_status(submission_id)
    if status != JobStatus.SUCCEEDED:
        # Ray's message goes on to quote the job's last logs, already streamed above.
        message = (client.get_job_info(submission_id).message or "no message from Ray").splitlines()
        raise VocagnoError(
            f"Ray job {submission_id} ended {status.value}: {message[0].rstrip(':')}"
        )


async def _print_logs(client, submission_id: str) -> None:
    """The job's output as it comes, until the job ends."""
    async for chunk in client.tail_job_logs(submission_id):
        sys.stdout.write(chunk)
        sys.stdout.flush()
