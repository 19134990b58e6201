"""A stop that saves its work: SIGINT (Ctrl-C) or SIGTERM (what Slurm and Kubernetes send before
they kill) asks the run to finish the step in flight, write a checkpoint on every rank with the
usual atomic protocol, and exit 128 + the signal's number; a second signal stops at once.

Ranks must agree on the step they stop after, or the collective checkpoint would hang: each rank's
request travels in the step's one all-reduce (the logged totals), so every rank sees the same sum
at the same step, with no extra synchronization.
"""

from __future__ import annotations

import signal
import sys
import threading

from pipeline.errors import STOP_SIGNALS


class StopRequest:
    def __init__(self) -> None:
        self.signum = 0  # the first stop signal received, 0 while none
        self._previous: dict = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # where Python takes signals
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.signum:
            raise KeyboardInterrupt  # the second signal: stop now, as without this handler
        self.signum = signum
        print(
            f"\nstage 2: {signal.Signals(signum).name} received: finishing this step and saving "
            "a checkpoint (send it again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    @property
    def vote(self) -> float:
        """This rank's request, to be summed over ranks with the step's totals."""
        return 1.0 if self.signum else 0.0

    @property
    def exit_signal(self) -> int:
        """The signal to report: this rank's, or SIGTERM where another rank was asked."""
        return self.signum or signal.SIGTERM


def ignore_interrupts_in_workers(worker_id: int) -> None:
    """Data-loader workers share the terminal's process group, so Ctrl-C reaches them too; the
    main process decides when to stop, and a worker that died first would fail the step."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
