"""An exclusive hold on a local output folder for the life of one run: an `flock` on a lock file
inside it, which names its holder. The kernel releases it when the holder dies, even by SIGKILL,
so a crash never leaves a stale lock (object storage has no flock: pipeline.storage.lease).

A forked child (a data-loader worker) would share the lock and keep it after its parent died, so
children drop their copy at once; the parent's hold is unaffected.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from pipeline.errors import CacheError

_held: set[int] = set()  # descriptors of the locks this process holds


def _drop_in_child() -> None:
    for fd in _held:
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_drop_in_child)


class FolderLock:
    """`with FolderLock(folder, name, writer):` holds `folder/name`; `writer` names the kind of
    run in the refusal another one gets ("another stage-1 run")."""

    def __init__(self, folder: Path, name: str, writer: str):
        self.folder = Path(folder)
        self.path = self.folder / name
        self.writer = writer
        self._fd: int | None = None

    def __enter__(self) -> FolderLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "unknown"
            os.close(fd)
            raise CacheError(
                f"{self.folder} is being written by another {self.writer} ({holder}); "
                "wait for it to finish or stop it"
            ) from None
        os.ftruncate(fd, 0)
        holder = f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
        os.pwrite(fd, holder.encode("utf-8"), 0)
        self._fd = fd
        _held.add(fd)
        return self

    def check(self) -> None:
        """A flock cannot be lost while its process lives (LeaseLock.check's counterpart)."""

    def __exit__(self, *exc) -> None:
        if self._fd in _held:  # not in a forked child, which closed it already
            _held.discard(self._fd)
            os.close(self._fd)  # releases the flock
        self._fd = None
