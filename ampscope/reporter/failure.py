"""How a rank's end is told: the exception its training ended on, as the reporter sees it.

A rank's final heartbeat says ``finished`` when training ended normally, and ``failed``, with
the exception's class, message and step, when it ended on an exception. The reporter sees an
exception in four places (``seen_by``):

* ``watch``: ``GradWatch`` notes its ``NonFiniteGradientsError`` as it raises it
  (:func:`note`), so the rank ends failed even when the loop catches it and exits;
* ``uncaught``: the main thread's uncaught exception, on which the process ends, through
  ``sys.excepthook`` and, should another library have replaced that hook without calling
  ours, through what the interpreter keeps of it (``sys.last_exc``) at exit;
* ``thread``: another thread's uncaught exception, through ``threading.excepthook``
  (training run in a thread);
* ``with``: the exit of a ``with`` block over a front-end or an ``HttpReporter``, or of
  the training call an integration closes its front-end after (Lightning's ``fit``, the
  Hugging Face Trainer's ``train``, OLMo-core's ``fit``), which ends the same way
  (:meth:`ClosedByWith.close_after`).

Only the newest noted exception counts. One noted by the watch, a thread or a ``with`` block
is void once the rank reports a step taken after it (a later record's ``time``): training
went on, e.g. after a loop caught the error and restored a checkpoint. An uncaught one ends
the process, so it always counts, even for a reporter closed before it (``try: ...
finally: watch.close()``): the reporter then sends its final heartbeat once more, with the
failure, within its ``exit_timeout``. A thread's exception does that only for a reporter
that this thread closed. ``SystemExit`` (``sys.exit(1)``) is no exception the hooks
see: a rank that exits so ends ``finished`` unless a watch stopped it or it leaves a
``with`` block on a status other than 0 (``sys.exit()`` and ``sys.exit(0)`` end it
``finished`` there too: :func:`ends_normally`).

The hooks are installed once per process, by the first ``HttpReporter``; each calls the
hook that was installed before it (by default Python's, which prints the traceback) first,
and never swallows the exception. Standard library and the schema only.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from ampscope.reporter.schema import (
    MAX_COUNT,
    MAX_FAILURE_MESSAGE,
    MAX_FAILURE_ORIGIN_RANKS,
    MAX_LABEL_LENGTH,
    FailureKind,
    FailureSeenBy,
    RankFailure,
)

__all__ = ["Noted", "forget", "install_hooks", "note", "noted", "void_after"]

MAX_RANKS = 1_000_000
"""Ranks are below this (the schema's bound on a rank)."""


@dataclass(frozen=True, kw_only=True)
class Noted:
    """An exception the rank's training may have ended on, and when it was seen."""

    kind: FailureKind
    exception: str
    message: str
    step: int | None
    """The exception's own step (``NonFiniteGradientsError.step``); ``None``: the newest
    step the rank reported stands for it."""
    origin_ranks: tuple[int, ...] | None
    seen_by: FailureSeenBy
    time: float
    """Wall-clock time it was seen, on the clock of the records' ``time``."""
    thread: int
    """``threading.get_ident()`` of the thread whose exception it was."""

    def failure(self, newest_step: int) -> RankFailure:
        """The schema's failure, at the exception's own step or else ``newest_step``."""
        return RankFailure(
            kind=self.kind,
            exception=self.exception,
            message=self.message,
            step=self.step if self.step is not None else newest_step,
            origin_ranks=None if self.origin_ranks is None else list(self.origin_ranks),
            seen_by=self.seen_by,
        )


def _nonfinite(exc: BaseException) -> BaseException | None:
    """The ``NonFiniteGradientsError`` in ``exc``'s chain (``raise ... from`` or raised while
    handling it), told by its attributes: the reporter does not import the rank side."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(getattr(current, "step", None), int) and hasattr(current, "origin_ranks"):
            return current
        current = current.__cause__ or current.__context__
    return None


def _name(exc: BaseException) -> str:
    name = "".join(type(exc).__qualname__.split()) or "Exception"
    return name.replace('"', "").replace("\\", "")[:MAX_LABEL_LENGTH] or "Exception"


def _message(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # a broken __str__ must not hide the failure itself
        text = "<the exception's message could not be read>"
    if len(text) > MAX_FAILURE_MESSAGE:
        text = text[: MAX_FAILURE_MESSAGE - 1] + "…"
    return text


def describe(exc: BaseException, seen_by: FailureSeenBy, *, thread: int | None = None) -> Noted:
    """What the final heartbeat will say of ``exc``. A non-finite stop anywhere in its chain
    is told as that stop (its step and origin ranks), since it is why training ended."""
    stop = _nonfinite(exc)
    told = stop if stop is not None else exc
    origin = getattr(stop, "origin_ranks", None) if stop is not None else None
    step = getattr(stop, "step", None) if stop is not None else None
    return Noted(
        kind="nonfinite_gradients" if stop is not None else "exception",
        exception=_name(told),
        message=_message(told),
        step=step if isinstance(step, int) and 0 <= step <= MAX_COUNT else None,
        origin_ranks=(
            tuple(sorted({r for r in origin if isinstance(r, int) and 0 <= r < MAX_RANKS}))[
                :MAX_FAILURE_ORIGIN_RANKS
            ]
            if isinstance(origin, tuple | list)
            else None
        ),
        seen_by=seen_by,
        time=time.time(),
        thread=threading.get_ident() if thread is None else thread,
    )


class _Process:
    """What this process noted and which hooks it installed (one instance, ``_PROCESS``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.noted: Noted | None = None
        self.on_fatal: list[Callable[[Noted], None]] = []
        """Called (outside the lock) when a hook sees an exception: the reporters'
        correction of a final heartbeat already sent (``http``)."""
        self.installed = False
        self.previous_excepthook: Callable[..., Any] = sys.__excepthook__
        self.previous_threading_hook: Callable[..., Any] = threading.__excepthook__


_PROCESS = _Process()


def note(
    exc: BaseException, seen_by: FailureSeenBy = "watch", *, thread: int | None = None
) -> Noted | None:
    """Remember ``exc`` as the exception the rank's training may end on. Never raises.

    ``GradWatch`` calls it as it raises ``NonFiniteGradientsError``; the hooks and ``with``
    exits call it too. Costs a few attribute reads: only on the way out of training.

    Returns:
        What was noted; ``None`` if ``exc`` could not be described (nothing is noted then).
    """
    try:
        found = describe(exc, seen_by, thread=thread)
    except Exception:
        return None
    with _PROCESS.lock:
        _PROCESS.noted = found
    return found


def _uncaught() -> BaseException | None:
    """The exception the main thread ended on, at interpreter exit: the interpreter keeps
    it as ``sys.last_exc`` (``sys.last_value`` before Python 3.12). ``None`` while the main
    thread runs (a test runner or a debugger sets those too, for exceptions it handled) and
    in an interactive session, where it may be an old one the session went on after."""
    if threading.main_thread().is_alive() or sys.flags.interactive or hasattr(sys, "ps1"):
        return None
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return exc if isinstance(exc, BaseException) else None


def noted() -> Noted | None:
    """The newest noted exception, if any; the main thread's uncaught exception wins."""
    with _PROCESS.lock:
        found = _PROCESS.noted
    if found is not None and found.seen_by == "uncaught":
        return found
    exc = _uncaught()
    if exc is None:
        return found
    return note(exc, "uncaught") or found


def forget() -> None:
    """Forget the noted exception: a process that handled it and ends normally without a
    new step (rare: a loop that stops on ``NonFiniteGradientsError`` by design) then ends
    ``finished``. Also for tests."""
    with _PROCESS.lock:
        _PROCESS.noted = None


def void_after(found: Noted | None, newest_record_time: float | None) -> Noted | None:
    """``found``, unless the rank reported a step taken after it (``newest_record_time``,
    the newest record's ``time``): training went on, so it did not end on it. The main
    thread's uncaught exception always counts: the process ends on it."""
    if found is None or found.seen_by == "uncaught":
        return found
    if newest_record_time is not None and newest_record_time > found.time:
        return None
    return found


def on_fatal(callback: Callable[[Noted], None]) -> None:
    """Register ``callback`` for exceptions the hooks see (once per callback)."""
    with _PROCESS.lock:
        if callback not in _PROCESS.on_fatal:
            _PROCESS.on_fatal.append(callback)


def _tell(found: Noted) -> None:
    with _PROCESS.lock:
        callbacks = list(_PROCESS.on_fatal)
    for callback in callbacks:
        # Telling the exporter must never stop the exception's own report.
        with contextlib.suppress(Exception):
            callback(found)


def _excepthook(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    found = note(exc, "uncaught") if isinstance(exc, BaseException) else None
    try:
        # The traceback first: telling the exporter may wait for it (up to exit_timeout).
        _PROCESS.previous_excepthook(exc_type, exc, tb)
    finally:
        if found is not None:
            _tell(found)


def _threading_hook(args: threading.ExceptHookArgs) -> None:
    found = None
    if args.exc_value is not None:
        ident = args.thread.ident if args.thread is not None else None
        found = note(args.exc_value, "thread", thread=ident)
    try:
        _PROCESS.previous_threading_hook(args)
    finally:
        if found is not None:
            _tell(found)


def install_hooks() -> None:
    """Install the two hooks, once per process, each calling the one installed before it.

    A hook installed later by someone else wraps ours in turn (as ours wraps theirs), so both
    run; ours is not installed again over it.
    """
    with _PROCESS.lock:
        if _PROCESS.installed:
            return
        _PROCESS.installed = True
        _PROCESS.previous_excepthook = sys.excepthook
        _PROCESS.previous_threading_hook = threading.excepthook
        sys.excepthook = _excepthook
        threading.excepthook = _threading_hook
    atexit.register(_at_exit)


def _at_exit() -> None:
    # The uncaught exception, should a hook installed after ours not have called it: tell
    # the reporters closed before (a correction already sent is not sent again).
    found = noted()
    if found is not None and found.seen_by == "uncaught":
        _tell(found)


_Closing = TypeVar("_Closing", bound="ClosedByWith")


STOPPED_ON_PURPOSE = frozenset({("optuna.exceptions", "TrialPruned")})
"""(module, class) of exceptions a library raises to end training on purpose: Optuna's
pruner stops an unpromising trial of a sweep with ``TrialPruned`` (its Lightning callback
raises it out of ``fit``). Named, not imported: the library need not be installed."""


def ends_normally(exc: BaseException) -> bool:
    """Whether leaving a ``with`` block on ``exc`` is a normal end: ``sys.exit()`` or
    ``sys.exit(0)`` (a requeue or preemption handler saves its checkpoint and leaves so),
    a generator closed, or a sweep's pruner stopping a trial (``STOPPED_ON_PURPOSE``, or a
    subclass). ``sys.exit`` with another status is the process saying it failed."""
    if isinstance(exc, GeneratorExit):
        return True
    if isinstance(exc, SystemExit):
        return exc.code in (None, 0)
    return any((k.__module__, k.__qualname__) in STOPPED_ON_PURPOSE for k in type(exc).__mro__)


class ClosedByWith:
    """``with`` for what a rank closes (a front-end, a reporter): the block's end closes it,
    and a block left by an exception ends the rank ``failed`` with it on the exporter, unless
    it is a normal end (:func:`ends_normally`). The exception goes on propagating."""

    def close(self, timeout: float = 1.0) -> None:
        raise NotImplementedError

    @property
    def closed_already(self) -> bool:
        """Whether ``close`` ran: its final heartbeat went out, and an exception seen after
        it is not the rank's to report (the process's hooks still see one that ends it)."""
        return False

    def __enter__(self: _Closing) -> _Closing:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close_after(exc)

    def close_after(self, exc: BaseException | None) -> None:
        """Close as leaving a ``with`` block on ``exc`` does (``None``: a normal end).

        For an integration whose library calls it back when training raises (Lightning's
        ``on_exception``, OLMo-core's ``on_error``) or whose training call it wraps (the
        Trainer's ``train``): the rank ends ``failed`` with ``exc``, told as a ``with``
        block tells it, unless it is a normal end (:func:`ends_normally`). Never raises
        from the noting; the exception itself is the caller's to re-raise.
        """
        if self.closed_already:
            # Noted now, it would be a later front-end's or reporter's to end on.
            return
        if exc is not None and not ends_normally(exc):
            note(exc, "with")
        self.close()
