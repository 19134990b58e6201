"""Caches and corpora in object storage, against a real S3-compatible server (moto's, on localhost;
tests/object_store.py): a write cut off midway, the lease lock that keeps two stage-1 runs off one
prefix and its renewals, verification naming a corrupted object, stage 2's bounded local shard
copies with read-ahead, and a corpus read from a bucket. Stage 1 into a bucket under SIGKILL, and
stage 2 training from it, are in test_object_storage_runs.py (slow)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline.cache.manifest import load_manifest
from pipeline.cache.shard_cache import ShardCache
from pipeline.cache.verify import verify_cache
from pipeline.corpus import Corpus, CorpusOptions
from pipeline.errors import CacheError
from pipeline.log import configure
from pipeline.storage import Store
from pipeline.storage.lease import LeaseLock
from stage1_score.output import remove_temporaries
from tests.cache_fixtures import build_cache
from tests.object_store import download_all, moto_s3, objects_under, upload_folder

REPO = Path(__file__).resolve().parents[1]

pytest.importorskip("moto.server")
LOCK = ".stage1.lock"


@pytest.fixture(scope="module")
def bucket():
    with moto_s3() as uri:
        yield uri


@pytest.fixture(scope="module")
def local_cache(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cache") / "cache"
    build_cache(folder, num_documents=30, docs_per_shard=5)
    return folder


class SetClock:
    """A wall clock that moves only when the test moves it, so that whether a lease has ended
    depends on the lease, not on how long the scheduler took between two steps of the test."""

    def __init__(self):
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {timeout:.0f} s"
        time.sleep(0.05)


class CutOffUploads:
    """The bucket's filesystem, except that each upload sends the first half of its bytes and then
    fails with `error`: a stop signal (SIGTERM is a KeyboardInterrupt here), Ray ending the worker
    or a dropped connection, midway through a write."""

    def __init__(self, fs, error: BaseException):
        self.fs, self.error = fs, error

    def __getattr__(self, name: str):
        return getattr(self.fs, name)

    def open_output_stream(self, path: str):
        stream, error = self.fs.open_output_stream(path), self.error

        class CutOff:
            def __enter__(self):
                stream.__enter__()
                return self

            def __exit__(self, *exc):
                return stream.__exit__(*exc)  # closes the real stream, as `with` does

            def write(self, data: bytes) -> None:
                stream.write(data[: len(data) // 2])
                raise error

        return CutOff()


@pytest.mark.parametrize(
    "error", [KeyboardInterrupt(), SystemExit(1), OSError("connection reset by peer")]
)
def test_a_write_cut_off_midway_leaves_the_object_it_replaces_whole(bucket, error):
    """A stopped or failed write leaves the previous object, not the half it sent: a stream
    publishes what it holds when it closes, even on an error (apache/arrow#40502), and a cut-off
    producer.json or manifest.json would strand a finished cache. SystemExit is how Ray ends a
    killed driver's actors, inside the task each is running (the likely cause of the one failure
    of test_object_storage_runs.py's kill test: a kept sidecar that its rerun scored again)."""
    store = Store(f"{bucket}/cut-off-{type(error).__name__}")
    store.write_json("manifest.json", {"shards": ["shard-00000.parquet"]})
    before = store.read_bytes("manifest.json")
    store.fs = CutOffUploads(store.fs, error)
    with pytest.raises(type(error)):
        store.write_json(
            "manifest.json", {"shards": ["shard-00000.parquet", "shard-00001.parquet"]}
        )
    assert store.read_bytes("manifest.json") == before
    assert store.names() == ["manifest.json"]  # nor a temporary left behind
    store.fs = store.fs.fs
    store.write_json("manifest.json", {"shards": []})
    assert store.read_json("manifest.json") == {"shards": []}
    assert store.names() == ["manifest.json"]


def test_a_second_run_on_a_held_prefix_is_refused_until_the_first_ends(bucket):
    store = Store(f"{bucket}/locked")
    clock = SetClock()

    def lease_lock() -> LeaseLock:
        return LeaseLock(store, LOCK, lease=3, settle=0.1, clock=clock)

    with lease_lock():
        with pytest.raises(CacheError, match="being written by another stage-1 run"):
            with lease_lock():
                pass
        clock.now = store.read_json(LOCK)["expires"] + 10  # the first lease is long over
        # The holder renews every lease / 3 (real seconds), stamped with the clock's time.
        wait_until(lambda: store.read_json(LOCK)["expires"] > clock.now, "renewal of the lease")
        with pytest.raises(CacheError, match=r"pid \d+ on "):
            with lease_lock():
                pass
    assert LOCK not in store.names()  # released on exit
    with lease_lock():
        pass


def test_the_lock_of_a_killed_run_lapses_after_its_lease(bucket):
    """A killed run renews nothing: its lock object stays, and counts only until it expires."""
    store = Store(f"{bucket}/killed")
    clock = SetClock()
    expires = clock.now + 2
    store.write_json(LOCK, {"token": "dead", "holder": "pid 1 on gone", "expires": expires})
    with pytest.raises(CacheError, match="pid 1 on gone"):
        with LeaseLock(store, LOCK, lease=3, settle=0.1, clock=clock):
            pass
    clock.now = expires + 0.5
    with LeaseLock(store, LOCK, lease=3, settle=0.1, clock=clock) as lock:
        assert store.read_json(LOCK)["token"] == lock.token


class HeldCopies:
    """The bucket's filesystem, except that copies onto `name` (an atomic write's last step) wait
    until the test lets them go."""

    def __init__(self, fs, store: Store, name: str):
        self.fs, self.destination = fs, store.path(name)
        self.waiting, self.go = threading.Event(), threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.fs, name)

    def copy_file(self, source: str, destination: str) -> None:
        if destination == self.destination:
            self.waiting.set()
            self.go.wait()
        self.fs.copy_file(source, destination)


def test_a_renewal_in_flight_outlives_the_cleanup_of_temporaries(bucket):
    """Stage 1 removes interrupted writes' temporaries while it holds the lock (on start, and after
    losing a worker), as the renewer may be writing the lock itself: the renewal must go through,
    not fail for a temporary deleted under it. A killed holder's lock temporaries go when the next
    holder lets go, so that a finished prefix verifies clean."""
    store = Store(f"{bucket}/renewing")
    left_by_a_killed_holder = f"..stage1.lock.{'0' * 32}.tmp"
    store.write_bytes(left_by_a_killed_holder, b"{")
    store.write_bytes(".shard-000001.parquet.1234.tmp", b"PAR1")
    clock, said = SetClock(), []
    with LeaseLock(store, LOCK, lease=3, settle=0.1, clock=clock, log=said.append) as lock:
        store.fs = held = HeldCopies(store.fs, store, LOCK)
        clock.now += 1
        wait_until(held.waiting.is_set, "renewal of the lease")
        remove_temporaries(store)
        held.go.set()
        wait_until(lambda: store.read_json(LOCK)["expires"] == clock.now + 3, "renewed lease")
        assert (said, lock.lost) == ([], None)
        assert store.names(".shard-*") == []
        store.fs = held.fs
    assert store.names() == []


def test_a_cache_in_a_bucket_verifies_and_a_flipped_byte_is_named_and_refused(
    bucket, local_cache, tmp_path, capsys
):
    from apps.cli import main as vocagno
    from stage2_train.data.plan import DataPlan
    from stage2_train.data.shards import verified_shard

    uri = f"{bucket}/flipped"
    upload_folder(local_cache, uri)
    assert verify_cache(uri)[1] == []
    victim = load_manifest(uri).shards[1]
    data = bytearray(Store(uri).read_bytes(victim.file))
    data[len(data) // 2] ^= 0x01
    Store(uri).write_bytes(victim.file, bytes(data))

    manifest, problems = verify_cache(uri)
    assert len(problems) == 1
    assert f"{uri}/{victim.file} has sha256" in problems[0] and "corrupted" in problems[0]
    assert vocagno(["cache", "verify", uri, "--quiet"]) == 1
    out = capsys.readouterr().out
    assert out.count("FAIL") == 1 and f"{uri}/{victim.file}" in out

    # Stage 2's reader refuses it too, in one line, before any row of it is used.
    plan = DataPlan.from_cache(
        uri,
        student_tokenizer="tinyllama",
        seq_len=32,
        micro_batch_size=2,
        shard_cache=str(tmp_path),
    )
    assert (
        verified_shard(plan, manifest.shards[0]).read_bytes()
        == (local_cache / manifest.shards[0].file).read_bytes()
    )
    with pytest.raises(CacheError, match=f"{victim.file} has sha256") as refused:
        verified_shard(plan, victim)
    assert "\n" not in str(refused.value)
    assert not list(tmp_path.rglob(victim.file))  # no copy of it kept


def test_shard_copies_stay_within_their_bytes_and_are_fetched_ahead(bucket, local_cache, tmp_path):
    uri = f"{bucket}/copies"
    upload_folder(local_cache, uri)
    shards = load_manifest(uri).shards
    assert len(shards) == 6
    bound = int(2.5 * max(s.bytes for s in shards))
    cache = ShardCache(uri, tmp_path, bound, read_ahead=1)
    for i, record in enumerate(shards):
        path = cache.get(record, list(shards[i + 1 : i + 3]))
        assert path.read_bytes() == (local_cache / record.file).read_bytes()
        held = sum(p.stat().st_size for p in cache.folder.glob("shard-*.parquet"))
        assert held <= bound and cache.bytes_held <= bound
        if i + 1 < len(shards):  # the next shard arrives without being asked for
            upcoming = cache.folder / shards[i + 1].file
            # A wait that ends when it comes: a download is two requests (size, then bytes), and
            # one the S3 client retries (3 attempts, 3 s timeouts, backoff) takes over 10 s; a
            # failed read-ahead says why on stderr.
            deadline = time.monotonic() + 120
            while not upcoming.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert upcoming.exists(), f"{upcoming.name} not fetched ahead within 120 s"
    assert len(list(cache.folder.glob("shard-*.parquet"))) < len(shards)  # older ones evicted


def test_a_shard_is_never_counted_as_held_and_as_fetched_at_once(local_cache, tmp_path):
    """The bound counts the copies held and the downloads under way. A download that had become
    a copy while still counted as under way counted twice, and the next read-ahead was refused
    for room it had: a shard never fetched ahead (seen once in four CI runs of the test above,
    and in 1 of 53 repetitions of it here). Each time the cache's lock is let go, no shard is
    both (the bookkeeping, without timing: local copies, one thread fetching)."""
    shards = load_manifest(local_cache).shards
    bound = int(2.5 * max(s.bytes for s in shards))
    cache = ShardCache(str(local_cache), tmp_path / "copies", bound, read_ahead=1)
    both = []

    class CheckedLock:
        lock = threading.Lock()

        def __enter__(self):
            self.lock.acquire()

        def __exit__(self, *exc):
            both.append(set(cache._copies) & set(cache._pending))
            self.lock.release()

    cache._lock = CheckedLock()
    for i, record in enumerate(shards):
        cache.get(record, list(shards[i + 1 : i + 2]))
    cache._fetcher.shutdown(wait=True)
    assert len(both) > len(shards) and not any(both), both


def test_a_failed_read_ahead_is_said_and_the_shard_fetched_again_when_read(
    local_cache, tmp_path, capsys
):
    folder = tmp_path / "cache"
    shutil.copytree(local_cache, folder)
    shards = load_manifest(folder).shards
    moved = tmp_path / shards[1].file
    (folder / shards[1].file).rename(moved)  # gone while it is fetched ahead
    configure()  # the lines on stderr, as a stage-2 process has them
    cache = ShardCache(str(folder), tmp_path / "copies", 1 << 30, read_ahead=1)
    cache.get(shards[0], [shards[1]])
    said, deadline = "", time.monotonic() + 30
    while "ahead failed" not in said and time.monotonic() < deadline:
        time.sleep(0.01)
        said += capsys.readouterr().err
    assert f"[shards] fetching {folder / shards[1].file} ahead failed (CacheError: " in said, said
    assert "it is fetched again when it is read" in said
    moved.rename(folder / shards[1].file)  # back: the read fetches it again
    assert cache.get(shards[1]).read_bytes() == (local_cache / shards[1].file).read_bytes()


def test_a_corpus_in_a_bucket_reads_as_the_same_corpus_locally(bucket, tmp_path):
    from tests.stage1_helpers import shipped_documents, write_jsonl_corpus

    folder = tmp_path / "corpus"
    (folder / "part").mkdir(parents=True)
    write_jsonl_corpus(folder / "a.jsonl", shipped_documents(5))
    write_jsonl_corpus(folder / "part" / "b.jsonl", shipped_documents(7)[5:])
    assert objects_under(f"{bucket}/corpus") == []  # the corpus is all that this test puts there
    Store(f"{bucket}/corpus").write_bytes("a.jsonl", (folder / "a.jsonl").read_bytes())
    Store(f"{bucket}/corpus/part").write_bytes(
        "b.jsonl", (folder / "part" / "b.jsonl").read_bytes()
    )
    options = CorpusOptions(id_column="id")
    local, remote = Corpus(folder, options), Corpus(f"{bucket}/corpus", options)
    assert remote.describe() == local.describe()  # same identity: the caches may be compared
    assert [d.text for d in remote] == [d.text for d in local]
    assert remote.fraction_read() == 1.0
    assert set(download_all(f"{bucket}/corpus")) == {"a.jsonl"}


def test_a_killed_readers_copies_are_removed_by_the_next_reader(tmp_path):
    """A killed process cannot remove its shard copies; the next reader on the host does, and
    keeps the folders of processes that still run and names that are not its own."""
    script = (
        "import sys, time\n"
        "from pipeline.cache.shard_cache import ShardCache\n"
        "cache = ShardCache(sys.argv[1], sys.argv[2], 1 << 20, 1)\n"
        "(cache.folder / 'shard-00000.parquet').write_bytes(b'copy')\n"
        "print(cache.folder, flush=True)\n"
        "time.sleep(60)\n"
    )
    reader = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "cache"), str(tmp_path / "copies")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    orphan = Path(reader.stdout.readline().strip())
    reader.kill()
    reader.wait()
    assert (orphan / "shard-00000.parquet").exists()  # SIGKILL ran no clean-up
    prefix = f"vocagno-shards-{socket.gethostname()}-"
    alive = tmp_path / "copies" / f"{prefix}{os.getpid()}-abc"
    other = tmp_path / "copies" / f"{prefix}1234567-99-abc"  # host "<this>-1234567", not ours
    alive.mkdir()
    other.mkdir()
    cache = ShardCache(str(tmp_path / "cache"), tmp_path / "copies", 1 << 20, 1)
    assert not orphan.exists()
    assert alive.exists() and other.exists() and cache.folder.exists()
