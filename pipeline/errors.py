"""The project's own error types: each says what failed and where, for a message without a traceback."""

import signal
import sys
import threading
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


class TrainingDiverged(VocagnoError):
    """A run's loss or gradient norm turned NaN or infinite; it stops before saving that step."""


class StoppedBySignal(VocagnoError):
    """A run stopped on SIGINT/SIGTERM after saving its work; exits 128 + the signal's number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code(prog: str, action: Callable[[], int | None]) -> int:
    """Run a command's `action`: our own errors, and a path the system refuses (unwritable,
    missing, a file where a folder should be, a full disk), become one line on stderr and exit
    code 2; Ctrl-C and SIGTERM become one line and 128 + the signal's number, as shells expect."""
    global _stopped_by
    _stopped_by = 0
    main_thread = threading.current_thread() is threading.main_thread()  # where signals arrive
    previous = (
        {s: signal.signal(s, _stop_as_interrupt) for s in STOP_SIGNALS} if main_thread else {}
    )
    try:
        return int(action() or 0)
    except VocagnoError as exc:
        if isinstance(exc, StoppedBySignal):  # asked for, not an error
            print(f"{prog}: {exc}", file=sys.stderr)
            return 128 + exc.signum
        # One line even where a message quotes a library's multi-line text.
        print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except OSError as exc:
        path = f"{exc.filename}: " if exc.filename is not None else ""
        print(f"{prog}: error: {path}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 128 + (_stopped_by or signal.SIGINT)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


_stopped_by = 0  # the signal that turned into a KeyboardInterrupt, for the exit code


def _stop_as_interrupt(signum: int, frame) -> None:
    """SIGINT and SIGTERM (Slurm, Kubernetes, `kill`) unwind alike: locks released, partial files
    removed, one line. By default Python would die on the spot of a SIGTERM, and it leaves SIGINT
    ignored where the run was started so (a shell script's `cmd &`, many CI runners), as stage 2
    does not. The signal is noted apart from the exception, which libraries (Ray's wait) may catch
    and raise anew."""
    global _stopped_by
    _stopped_by = signum
    raise KeyboardInterrupt
