"""Local copies of shards that live in object storage, for stage 2's readers.

A shard is downloaded whole into a local folder, its size and sha256 checked against the manifest
on the way in (a corrupted object is named and refused before a row of it is used), then read
locally like any cached shard. The shards a reader will need next are fetched ahead on background
threads, so the training loop does not wait on the store; one that fails is said in a line, and
the shard fetched again when it is read. The folder holds at most `max_bytes`:
the least recently used copies are deleted first, never the one being read (one shard larger than
the bound is still kept while it is read). A killed process cannot delete its folder; the next
reader on the host does (remove_orphaned_copies).
"""

from __future__ import annotations

import hashlib
import multiprocessing.util
import os
import shutil
import socket
import tempfile
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from pipeline.cache.manifest import ShardRecord
from pipeline.cache.verify import check_shard_bytes
from pipeline.log import get_logger
from pipeline.storage.store import Store

_CHUNK = 1 << 20
_log = get_logger("shards")


def _host_prefix() -> str:
    # The host as well: a --shard-cache on a filesystem that several nodes share holds folders of
    # processes this node cannot see.
    return f"vocagno-shards-{socket.gethostname()}-"


def remove_orphaned_copies(parent: Path) -> None:
    """Delete the copy folders that processes of this host left under `parent` when they were
    killed (a normal exit removes its own). A folder whose process still runs, or whose process
    id was reused, is kept."""
    prefix = _host_prefix()
    for folder in parent.glob(f"{prefix}*"):
        # {prefix}{pid}-{mkdtemp's suffix, which has no "-"}; anything else is not ours
        rest = folder.name[len(prefix) :].split("-")
        if len(rest) == 2 and rest[0].isdigit() and not _running(int(rest[0])):
            shutil.rmtree(folder, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class ShardCache:
    """Verified local copies of one remote cache's shards, bounded in bytes, fetched ahead."""

    def __init__(self, location: str, folder: str | Path, max_bytes: int, read_ahead: int):
        self.store = Store(location)
        parent = Path(folder) if folder else Path(tempfile.gettempdir())
        parent.mkdir(parents=True, exist_ok=True)
        remove_orphaned_copies(parent)
        # One folder per process: data-loader workers never delete each other's copies.
        self.folder = Path(tempfile.mkdtemp(prefix=f"{_host_prefix()}{os.getpid()}-", dir=parent))
        # Removed when the process exits, data-loader workers included (they skip atexit).
        multiprocessing.util.Finalize(None, shutil.rmtree, (str(self.folder), True), exitpriority=0)
        self.max_bytes = max_bytes
        self.read_ahead = read_ahead
        self._copies: OrderedDict[str, int] = OrderedDict()  # file -> bytes, least recent first
        self._pending: dict[str, tuple[Future, int]] = {}  # file -> (its download, bytes)
        self._lock = threading.Lock()
        self._fetcher = ThreadPoolExecutor(max(1, read_ahead), thread_name_prefix="shard-fetch")

    @property
    def bytes_held(self) -> int:
        with self._lock:
            return sum(self._copies.values())

    def get(self, record: ShardRecord, upcoming: list[ShardRecord] = ()) -> Path:
        """The verified local copy of `record`'s shard (CacheError if the object does not match the
        manifest); starts fetching the first `read_ahead` of `upcoming`, making room for them by
        deleting the least recently used other copies."""
        path = self._fetch(record).result()
        ahead = [r for r in dict.fromkeys(upcoming) if r.file != record.file][: self.read_ahead]
        with self._lock:
            self._copies.move_to_end(record.file)
            wanted = [
                r for r in ahead if r.file not in self._copies and r.file not in self._pending
            ]
            incoming = sum(size for _, size in self._pending.values())
            incoming += sum(r.bytes for r in wanted)
            self._evict({record.file, *(r.file for r in ahead)}, incoming)
            room = self.max_bytes - sum(self._copies.values())
            room -= sum(size for _, size in self._pending.values())
            fetch = []
            for ahead_record in wanted:
                if ahead_record.bytes > room:
                    break
                room -= ahead_record.bytes
                fetch.append(ahead_record)
        for ahead_record in fetch:
            self._fetch(ahead_record).add_done_callback(self._report_failed_ahead(ahead_record))
        return path

    def _report_failed_ahead(self, record: ShardRecord):
        """A read-ahead's failure has no reader yet: it is said in a line, and the shard is
        fetched again when it is read (a lasting fault is raised then)."""

        def report(download: Future) -> None:
            if (error := download.exception()) is not None:
                _log.warning(
                    f"fetching {self.store.display(record.file)} ahead failed "
                    f"({type(error).__name__}: {error}); it is fetched again when it is read"
                )

        return report

    def _fetch(self, record: ShardRecord) -> Future:
        with self._lock:
            if record.file in self._copies:
                done: Future = Future()
                done.set_result(self.folder / record.file)
                return done
            if record.file not in self._pending:
                future = self._fetcher.submit(self._download, record)
                self._pending[record.file] = (future, record.bytes)
            return self._pending[record.file][0]

    def _download(self, record: ShardRecord) -> Path:
        dest = self.folder / record.file
        partial = dest.with_name(f".{record.file}.part")
        digest, size = hashlib.sha256(), 0
        try:
            try:
                with self.store.open_stream(record.file) as stream, open(partial, "wb") as out:
                    while chunk := stream.read(_CHUNK):
                        digest.update(chunk)
                        size += len(chunk)
                        out.write(chunk)
            except FileNotFoundError:
                size = None
            check_shard_bytes(self.store.display(record.file), size, digest.hexdigest(), record)
            os.replace(partial, dest)
            with self._lock:
                # held and no longer fetched in one step: counted as both, its bytes would be
                # counted twice against the bound, and the next read-ahead refused for room
                self._copies[record.file] = size
                self._pending.pop(record.file, None)
            return dest
        finally:
            partial.unlink(missing_ok=True)
            with self._lock:
                self._pending.pop(record.file, None)  # a failed download's

    def _evict(self, keep: set[str], incoming: int) -> None:
        """Delete least recently used copies, except `keep`, until they and `incoming` bytes fit
        the bound (lock held)."""
        total = sum(self._copies.values()) + incoming
        for name in list(self._copies):
            if total <= self.max_bytes:
                break
            if name not in keep:
                total -= self._copies.pop(name)
                (self.folder / name).unlink(missing_ok=True)
