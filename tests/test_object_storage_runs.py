"""Stage 1 and stage 2 on a bucket of a real S3-compatible server (moto's, tests/object_store.py):
stage 1 reads its corpus from the bucket and writes its cache there, is SIGKILLed mid-run, and the
rerun (once the killed run's lease lapses) leaves objects byte-identical to an undisturbed local
run's; `vocagno cache verify` and `stats` read the bucket; stage 2 trains from the bucket with the
very per-step losses it gets from the local cache.

Marked slow: two stage-1 runs on a Ray cluster and two short trainings take minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.cache.manifest import LOCK_NAME, RUN_RECORD_NAME
from pipeline.storage import Store
from stage1_score.pool import UNITS_IN_FLIGHT_PER_WORKER
from stage1_score.run import main as stage1
from tests.object_store import download_all, moto_s3, objects_under, upload_folder
from tests.stage1_helpers import make_tiny_teacher, shipped_documents, write_jsonl_corpus
from tests.stage2_runs import LOSS_FIELDS, TRAIN, read_metrics, train_args
from tests.test_fault_stage1 import (
    SCORER,
    args,
    marked_ray_cluster,
    seen_when,
    signal_mid_run,
    start_run,
    wait_until_gone,
)
from tests.test_object_storage import wait_until
from tests.test_stage1_run import snapshot

pytest.importorskip("moto.server")
pytestmark = pytest.mark.slow
NUM_DOCS, LEASE = 24, "3"  # 8 units of 3 documents


@pytest.fixture(scope="module")
def bucket():
    with moto_s3() as uri:  # before Ray starts: its workers inherit the endpoint
        yield uri


@pytest.fixture(scope="module")
def ray_address(bucket):  # after the server: its workers inherit the endpoint
    pytest.importorskip("ray")
    with marked_ray_cluster() as address:
        yield address


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    return make_tiny_teacher(tmp_path_factory.mktemp("teacher") / "tiny-llama", "tinyllama")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, bucket) -> tuple[Path, str]:
    """The same corpus as a local folder and as a prefix in the bucket."""
    folder = tmp_path_factory.mktemp("corpus")
    write_jsonl_corpus(folder / "docs.jsonl", shipped_documents(NUM_DOCS))
    upload_folder(folder, f"{bucket}/corpus")
    return folder, f"{bucket}/corpus"


@pytest.fixture(scope="module")
def local_cache(ray_address, teacher, corpus, tmp_path_factory) -> Path:
    """The undisturbed run, all local."""
    out = tmp_path_factory.mktemp("local") / "cache"
    assert stage1(args(teacher, corpus[0], out, ray_address)) == 0
    return out


def last_modified(uri: str, names) -> dict[str, float]:
    """{name: LastModified} of objects under the prefix `uri`: S3 gives it to the second."""
    store = Store(uri)
    infos = store.fs.get_file_info([store.path(name) for name in names])
    return {info.base_name: info.mtime.timestamp() for info in infos}


def wait_for_server_clock_past(bucket: str, moment: float) -> None:
    """Until an object written now gets a LastModified later than `moment`."""
    probe = Store(f"{bucket}/clock")

    def written_later() -> bool:
        probe.write_bytes("probe", b"")
        return last_modified(probe.location, ["probe"])["probe"] > moment

    wait_until(written_later, "second after the finished units on the server's clock")


@pytest.fixture(scope="module")
def bucket_cache(ray_address, teacher, corpus, bucket, tmp_path_factory) -> str:
    """The bucket's run: SIGKILLed after two finished units, then the same command again."""
    uri, log = f"{bucket}/caches/tiny", tmp_path_factory.mktemp("logs") / "killed.log"
    command = [*args(teacher, corpus[1], uri, ray_address), "--lock-lease", LEASE]
    assert objects_under(uri) == []
    store = Store(uri)
    process = start_run(command, log)

    def finished() -> list[str]:
        return store.names("shard-*.json")

    scorers: list[int] = []
    signal_mid_run(
        process,
        signal.SIGKILL,
        seen_when(
            lambda: 2 <= len(finished()) < NUM_DOCS // 3 - UNITS_IN_FLIGHT_PER_WORKER,
            scorers,
            SCORER,
        ),
        "two finished units",
        log,
        finished,
    )
    process.wait(timeout=30)
    wait_until_gone(scorers, SCORER)  # Ray ended the dead driver's actors: no writer is left
    assert "manifest.json" not in store.names()  # killed mid-run, not after it
    assert LOCK_NAME in store.names()  # nobody released it
    sidecars = finished()  # a shard without its sidecar is unfinished: the rerun scores it again
    assert 2 <= len(sidecars) < NUM_DOCS // 3
    units = [*sidecars, *(name.removesuffix(".json") + ".parquet" for name in sidecars)]
    kept = {name: store.read_bytes(name) for name in units}
    written = last_modified(uri, kept)

    # Stage 1 is byte-deterministic: only LastModified tells a kept unit from a rewritten one, and
    # only once the server's clock has left the second the kept units were written in.
    wait_for_server_clock_past(bucket, max(written.values()))
    expires = store.read_json(LOCK_NAME)["expires"]
    wait_until(lambda: time.time() > expires, "end of the killed run's lease")
    assert stage1(command) == 0  # the killed run's lease has lapsed
    assert LOCK_NAME not in store.names()
    objects = download_all(uri)
    assert [name for name, data in kept.items() if objects[name] != data] == []  # names them
    assert last_modified(uri, kept) == written  # finished units kept, not written again
    return uri


def test_the_rerun_in_the_bucket_is_byte_identical_to_an_undisturbed_local_run(
    local_cache, bucket_cache
):
    objects = download_all(bucket_cache)
    del objects[RUN_RECORD_NAME]  # how the run went (paths, workers), not what it made
    assert objects == snapshot(local_cache)
    assert len([n for n in objects if n.endswith(".parquet")]) == NUM_DOCS // 3


def test_cache_verify_and_stats_read_the_bucket(bucket_cache, capsys):
    from apps.cli import main as vocagno

    assert vocagno(["cache", "verify", bucket_cache]) == 0
    assert (
        f"{bucket_cache}: {NUM_DOCS // 3} shards, {NUM_DOCS} documents" in capsys.readouterr().out
    )
    assert vocagno(["cache", "stats", bucket_cache, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["documents"] == NUM_DOCS


def test_stage2_trains_from_the_bucket_with_the_local_caches_losses(
    local_cache, bucket_cache, tmp_path
):
    def train(cache: str | Path, out: Path, *extra: str) -> list[dict]:
        command = [sys.executable, str(TRAIN), *train_args(cache, out, *extra)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return read_metrics(out)

    local = train(local_cache, tmp_path / "from-local")
    copies = tmp_path / "copies"
    remote = train(
        bucket_cache, tmp_path / "from-bucket", "--shard-cache", str(copies), "--read-ahead", "2"
    )
    assert len(remote) == 6 and remote == local, LOSS_FIELDS
    assert not list(copies.iterdir())  # each process removed its copies on exit
