"""The Ray cluster a stage-1 run stands on: joining it, describing it, naming its nodes, and the
paths a job may use when `ray job submit --working-dir` shipped the code.

Under `ray job submit --working-dir DIR`, Ray unpacks a copy of DIR on each node that runs a part
of the job and starts the driver and every actor in that node's copy. A path inside the copy is
fine to read (the corpus, read by the driver alone; a teacher inside DIR, which each worker finds
in its own node's copy); it is no place for the cache, which would end up in a temporary folder
on one node and be deleted with the job. The driver's own copy is deleted when it joins Ray, so
the corpus files in it are held elsewhere for the run (corpus_kept_from_shipped).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from pipeline.errors import ConfigError

if TYPE_CHECKING:
    from pipeline.corpus import Corpus

# Set by Ray's job supervisor for the driver it starts: the job's runtime_env among others.
JOB_CONFIG_VARIABLE = "RAY_JOB_CONFIG_JSON_ENV_VAR"
# How long a Ray address may take to accept a TCP connection: a closed port refuses at once, so
# only an address that drops packets (a host gone, a firewall) waits this long.
PROBE_SECONDS = 10.0
LAST_STARTED = "the Ray cluster last started on this machine"  # where ray.init finds an address


@dataclass(frozen=True)
class RayTarget:
    """The Ray cluster a run will join: `host_port` to connect to (None: ray.init starts a local
    Ray of its own), the address as the user gave it and where it came from, and whether it is a
    Ray Client (ray://) address."""

    host_port: str | None
    given: str | None
    source: str
    client: bool = False


def ray_target(address: str | None) -> RayTarget:
    """What ray.init(address) would connect to: the address, RAY_ADDRESS, or the cluster last
    started on this machine; an address ray.init would refuse with a traceback is refused here in
    one line."""
    from ray._private.services import canonicalize_bootstrap_address

    given, source = address, "--ray-address"
    if not given and os.environ.get("RAY_ADDRESS"):
        given, source = os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    if given and "://" in given:
        parts = urlsplit(given)
        if parts.scheme != "ray":  # ray.init would raise a ValueError (a traceback)
            raise ConfigError(
                f"{source} {given} is no Ray cluster address: give HOST:PORT of its head "
                "(ray start --head --port, 6379 by default) or ray://HOST:10001; an http:// "
                "address is the dashboard's, for `ray job submit --address`"
            )
        try:
            target = f"{parts.hostname}:{parts.port or 10001}"  # Ray Client's default port
        except ValueError as exc:  # a port that is no number
            raise ConfigError(f"{source} {given}: {exc}") from None
        return RayTarget(target, given, source, client=True)
    try:  # what ray.init connects to: the address, RAY_ADDRESS, or the last `ray start`
        target = canonicalize_bootstrap_address(given)
    except (ValueError, ConnectionError) as exc:
        raise ConfigError(f"{source} {given}: {exc}") from None
    if target is not None and not given:
        given, source = target, LAST_STARTED
    return RayTarget(target, given, source)


def reachable_ray_address(address: str | None, log: Callable[[str], None]) -> str | None:
    """The address the run joins Ray with: `address`, or "local" (a new local Ray) where it is
    unset and the cluster last started on this machine no longer answers, said in one `log` line,
    as --help promises. A Ray address the user gave where nothing accepts a connection is refused
    in one line naming it.

    ray.init would retry it for many minutes, printing only warnings, in attempts of about 40 s
    that Ctrl-C and SIGTERM cannot cut short. Ray's own knobs do not bound this:
    RAY_gcs_server_request_timeout_seconds leaves the attempts as long, and
    RAY_gcs_rpc_server_reconnect_timeout_s aborts the process, then and at any later GCS hiccup.
    So the address Ray would use is first tried with a plain TCP connect under a deadline.
    """
    import ray

    if ray.is_initialized():
        return address
    target = ray_target(address)
    if target.host_port is None:  # ray.init starts a local Ray of its own
        return address
    host, _, port = target.host_port.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_SECONDS).close()
    except OSError as exc:
        timed_out = isinstance(exc, TimeoutError)
        reason = f"no answer in {PROBE_SECONDS:.0f} s" if timed_out else exc.strerror or exc
        reached = "" if target.host_port == target.given else f", tried as {target.host_port}"
        if target.source == LAST_STARTED:  # `ray start` left its address; its processes died
            log(
                f"{LAST_STARTED} ({target.given}) no longer answers ({reason}): starting a new "
                "local Ray for this run (`ray stop` clears the old address)"
            )
            return "local"
        raise ConfigError(
            f"no Ray cluster answers at {target.given} ({target.source}{reached}: {reason}); "
            "start one (ray start --head) or give the address of a running one"
        ) from None
    return address


def cluster_gpus(address: str | None) -> int:
    """GPUs of the Ray cluster this run will join (`address` as --ray-address), learned without
    joining it: joining from a `ray job submit` driver deletes the driver's copy of the shipped
    working directory, which the corpus may lie in. A cluster is asked through Ray's GCS client,
    which registers no driver; a local Ray the run starts itself has this machine's GPUs."""
    import ray

    if ray.is_initialized():  # joined already (a caller's own ray.init)
        return int(ray.cluster_resources().get("GPU", 0))
    target = ray_target(address)
    if target.host_port is None:
        import torch

        return torch.cuda.device_count()
    if target.client:
        raise ConfigError(
            f"--dtype auto cannot ask a Ray Client address ({target.given}) whether its workers "
            "get GPUs before joining it: name the dtype (--dtype bfloat16 on GPUs, float32 on CPUs)"
        )
    from ray._raylet import GcsClient
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    try:  # as Ray's own CLI (`ray status`) does first: a token on this machine is presented
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        pass
    else:
        maybe_enable_token_auth_if_token_available()
    client = GcsClient(address=target.host_port)
    nodes = client.get_all_node_info(timeout=PROBE_SECONDS, state_filter=GcsNodeInfo.ALIVE)
    return int(sum(node.resources_total.get("GPU", 0) for node in nodes.values()))


def connect_ray(address: str | None) -> bool:
    """Join (or start) Ray unless this process already did; True if we must shut it down."""
    import ray

    if ray.is_initialized():
        return False
    handler = signal.getsignal(signal.SIGTERM)
    # ray.init puts its own SIGTERM handler in place (sys.exit(15)), which skips our unwinding
    # (cleanup, one line, exit 143): a SIGTERM while it starts or joins Ray is handed to the
    # entry point's handler, which is put back after.
    # A Ray this run starts for itself ends with it: its dashboard (1 s of the start, measured in
    # benchmarks/bench_stage1_startup.py) would serve nobody. A cluster joined keeps its own; Ray
    # Client (ray://) would hand the option on to its server's ray.init, so it is left out there.
    client = (address or os.environ.get("RAY_ADDRESS", "")).startswith("ray://")
    options = {} if client else {"include_dashboard": False}
    try:
        ray.init(address=address, logging_level="WARNING", **options)
    except OSError as error:  # a local Ray's socket paths past AF_UNIX's 107 bytes: one line
        if "AF_UNIX" not in str(error):
            raise
        raise ConfigError(
            f"{error}; a local Ray keeps its sockets in its temporary folder (RAY_TMPDIR, else "
            "TMPDIR): set RAY_TMPDIR to a shorter folder, e.g. RAY_TMPDIR=/tmp"
        ) from None
    except SystemExit as stop:
        if stop.code == signal.SIGTERM and callable(handler):
            handler(signal.SIGTERM, None)
        raise
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, handler)
    return True


def describe_cluster() -> str:
    """Which Ray cluster this job runs on, and its nodes: with --ray-address unset, Ray joins
    whatever local cluster is running, which a user must be able to see."""
    import ray

    nodes = [node for node in ray.nodes() if node.get("Alive")]
    resources = ray.cluster_resources()
    listed = ", ".join(
        f"{node_name(n['NodeID'], n['NodeManagerAddress'])} "
        f"({int(n['Resources'].get('CPU', 0))} CPU, {int(n['Resources'].get('GPU', 0))} GPU)"
        for n in nodes
    )
    return (
        f"Ray cluster at {ray.get_runtime_context().gcs_address}: {len(nodes)} node(s), "
        f"{int(resources.get('CPU', 0))} CPU(s), {int(resources.get('GPU', 0))} GPU(s): {listed}"
    )


def node_name(node_id: str, address: str) -> str:
    """A node as logs and the run record name it: its address, and the start of its Ray id
    (several nodes share an address when they run on one machine)."""
    return f"{address}/{node_id[:8]}"


def this_node() -> str:
    """The node the calling Ray worker runs on."""
    import ray

    return node_name(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())


def shipped_working_dir() -> Path | None:
    """The node's copy of the job's shipped working directory (the driver starts in it), or None
    when this process is not a Ray job driver with `--working-dir` / runtime_env working_dir."""
    try:
        job_config = json.loads(os.environ.get(JOB_CONFIG_VARIABLE) or "{}")
    except ValueError:
        return None
    runtime_env = job_config.get("runtime_env") or {}
    return Path.cwd().resolve() if runtime_env.get("working_dir") else None


def check_output_outside(shipped: Path | None, out: str | Path) -> None:
    """Refuse an output folder inside the shipped working directory (see the module docstring);
    an object-store URI (a str) lies in no folder."""
    if shipped is not None and isinstance(out, Path) and out.resolve().is_relative_to(shipped):
        raise ConfigError(
            f"--out {out} lies in the working directory Ray shipped for this job ({shipped}), a "
            "temporary copy on one node that is deleted when the job ends: give --out as an "
            "absolute path on storage that every node sees"
        )


@contextlib.contextmanager
def corpus_kept_from_shipped(shipped: Path | None, corpus: Corpus) -> Iterator[int]:
    """For the block, the corpus's files that lie in the shipped working directory read from a
    folder of this run's instead (hard links, or copies where the file system refuses a link);
    yields how many. Joining Ray from a job driver deletes the driver's node copy of that
    directory (Ray 2.60 with a head of 0 CPUs, tests/test_stage1_multinode.py), and the driver
    opens each file only when it reaches it: a corpus of several files failed at its second.
    The sources keep their names, so the corpus's identity is unchanged."""
    inside = [
        source for source in corpus.sources
        if shipped is not None and isinstance(source.path, Path)
        and source.path.resolve().is_relative_to(shipped)
    ]  # fmt: skip
    if not inside:
        yield 0
        return
    folder = Path(tempfile.mkdtemp(prefix="vocagno-corpus-"))
    try:
        for number, source in enumerate(inside):
            kept = folder / str(number) / source.path.name
            kept.parent.mkdir()
            if source.path.is_dir():  # a saved dataset
                shutil.copytree(source.path, kept, copy_function=_link_or_copy)
            else:
                _link_or_copy(source.path, kept)
            source.path = kept
        yield len(inside)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _link_or_copy(source: Path | str, destination: Path | str) -> None:
    try:
        os.link(source, destination)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(source, destination)


def relative_to_shipped(shipped: Path | None, path: Path) -> Path:
    """`path` as each worker must open it: relative to its own node's copy when it lies in the
    shipped working directory (Ray starts every worker in that copy), else unchanged."""
    if shipped is not None and path.is_absolute() and path.is_relative_to(shipped):
        return path.relative_to(shipped)
    return path
