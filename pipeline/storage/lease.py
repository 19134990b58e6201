"""An exclusive hold on a prefix in object storage, where there is no flock: a lock object that
names its holder and when its lease ends, renewed while the holder lives.

A run that dies stops renewing, so its lock lapses after one lease and the rerun may go ahead; a
live one renews every third of the lease. Two runs starting at the same moment both write the lock,
wait `settle` seconds and read it back: only the last writer finds its own token and goes on.
That read-back closes the race as long as a run's read and write of the lock are less than
`settle` apart (milliseconds in practice); stores with conditional writes (S3's If-None-Match)
would close it fully, but pyarrow does not expose them. Lease ends are wall-clock times, so the
hosts' clocks must agree to well within a lease.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid

from pipeline.errors import CacheError
from pipeline.io import temporary_affixes
from pipeline.storage.store import Store


class LeaseLock:
    """`with LeaseLock(store, name, lease):` holds `store/name` for the life of the block."""

    def __init__(
        self,
        store: Store,
        name: str,
        lease: float,
        settle: float = 1.0,
        log=print,
        clock=time.time,
    ):
        """`clock`: the wall-clock time that lease ends are stamped with and compared to."""
        self.store, self.name, self.lease, self.settle, self.log = store, name, lease, settle, log
        self.clock = clock
        self.token = uuid.uuid4().hex
        self.holder = f"pid {os.getpid()} on {socket.gethostname()}"
        self.lost: str | None = None  # why the lock is no longer ours, if it is not
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def _read(self) -> dict | None:
        try:
            record = self.store.read_json(self.name)
        except (FileNotFoundError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def _write(self) -> None:
        expires = self.clock() + self.lease
        self.store.write_json(
            self.name, {"token": self.token, "holder": self.holder, "expires": expires}
        )

    def _refusal(self, record: dict) -> CacheError:
        left = max(0.0, float(record.get("expires", 0)) - self.clock())
        return CacheError(
            f"{self.store} is being written by another stage-1 run ({record.get('holder')}, "
            f"lease ends in {left:.0f} s); wait for it to finish or stop it (a stopped run's lock "
            f"{self.store.display(self.name)} lapses when its lease ends)"
        )

    def __enter__(self) -> LeaseLock:
        current = self._read()
        if current is not None and float(current.get("expires", 0)) > self.clock():
            raise self._refusal(current)
        self._write()
        time.sleep(self.settle)
        current = self._read()
        if current is None or current.get("token") != self.token:
            raise self._refusal(current or {"holder": "unknown"})
        self._renewer = threading.Thread(target=self._renew, name="lease", daemon=True)
        self._renewer.start()
        return self

    def _renew(self) -> None:
        while not self._stop.wait(self.lease / 3):
            try:
                current = self._read()
                if current is None or current.get("token") != self.token:
                    self.lost = f"{(current or {}).get('holder', 'nobody')} holds it now"
                    self.log(f"lost the lock {self.store.display(self.name)}: {self.lost}")
                    return
                self._write()
            except OSError as exc:  # a store briefly unreachable: try again next period
                self.log(f"could not renew the lock {self.store.display(self.name)}: {exc}")

    def check(self) -> None:
        """CacheError if the lease lapsed and another run took the lock: do not publish."""
        if self.lost is not None:
            raise CacheError(
                f"the lock on {self.store} was lost ({self.lost}); not writing the manifest"
            )

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        current = self._read()
        if current is not None and current.get("token") == self.token:
            # No write of the lock is in flight now: ours have stopped, and nobody else writes it
            # while it is ours. So the temporaries of a killed holder's renewals can go with it.
            for name in self.store.names("*".join(temporary_affixes(self.name))):
                self.store.delete(name)
            self.store.delete(self.name)
