"""Log lines for every vocagno process: plain `[tag] message` lines on stderr, suited to job logs.

Library code takes a logger from `get_logger(tag)`; each entry point (a command, a Ray job, a Ray
actor, a script) calls `configure()` once, so nothing is printed behind an application's back.
"""

from __future__ import annotations

import logging
import sys
import time

_ROOT = "vocagno"


def get_logger(tag: str) -> logging.Logger:
    """The logger whose lines read `[tag] message`."""
    return logging.getLogger(f"{_ROOT}.{tag}")


class _Format(logging.Formatter):
    def __init__(self, separated: bool):
        super().__init__()
        self.separated = separated

    def format(self, record: logging.LogRecord) -> str:
        tag = record.name.removeprefix(f"{_ROOT}.")
        if not self.separated:
            return f"[{tag}] {record.getMessage()}"
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        return f"\n[{tag} {stamp}] {record.getMessage()}"


class _Stderr(logging.Handler):
    """Writes to sys.stderr as it is at each line (pytest and Ray replace it), flushed at once."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


def configure(separated: bool = False) -> None:
    """Show vocagno's INFO lines on stderr; a second call only changes the layout.

    `separated`: each line opens with a blank line and carries the time, for a console where
    subprocesses' output runs between our lines (the demo).
    """
    root = logging.getLogger(_ROOT)
    root.setLevel(logging.INFO)
    root.propagate = False  # one line each, whatever the host application does with the root
    handler = next((h for h in root.handlers if isinstance(h, _Stderr)), None)
    if handler is None:
        handler = _Stderr()
        root.addHandler(handler)
    handler.setFormatter(_Format(separated))


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """A count and its noun in agreement: `1 unit`, `2 units`, `1,024 documents`."""
    return f"{count:,} {noun if count == 1 else plural or noun + 's'}"
