"""The project's own error types: each says what failed and where, for a message without a traceback."""

import sys
from collections.abc import Callable


class VocagnoError(Exception):
    """Base class; the CLI prints these as one clear line and exits non-zero."""


class TokenizerError(VocagnoError):
    """A tokenizer could not be loaded, or cannot give character offsets."""


class CorpusError(VocagnoError):
    """A corpus file or record is unreadable or malformed."""


class CacheError(VocagnoError):
    """A cache (shards or manifest) is missing, corrupt, or from a different producer."""


class ConfigError(VocagnoError):
    """Invalid options or manifest."""


def exit_code(prog: str, action: Callable[[], int | None]) -> int:
    """Run a command's `action`: our own errors, and a path the system refuses (unwritable,
    missing, a file where a folder should be, a full disk), become one line on stderr and exit
    code 2; Ctrl-C becomes one line and 130, as shells expect."""
    try:
        return int(action() or 0)
    except VocagnoError as exc:
        # One line even where a message quotes a library's multi-line text.
        print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except OSError as exc:
        path = f"{exc.filename}: " if exc.filename is not None else ""
        print(f"{prog}: error: {path}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
