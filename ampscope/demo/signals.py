"""Stop signals for commands that start child processes: SIGTERM and SIGHUP end the command
as Ctrl-C (SIGINT) does, so that its ``finally`` blocks stop every child it started."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What ``kill``, ``timeout``, systemd, job schedulers, a closed terminal and Ctrl-C send."""


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread by the first stop signal; a ``KeyboardInterrupt``, so code
    that handles Ctrl-C handles every stop signal alike."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        """The shell's convention for a command ended by a signal: 128 + its number
        (130 for SIGINT, 129 for SIGHUP, 143 for SIGTERM)."""
        return 128 + self.signum


def exit_status(interrupt: KeyboardInterrupt) -> int:
    """128 + the signal that raised ``interrupt`` (a plain ``KeyboardInterrupt``: SIGINT)."""
    if isinstance(interrupt, Interrupted):
        return interrupt.exit_status
    return 128 + signal.SIGINT


def _raise_once(signum: int, frame: FrameType | None) -> None:
    # Later signals are ignored: they must not cut short the cleanup the first one started
    # (which is bounded: children are terminated, then killed after a few seconds).
    for stop in STOP_SIGNALS:
        signal.signal(stop, signal.SIG_IGN)
    raise Interrupted(signum)


@contextlib.contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """Within the block, the first of ``STOP_SIGNALS`` raises ``Interrupted`` in the main
    thread (the others are then ignored); the previous handlers come back on exit. Call
    from the main thread only (``signal.signal``'s rule)."""
    previous = {stop: signal.getsignal(stop) for stop in STOP_SIGNALS}
    for stop in STOP_SIGNALS:
        signal.signal(stop, _raise_once)
    try:
        yield
    finally:
        for stop, handler in previous.items():
            signal.signal(stop, handler)
