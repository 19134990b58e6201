"""A private local Ray cluster for `ray job submit`, stopped with everything it started.

`ray stop` would kill every Ray process on the machine, including other users' clusters, so the
head runs as `ray start --head --block` in its own process group on free ports and the group is
terminated on exit.

Ray 2.60 enables token authentication on a head node whenever a token file exists, while its job
CLI does not follow unless told: the mode is set explicitly (`RAY_AUTH_MODE=token`) for the head
and for every client, which `RayCluster.env` carries.
"""

from __future__ import annotations

import contextlib
import os
import shlex
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


@dataclass(frozen=True)
class RayCluster:
    address: str  # job-submission address, http://127.0.0.1:PORT
    env: dict[str, str]  # environment for clients (`ray job submit`, drivers)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ray_executable() -> str:
    return str(Path(sys.executable).with_name("ray"))


@contextlib.contextmanager
def local_ray_cluster(num_cpus: int, log_path: Path) -> Iterator[RayCluster]:
    """Start a head node; yield its address and the client environment."""
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    dashboard_port = _free_port()
    address = f"http://127.0.0.1:{dashboard_port}"
    # Ray's socket paths must stay short, so its session folder lives under /tmp.
    temp_dir = tempfile.mkdtemp(prefix="vocagno-ray-")
    command = [
        _ray_executable(), "start", "--head", "--block", "--disable-usage-stats",
        f"--num-cpus={num_cpus}", "--num-gpus=0", f"--port={_free_port()}",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
        f"--ray-client-server-port={_free_port()}", f"--temp-dir={temp_dir}",
        # Ray's fixed defaults (e.g. the agent's 52365) collide with any other cluster here.
        f"--dashboard-agent-listen-port={_free_port()}",
        f"--dashboard-agent-grpc-port={_free_port()}",
        f"--runtime-env-agent-port={_free_port()}",
        f"--metrics-export-port={_free_port()}",
    ]  # fmt: skip
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
        yield RayCluster(address=address, env=env)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(head.pid, signal.SIGKILL)
            head.wait()


def _jobs_api_ready(address: str) -> bool:
    """Any HTTP answer means the dashboard serves (it may ask the CLI for Ray's auth token)."""
    try:
        with urllib.request.urlopen(f"{address}/api/version", timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def _ray_cli(
    cluster: RayCluster, verb: str, *args: str, capture: bool = True
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_ray_executable(), "job", verb, f"--address={cluster.address}", *args],
        env=cluster.env,
        capture_output=capture,
        text=True,
    )


def submit_and_follow(
    cluster: RayCluster, submission_id: str, entrypoint: list[str], cwd: Path
) -> None:
    """`ray job submit` the entrypoint (run in `cwd` on the head), stream its logs, check it succeeded.

    The node's job agent comes up some seconds after the dashboard; only that answer is retried.
    """
    command = " ".join(shlex.quote(part) for part in entrypoint)
    deadline = time.monotonic() + AGENT_SECONDS
    while True:
        submitted = _ray_cli(
            cluster, "submit", "--no-wait", f"--submission-id={submission_id}", "--",
            "bash", "-c", f"cd {shlex.quote(str(cwd))} && exec {command}",
        )  # fmt: skip
        if submitted.returncode == 0:
            break
        output = submitted.stdout + submitted.stderr
        if "No available agent" not in output or time.monotonic() > deadline:
            raise VocagnoError(f"ray job submit failed:\n{output[-2000:]}")
        time.sleep(2)
    _ray_cli(cluster, "logs", "--follow", submission_id, capture=False)
    status = _ray_cli(cluster, "status", submission_id)
    if f"Job '{submission_id}' succeeded" not in status.stdout + status.stderr:
        raise VocagnoError(
            f"Ray job {submission_id} did not succeed: {(status.stdout + status.stderr)[-500:]}"
        )
