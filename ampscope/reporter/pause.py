"""A rank that stops stepping on purpose: a checkpoint save, an evaluation loop, the work
after training. The training loop says so (``with scaler.paused("checkpoint"):``, or
:func:`paused` where no front-end is at hand); while a pause is open the reporter's
heartbeats carry its reason and age, and the exporter holds the rank ``running`` for up to
its ``pause_limit_s`` (2 h by default) instead of its ``stall_after_s`` (10 min) before it
calls it ``stalled``. A real hang still stalls: one whose every rank sits in a collective
says no pause, and a pause left open ends, on the exporter's side, with the rank's next
step (one that began before its newest step is a leftover the exporter ignores).

The pauses are the process's (the rank's), not one front-end's: a scaler and a watch of one
rank, or an integration's hook and the user's own ``with`` block, pause the same rank.
Pauses nest and may overlap across threads: the rank is paused while any is open; it says
the newest one's reason and the age of the oldest (the rank took no step since then).

Cost: opening or ending a pause takes a lock and a dict update; nothing happens per step.
The heartbeat thread reads the open pauses under the same lock. Standard library only.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from dataclasses import dataclass
from types import TracebackType

__all__ = ["MAX_REASON_LENGTH", "Pause", "PauseNow", "current", "paused"]

MAX_REASON_LENGTH = 64
"""Longest reason a heartbeat carries (the schema's bound); longer ones are cut."""

_NOT_LABEL = re.compile(r"[^A-Za-z0-9_.:/@+=-]+")

_lock = threading.Lock()
_open: dict[int, tuple[str, float]] = {}
"""Open pauses: id -> (reason, ``time.monotonic()`` when it began), oldest first."""
_ids = itertools.count()


@dataclass(frozen=True, kw_only=True)
class PauseNow:
    """What a heartbeat says of the rank's open pauses."""

    reason: str
    """The newest open pause's reason."""
    seconds: float
    """Since the oldest open pause began (the rank's monotonic clock)."""


def reason_label(reason: object) -> str:
    """``reason`` as the schema takes it: a short label (letters, digits, ``_.:/@+=-``);
    other characters become ``-``, and it is cut to ``MAX_REASON_LENGTH``. Never raises, so
    that a telemetry call never breaks training: an empty reason reads ``pause``."""
    text = _NOT_LABEL.sub("-", str(reason)).strip("-")[:MAX_REASON_LENGTH]
    return text or "pause"


class Pause:
    """One open pause; ends on :meth:`end` or at the end of its ``with`` block.

    Returned by :func:`paused` and the front-ends' ``paused()``. Ending it twice, or from
    another thread than the one that opened it, is fine (the second end does nothing).
    """

    __slots__ = ("_id", "reason")

    def __init__(self, reason: object) -> None:
        self.reason = reason_label(reason)
        self._id: int | None = next(_ids)
        with _lock:
            _open[self._id] = (self.reason, time.monotonic())

    @property
    def open(self) -> bool:
        """Whether the pause has not ended yet."""
        return self._id is not None

    def end(self) -> None:
        """End the pause (the rank steps again, or another pause takes over). Idempotent."""
        pause_id, self._id = self._id, None
        if pause_id is not None:
            with _lock:
                _open.pop(pause_id, None)

    def __enter__(self) -> Pause:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.end()

    def __repr__(self) -> str:
        return f"Pause({self.reason!r}, open={self.open})"


def paused(reason: object) -> Pause:
    """Say that this rank stops stepping on purpose, until the pause ends.

    ``with ampscope.paused("checkpoint"): save(...)``, or ``pause = paused("eval")`` ...
    ``pause.end()`` where the start and the end are two callbacks. The front-ends'
    ``paused()`` is the same call.

    Args:
        reason: What the rank does meanwhile (``checkpoint``, ``eval``...): shown by the
            exporter's API, its web view and ``ampscope status``; made a short label (see
            :func:`reason_label`).

    Returns:
        The open :class:`Pause` (a context manager).
    """
    return Pause(reason)


def current() -> PauseNow | None:
    """The rank's open pauses as a heartbeat says them; ``None`` when none is open. O(open
    pauses), under the lock (the heartbeat thread's call)."""
    with _lock:
        if not _open:
            return None
        started = min(began for _, began in _open.values())
        reason = next(reversed(_open.values()))[0]
    return PauseNow(reason=reason, seconds=max(0.0, time.monotonic() - started))
