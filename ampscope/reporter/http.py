"""HttpReporter: ships a rank's step records to the per-node exporter.

``emit`` appends to a bounded in-memory queue and returns; one daemon thread per
reporter sends batches (``POST {url}/api/v1/ingest``) over a kept-alive connection,
every ``flush_interval`` seconds or as soon as ``max_batch`` records are waiting.

Failure policy:

* Connection errors, timeouts, 408, 429 and 5xx are retried with exponential backoff and
  jitter (capped at ``retry_max``); the first failure and the recovery are logged, not
  every retry.
* Any other 4xx (bad token, schema mismatch) is not retried: those records are dropped,
  counted, and the server's error is logged once per status. 413 halves the batch size
  first.
* While the exporter is unreachable the queue holds at most ``max_queue`` waiting records
  (plus the one batch in flight). Beyond that the OLDEST waiting record is dropped: every
  record carries the rank's cumulative totals, so the newest record alone keeps the
  exporter's counters exact, and it is never the one dropped. Drops are counted in
  ``dropped`` and reported to the exporter in each batch's ``dropped_records``.

Delivery is at-least-once: a batch whose response was lost is sent again, and the
exporter tolerates the duplicate (its counters come from the cumulative totals).

Lifecycle: while no record goes out, a ``Heartbeat`` goes to ``/api/v1/heartbeat`` at least
every ``heartbeat_interval`` (or as often as the exporter's answers ask), so that a live but
idle rank is never taken for lost; ``close`` ends with a final heartbeat, after the last
record, that marks the rank finished, or failed with the exception its training ended on
(:mod:`ampscope.reporter.failure`). Heartbeats start with the first delivered record. A
heartbeat the exporter did not apply (it holds no record of the rank: it restarted) makes the
reporter send its newest record again, once, and a final one then goes again too. A SIGTERM
(torchrun's elastic restart, a preemption, an eviction) closes every reporter of the process
with a final heartbeat that marks the rank stopped, then lets the signal end the process
(:mod:`ampscope.reporter.stop_signal`).
"""

from __future__ import annotations

import atexit
import logging
import os
import time
import weakref

from ampscope.reporter import failure, stop_signal
from ampscope.reporter.pipeline import HttpReporterConfig, Pipeline
from ampscope.reporter.schema import HEARTBEAT_INTERVAL_S, StepRecord
from ampscope.reporter.tls import ClientTls, token_from_env
from ampscope.reporter.transport import URL_ENV, url_from_env

__all__ = ["HttpReporter", "HttpReporterConfig"]


class HttpReporter(failure.ClosedByWith):
    """A Sink that POSTs records to the ampscope exporter in batches, off the caller's thread.

    Starts one daemon thread at construction. ``emit`` costs a lock and a deque append
    (no I/O, no serialisation) and never raises; JSON encoding and HTTP happen on the
    reporter's thread.

    Args:
        url: Exporter base URL. ``None`` reads ``AMPSCOPE_URL``, else ``DEFAULT_URL``
            (``http://127.0.0.1:9478``). ``https://`` verifies the exporter's certificate.
        token: Bearer token; ``None`` reads the file ``AMPSCOPE_TOKEN_FILE`` names, else
            ``AMPSCOPE_TOKEN`` (unset or empty: no token).
        tls: For ``https://``: the CA to trust and the client certificate to show; ``None``
            reads ``AMPSCOPE_CA_FILE``, ``AMPSCOPE_CERT_FILE`` and ``AMPSCOPE_KEY_FILE``.
        flush_interval: Seconds between sends while fewer than ``max_batch`` records wait.
        max_batch: Most records per POST.
        max_queue: Most records waiting; beyond it the oldest are dropped and counted.
        timeout: Socket timeout for connecting and for each request, in seconds.
        retry_initial: First retry delay after a failure, doubling up to ``retry_max``.
        retry_max: Cap on the retry delay.
        exit_timeout: How long the interpreter-exit flush may wait for the exporter.
        heartbeat_interval: Most seconds between posts while no record is sent, so that an
            idle rank (evaluation, checkpointing, a hang) is never taken for lost; the
            exporter's answers may shorten it to a quarter of its ``--stale-after``.
        sigterm_handler: Install the process's SIGTERM handler (once per process, from the
            main thread only; a later reporter built there installs it otherwise), so that a
            rank its launcher stops ends ``stopped``, not ``lost``; it chains a Python handler
            installed before it and leaves an ignored SIGTERM alone. ``None`` reads
            ``AMPSCOPE_SIGTERM_HANDLER`` (``off``: no handler; unset: install it).

    As a context manager (``with HttpReporter(...) as reporter:``), it closes at the block's
    end; a block left by an exception ends the rank ``failed`` with that exception (which
    goes on propagating).

    Raises:
        ValueError: For an invalid setting, or ``url=None`` with ``AMPSCOPE_URL=off``.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        flush_interval: float = 0.5,
        max_batch: int = 512,
        max_queue: int = 10_000,
        timeout: float = 5.0,
        retry_initial: float = 0.25,
        retry_max: float = 5.0,
        exit_timeout: float = 2.0,
        heartbeat_interval: float = HEARTBEAT_INTERVAL_S,
        tls: ClientTls | None = None,
        sigterm_handler: bool | None = None,
    ) -> None:
        if url is None:
            url = url_from_env()
            if url is None:
                raise ValueError(
                    f"{URL_ENV} is {os.environ.get(URL_ENV)!r} (reporting disabled); pass "
                    "url= explicitly, or use reporter=None"
                )
        if token is None:
            token = token_from_env()
        self.config = HttpReporterConfig(
            url=url,
            token=token,
            tls=tls if tls is not None else ClientTls.from_env(),
            flush_interval=flush_interval,
            max_batch=max_batch,
            max_queue=max_queue,
            timeout=timeout,
            retry_initial=retry_initial,
            retry_max=retry_max,
            exit_timeout=exit_timeout,
            heartbeat_interval=heartbeat_interval,
            sigterm_handler=(
                stop_signal.handler_from_env() if sigterm_handler is None else sigterm_handler
            ),
        )
        self._pipeline = Pipeline(self.config)
        self._pid = os.getpid()
        self._closed = False
        self._pipeline.thread.start()
        # Garbage collected without close(): let the thread finish on its own, never block.
        self._finalizer = weakref.finalize(
            self, _stop_soon, self._pipeline, self.config.exit_timeout
        )
        self._finalizer.atexit = False  # interpreter exit is _close_all_at_exit's job
        _LIVE.add(self)
        failure.install_hooks()
        if self.config.sigterm_handler:
            stop_signal.install(_stop_all)

    @property
    def url(self) -> str:
        """The exporter base URL this reporter sends to."""
        return self.config.url.rstrip("/")

    @property
    def dropped(self) -> int:
        """Records dropped so far: queue overflow, rejected by the exporter, or undelivered at
        close."""
        return self._pipeline.dropped

    @property
    def sent(self) -> int:
        """Records the exporter has accepted (2xx)."""
        return self._pipeline.sent

    @property
    def pending(self) -> int:
        """Records queued or in flight."""
        with self._pipeline.cond:
            return len(self._pipeline.waiting) + self._pipeline.inflight_count

    def emit(self, record: StepRecord) -> None:
        """Queue one record for sending. Never blocks on I/O and never raises."""
        try:
            if os.getpid() != self._pid:
                return  # a forked child has no sender thread; its parent reports
            self._pipeline.put(record)
        except Exception:
            self._pipeline.log_once(
                "emit", logging.ERROR, "ampscope reporter: emit failed", exc_info=True
            )

    def flush(self, timeout: float = 5.0) -> bool:
        """Send what is queued now, without waiting for the flush interval.

        Blocks the caller for up to ``timeout`` seconds; call it from tests or at the end of
        a run, not per step.

        Returns:
            True when every record emitted before the call has left the queue (delivered,
            or rejected by the exporter; compare ``dropped``) within ``timeout``.
        """
        if os.getpid() != self._pid:
            return False
        return self._pipeline.flush(timeout)

    @property
    def closed_already(self) -> bool:
        return self._closed

    def close(self, timeout: float = 1.0) -> None:
        """Flush, retrying until ``timeout`` seconds have passed, send the final heartbeat
        that marks the rank finished on the exporter, then stop the thread.

        The rank ends ``failed`` instead when an exception was noted that training may have
        ended on and no step was reported after it (see :mod:`ampscope.reporter.failure`).

        Records still unsent at the deadline are dropped and counted. Returns within
        about ``timeout`` seconds (default 1) even when the exporter is down. Idempotent;
        ``emit`` after ``close`` drops the record.
        """
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        self._finalizer.detach()
        _LIVE.discard(self)
        _ENDED.add(self)
        deadline = time.monotonic() + max(0.0, timeout)
        self._pipeline.begin_close(deadline)
        self._pipeline.join(deadline)

    def __repr__(self) -> str:
        return (
            f"HttpReporter(url={self.url!r}, sent={self.sent}, dropped={self.dropped}, "
            f"pending={self.pending})"
        )


def _stop_soon(pipeline: Pipeline, timeout: float) -> None:
    pipeline.begin_close(time.monotonic() + timeout)


_LIVE: weakref.WeakSet[HttpReporter] = weakref.WeakSet()
_ENDED: weakref.WeakSet[HttpReporter] = weakref.WeakSet()
"""Reporters closed already, whose final heartbeat an exception seen later may correct."""


def _correct_ended(found: failure.Noted) -> None:
    # An exception reached a hook after some reporters said their rank finished: tell the
    # exporter again, now failed. One shared deadline, as at exit.
    ended = [r for r in list(_ENDED) if r._pid == os.getpid()]
    if not ended:
        return
    deadline = time.monotonic() + max(r.config.exit_timeout for r in ended)
    for reporter in ended:
        reporter._pipeline.correct(found, deadline)


failure.on_fatal(_correct_ended)


def _close_all_at_exit() -> None:
    # Runs after the interpreter joined non-daemon threads, while the (daemon) sender
    # threads still run. One shared deadline: many reporters must not add up their waits.
    reporters = [r for r in list(_LIVE) if r._pid == os.getpid() and not r._closed]
    if not reporters:
        return
    deadline = time.monotonic() + max(r.config.exit_timeout for r in reporters)
    for reporter in reporters:
        reporter._closed = True
        reporter._finalizer.detach()
        _ENDED.add(reporter)
        reporter._pipeline.begin_close(deadline)
    for reporter in reporters:
        reporter._pipeline.join(deadline)


atexit.register(_close_all_at_exit)


def _stop_all(signum: int) -> None:
    # The SIGTERM handler's goodbye (ampscope.reporter.stop_signal), on the main thread:
    # every live reporter of the process says the signal stopped its rank, under one shared
    # deadline, as at exit. A reporter whose close() had begun (training ended: its final
    # heartbeat says finished, or failed) is given the same deadline to send it, and not
    # made stopped: a SIGTERM during the last flush (a time limit) stops no training.
    pid = os.getpid()
    live = [r for r in list(_LIVE) if r._pid == pid and not r._closed]
    closing = [r for r in list(_ENDED) if r._pid == pid and r._pipeline.thread.is_alive()]
    if not live and not closing:
        return
    deadline = time.monotonic() + max(r.config.exit_timeout for r in live + closing)
    for reporter in live:
        reporter._closed = True
        reporter._finalizer.detach()
        _LIVE.discard(reporter)
        _ENDED.add(reporter)
    for reporter in live:
        reporter._pipeline.note_stop(signum)
    for reporter in live + closing:
        reporter._pipeline.begin_close(deadline)
    for reporter in live + closing:
        if reporter._pipeline.cond._is_owned():  # type: ignore[attr-defined]
            # The signal interrupted this thread inside the reporter's lock (a put() of a
            # record emitted on the main thread): its sender thread cannot take the lock
            # until the handler returns, so waiting would only spend the deadline.
            continue
        reporter._pipeline.join(deadline)
