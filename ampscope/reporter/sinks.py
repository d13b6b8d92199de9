"""Where records go on the rank: the ``Sink`` interface every destination implements, and two
local sinks (hand records to a function, or append them to a JSON Lines file).

Both local sinks are safe to call from several threads.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import IO, Protocol, runtime_checkable

from ampscope.reporter.schema import StepRecord

__all__ = ["CallbackSink", "JsonlSink", "Sink"]


@runtime_checkable
class Sink(Protocol):
    """A destination for step records.

    ampscope calls ``emit`` from its own background thread, never from the training
    thread, one record at a time in step order. A sink may raise: the caller counts
    the error, logs it once, and keeps going, so a broken sink never breaks training.
    Records are frozen and their lists may be shared with later records (an empty
    ``spikes`` list, say): read them, copy what you change (``record.model_copy``).
    """

    def emit(self, record: StepRecord) -> None:
        """Accept one record. Must not block for long; buffer and send elsewhere if slow."""

    def close(self, timeout: float) -> None:
        """Flush what is buffered, waiting at most ``timeout`` seconds, and release resources.

        Called once; ``emit`` is not called afterwards.
        """


class CallbackSink:
    """Calls ``fn(record)`` for every record, on ampscope's telemetry thread.

    ``fn`` runs synchronously on that thread, so keep it quick; an exception from it
    propagates to the caller, which counts and logs it (see ``Sink``).

    Args:
        fn: Called with each ``StepRecord``, in step order.
        on_close: Optional, called once by ``close``.
    """

    def __init__(
        self, fn: Callable[[StepRecord], object], *, on_close: Callable[[], object] | None = None
    ) -> None:
        if not callable(fn):
            raise TypeError(f"CallbackSink needs a callable, got {type(fn).__name__}")
        self._fn = fn
        self._on_close = on_close
        self._closed = False

    def emit(self, record: StepRecord) -> None:
        """Call ``fn(record)``."""
        self._fn(record)

    def close(self, timeout: float = 0.0) -> None:
        """Call ``on_close`` once (``timeout`` is unused: nothing is buffered)."""
        if not self._closed:
            self._closed = True
            if self._on_close is not None:
                self._on_close()


class JsonlSink:
    """Appends one JSON object per record (``record.model_dump_json()``) to a file.

    The file is opened (created if missing, appended to if present) at construction, so
    a bad path fails at once rather than on the first record. Writes are buffered and
    flushed by ``flush``/``close`` and at interpreter exit. Each line parses back with
    ``StepRecord.model_validate_json(line)``.

    Args:
        path: File to append to; its directory must exist.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self.written = 0
        """Records written so far."""
        # Not closed explicitly: close the file at interpreter exit or when collected.
        self._finalizer = weakref.finalize(self, self._file.close)

    def emit(self, record: StepRecord) -> None:
        """Append one line. Raises ``ValueError`` after ``close``."""
        line = record.model_dump_json() + "\n"
        with self._lock:
            if self._file is None:
                raise ValueError(f"JsonlSink({self.path!r}) is closed")
            self._file.write(line)
            self.written += 1

    def flush(self) -> None:
        """Push buffered lines to the operating system."""
        with self._lock:
            if self._file is not None:
                self._file.flush()

    def close(self, timeout: float = 0.0) -> None:
        """Flush and close the file (idempotent; ``timeout`` is unused: writes are local)."""
        with self._lock:
            file, self._file = self._file, None
        if file is not None:
            self._finalizer.detach()
            file.close()
