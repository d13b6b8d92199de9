"""The one interface every telemetry destination implements."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ampscope.reporter.schema import StepRecord


@runtime_checkable
class Sink(Protocol):
    """A destination for step records.

    ampscope calls ``emit`` from its own background thread, never from the training
    thread, one record at a time in step order. A sink may raise: the caller counts
    the error, logs it once, and keeps going, so a broken sink never breaks training.
    """

    def emit(self, record: StepRecord) -> None:
        """Accept one record. Must not block for long; buffer and send elsewhere if slow."""

    def close(self, timeout: float) -> None:
        """Flush what is buffered, waiting at most ``timeout`` seconds, and release resources.

        Called once; ``emit`` is not called afterwards.
        """
