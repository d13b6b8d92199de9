"""The SIGTERM handler: a rank that its launcher stops says so before it goes.

torchrun's elastic agent stops its workers with SIGTERM (a membership change, or a failed
worker: every survivor is stopped and a new generation starts, perhaps with fewer or
renumbered ranks), and so do Slurm (preemption, the time limit) and Kubernetes (an
eviction). Python's default disposition for SIGTERM ends the process at once, without
``atexit``, so the reporter's final heartbeat never went and the exporter called the rank
``lost`` after its stale TTL: ``lost_rank`` and ``AmpscopeRankLost`` paged for a healthy
operation. With the handler, the rank's reporters send what waits and a final heartbeat
that carries the signal (``Heartbeat.stop_signal``): the rank ends ``stopped``, never lost.
A process killed without a chance to speak (SIGKILL, a dead node) still reads ``lost``.

The handler is installed once per process, from the main thread (``signal.signal`` works
nowhere else), by the first ``HttpReporter`` that asks (``sigterm_handler=True``, the
default; ``AMPSCOPE_SIGTERM_HANDLER=off`` turns it off for the ``auto`` reporter). One
handler for every reporter and scaler of the process: it stops them all under one shared
deadline, and the previous disposition is chained once, not once per reporter. The
disposition found decides what follows ours:

* ``SIG_DFL``: restored, and SIGTERM sent again to the process, which then ends as the
  launcher expects (killed by signal 15, exit status -15 as ``subprocess`` reports it,
  143 in a shell); unless a framework whose handler, installed after ours, ends the process
  itself said so (:func:`leave_end_to_wrapper`: Lightning's integration): called from
  that handler, ours returns after the goodbye;
* a Python handler (a library's, the user's): called after ours, with the same arguments;
* ``SIG_IGN``, or a handler installed outside Python: left alone, no handler installed.

Bounded: the reporters get their ``exit_timeout`` (2 s by default) in all, well within the
30 s torchrun, Slurm (``KillWait``) and Kubernetes (``terminationGracePeriodSeconds``) wait
before SIGKILL. Standard library only.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

logger = logging.getLogger("ampscope")

__all__ = ["HANDLER_ENV", "handler_from_env", "install", "installed", "leave_end_to_wrapper"]

HANDLER_ENV = "AMPSCOPE_SIGTERM_HANDLER"
"""``off`` (or ``0``, ``false``, ``none``, ``disabled``): reporters built without an explicit
``sigterm_handler`` install no SIGTERM handler."""

_OFF_VALUES = frozenset({"off", "none", "false", "0", "disabled"})


@dataclass
class _Installed:
    """The process's one handler's state."""

    previous: Any = None
    """The disposition found when ours was installed (``SIG_DFL``, or a Python handler)."""
    on_stop: Callable[[int], None] | None = None
    """What the handler does first: the reporters' goodbye (``ampscope.reporter.http``)."""
    wrapper_ends: bool = False
    """A framework that installs its SIGTERM handler after ours, chains ours and ends the
    process itself (Lightning: at the batch's end, after its checkpoint on the exception) said
    so (:func:`leave_end_to_wrapper`): called from such a handler, ours does not end the
    process by SIG_DFL."""
    saying_goodbye: bool = False
    """Set while ``on_stop`` runs: a second SIGTERM meanwhile goes straight to the previous
    disposition (a launcher that insists is not kept waiting a second time)."""
    pid: int | None = None
    """The process that installed it. Once per process: a library that replaced ours later
    (and may call ours as its previous handler) is never wrapped by ours again, which
    would make each call the other for ever."""


_lock = threading.Lock()
_installed = _Installed()


def handler_from_env() -> bool:
    """Whether ``AMPSCOPE_SIGTERM_HANDLER`` lets a reporter install the handler (unset: yes)."""
    return os.environ.get(HANDLER_ENV, "").strip().lower() not in _OFF_VALUES


def installed() -> bool:
    """Whether SIGTERM's current handler is ours."""
    return signal.getsignal(signal.SIGTERM) is _handle


def install(on_stop: Callable[[int], None]) -> bool:
    """Install the SIGTERM handler, once per process, calling ``on_stop(signum)`` first.

    Call from the thread that builds a reporter; anywhere but the main thread this does
    nothing (``signal.signal`` raises there), so a reporter built on the main thread later
    installs it. Idempotent: a second call, or one in a forked child (which inherits the
    handler), keeps the handler and the ``on_stop`` already there; and once installed, never
    again in this process, even where another handler replaced ours since (it may chain
    ours). Costs two system calls.

    Args:
        on_stop: Sends every live reporter's final heartbeat with the signal; must return
            within a bounded time and may raise (logged, never re-raised).

    Returns:
        Whether the handler is in place after the call.
    """
    if threading.current_thread() is not threading.main_thread():
        return installed()
    with _lock:
        current = signal.getsignal(signal.SIGTERM)
        if current is _handle or _installed.pid == os.getpid():
            return current is _handle
        # SIG_IGN: someone wants the process to outlive SIGTERM; a handler installed
        # outside Python (None) cannot be chained. Either way, not ours to change.
        if current is None or current == signal.SIG_IGN:
            return False
        # Known before ours is in place: a SIGTERM right after must find what to chain.
        _installed.previous, _installed.on_stop = current, on_stop
        try:
            signal.signal(signal.SIGTERM, _handle)
        except (ValueError, OSError):  # not the main interpreter, or no SIGTERM here
            return False
        _installed.pid = os.getpid()
        return True


def leave_end_to_wrapper() -> None:
    """Say that the handler a framework installs after ours, and that calls ours, ends the
    process itself: then ours, called from it, says goodbye and returns instead of ending the
    process by SIGTERM's default. Lightning's does (it notes the signal and stops at the
    batch's end, after its ``OnExceptionCheckpoint`` and teardown): its integration calls
    this. A plain wrapper (log, then call the previous handler) relies on ours to end the
    process as the default it replaced would have, so without this call ours does."""
    _installed.wrapper_ends = True


def _handle(signum: int, frame: FrameType | None) -> None:
    # Called by a handler installed after ours that ends the process itself (see
    # leave_end_to_wrapper): ending it here by SIG_DFL would take its graceful stop away.
    wrapped = signal.getsignal(signal.SIGTERM) is not _handle and _installed.wrapper_ends
    # Ours first: a chained handler may end the process (sys.exit, os._exit) or raise to
    # unwind the training loop, and the goodbye must have gone by then.
    on_stop = _installed.on_stop
    if on_stop is not None and not _installed.saying_goodbye:
        _installed.saying_goodbye = True  # handlers run on the main thread only: no race
        try:
            on_stop(signum)
        except Exception:  # the launcher's signal must still take effect
            logger.exception("ampscope reporter: the SIGTERM handler failed to say goodbye")
        finally:
            _installed.saying_goodbye = False
    previous = _installed.previous
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL and not wrapped:
        # The default ends the process by the signal: restore it and send the signal again,
        # so the launcher sees what it would have seen without us (killed by SIGTERM).
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
