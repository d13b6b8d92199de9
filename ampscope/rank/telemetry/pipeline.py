"""The scaler's telemetry pipeline: pending steps → records → history, totals and sinks.

The training thread only appends :class:`PendingStep` objects (``submit``). One daemon
thread, started by the first submit, waits for each step's host copy, builds its
:class:`StepRecord`, updates the running totals and the history ring buffer, and hands
records to the sinks in step order. A sink that raises is counted and logged once; it
never reaches the training thread.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from ampscope.rank.capture.pending import PendingStep
from ampscope.rank.gradients.attribution import top_k
from ampscope.rank.telemetry.batches import BatchNotes
from ampscope.rank.telemetry.records import RecordBuilder
from ampscope.rank.telemetry.stats_record import SpikeThresholds
from ampscope.reporter.fault_rule import FaultRule
from ampscope.reporter.schema import NonfiniteParam, StepRecord
from ampscope.reporter.sinks import Sink
from ampscope.reporter.spike_rule import SpikeRule

logger = logging.getLogger("ampscope")

_LIVE: weakref.WeakSet[Telemetry] = weakref.WeakSet()

MAX_PENDING = 1024
"""Unresolved steps before the training thread resolves the oldest itself. Only reached
when the telemetry thread is stuck (a sink that blocks): those steps finished long ago,
so resolving them costs no wait, and the totals stay exact."""
MAX_UNDELIVERED = 4096
"""Records waiting for the sinks; beyond it the oldest are not delivered (counted)."""
BATCH_INTERVAL = 0.05
"""Seconds the telemetry thread lets steps gather after handling some, so that it wakes
(and takes the GIL from training) once per batch instead of once per step."""


EXIT_TIMEOUT_S = 2.0
"""Interpreter exit waits this long at most for all scalers' telemetry together."""


@atexit.register
def _close_all_at_exit() -> None:
    # One shared deadline: many scalers must not add up their waits.
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    for telemetry in list(_LIVE):
        telemetry.close(timeout=max(0.0, deadline - time.monotonic()))


@dataclass(frozen=True, kw_only=True)
class TelemetrySnapshot:
    """A copy of one scaler's telemetry at the time of ``snapshot()``.

    Plain data: it pickles, ``dataclasses.asdict()`` works on it, and ``to_dict()`` gives a
    JSON-ready dict to log to the tools a run already uses. Its dicts are copies; changing
    them changes nothing in the scaler.
    """

    steps: int
    """update() calls recorded."""
    skipped_steps: int
    """Iterations whose optimizer step was skipped for inf/NaN gradients."""
    backoffs: int
    growths: int
    scale: float | None
    """Scale after the newest update(); ``None`` before the first."""
    growth_tracker: int | None
    min_scale: float | None
    max_scale: float | None
    found_inf_local: dict[str, int]
    """Per device: iterations whose local gradient shards held inf/NaN."""
    found_inf_origin: dict[str, int]
    """Per device: iterations whose pre-reduction gradients held inf/NaN (origin tracking)."""
    nonfinite_params: tuple[NonfiniteParam, ...]
    """Top-K parameters by cumulative non-finite element count on this rank."""
    last: StepRecord | None
    """The newest record."""
    sink_errors: int
    """Exceptions raised by sinks so far."""
    dropped: int
    """Steps whose record could not be built (counted and logged, never raised)."""
    undelivered: int
    """Records not handed to the sinks because they fell ``MAX_UNDELIVERED`` behind."""
    nonfinite_applied: int = 0
    """Iterations whose optimizer step ran on inf/NaN gradients (a ``GradWatch`` under
    ``observe``); always 0 for the scalers."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``json.dumps(snapshot.to_dict())`` works (``last`` as its JSON form)."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["found_inf_local"] = dict(self.found_inf_local)
        data["found_inf_origin"] = dict(self.found_inf_origin)
        data["nonfinite_params"] = [p.model_dump() for p in self.nonfinite_params]
        data["last"] = None if self.last is None else self.last.model_dump(mode="json")
        return data


class Telemetry:
    """Pending steps in, records out. Thread-safe; see the module docstring."""

    def __init__(
        self,
        *,
        sinks: Sequence[Sink],
        history: int,
        top_k: int,
        spike_rule: SpikeRule | None = None,
        fault_rule: FaultRule | None = None,
    ) -> None:
        self._sinks = tuple(sinks)
        self._top_k = top_k
        self._pending: deque[PendingStep] = deque()
        self._outbox: deque[StepRecord] = deque()
        self._history: deque[StepRecord] = deque(maxlen=history)
        self._builder = RecordBuilder(top_k, spike_rule, fault_rule)
        self.batches = BatchNotes()
        """The ids ``note_batch`` noted for the iteration in progress (training thread)."""
        self._totals = self._builder.totals  # changed in place by the builder
        self._last: StepRecord | None = None
        self._dropped = 0
        self._undelivered = 0
        self._sink_errors = 0
        self._failed_sinks: set[int] = set()
        self._resolve_lock = threading.RLock()
        self._deliver_lock = threading.Lock()
        self._wake = threading.Condition()
        self._stopping = False
        self._closed = False
        self._close_done = threading.Event()
        self._thread: threading.Thread | None = None
        self._idle = False
        """The telemetry thread waits for a notify (it found nothing to do)."""
        _LIVE.add(self)
        if self._sinks:
            # atexit runs last-registered first: move this module's handler after the
            # reporter module's (imported when the sinks were built), so that at exit the
            # pending steps reach the reporter before it flushes and says goodbye.
            atexit.unregister(_close_all_at_exit)
            atexit.register(_close_all_at_exit)

    @property
    def spike_thresholds(self) -> SpikeThresholds:
        """The rank's spike thresholds, kept up to date once armed (a rerun closure)."""
        return self._builder.stats.thresholds

    def fault_threshold(self) -> tuple[float, float]:
        """The fault rule's thresholds over every step submitted so far
        (``FaultState.threshold``): host floats the training thread compares a scaler's
        scale with on the device, to rerun faults only (``rerun=closure``).

        Cost: builds the pending records first, on the calling thread, which waits for
        their device-to-host copies (queued before this iteration's work); the rerun's
        agreement reads its flag on the host right after, which waits for more. The
        threshold therefore never depends on how far the telemetry thread got."""
        self._resolve_and_wake()
        with self._resolve_lock:
            return self._builder.faults.threshold()

    @property
    def nonfinite_applied(self) -> bool:
        """An update ran on inf/NaN gradients (a watch under ``observe``) among the records
        built so far: from then on inf/NaN is its consequence (call after
        :meth:`fault_threshold`, which builds the pending records)."""
        return self._totals.first_nonfinite_applied is not None

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, pending: PendingStep) -> None:
        """Queue one step (training thread): an append; a notify only when the telemetry
        thread sleeps with nothing to do, i.e. once per burst of steps, not per step."""
        if self._stopping:
            return
        pending.batch = self.batches.take()
        self._pending.append(pending)
        if len(self._pending) > MAX_PENDING:
            self._resolve(keep=MAX_PENDING // 2)
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="ampscope-telemetry", daemon=True
            )
            self._thread.start()
        if self._idle:
            with self._wake:
                self._wake.notify()

    def snapshot(self) -> TelemetrySnapshot:
        """Counters covering every update() already called.

        Cost: resolves pending steps first, which waits for their device-to-host copies
        (on CUDA, for the work queued before them). Call it off the hot path.
        """
        self._resolve_and_wake()
        with self._resolve_lock:
            totals, last = self._totals, self._last
            return TelemetrySnapshot(
                steps=totals.steps,
                skipped_steps=totals.skipped_steps,
                backoffs=totals.backoffs,
                growths=totals.growths,
                scale=last.scale_after if last is not None else None,
                growth_tracker=last.growth_tracker if last is not None else None,
                min_scale=totals.min_scale,
                max_scale=totals.max_scale,
                found_inf_local=dict(totals.found_inf_local),
                found_inf_origin=dict(totals.found_inf_origin),
                nonfinite_params=tuple(
                    NonfiniteParam(name=n, count=c) for n, c in top_k(totals.nonfinite, self._top_k)
                ),
                last=last,
                sink_errors=self._sink_errors,
                dropped=self._dropped,
                undelivered=self._undelivered,
                nonfinite_applied=totals.nonfinite_applied,
            )

    def history(self, n: int | None = None) -> list[StepRecord]:
        """The newest ``n`` records (all kept when ``None``), oldest first. Same cost as
        :meth:`snapshot`."""
        self._resolve_and_wake()
        with self._resolve_lock:
            records = list(self._history)
        return records if n is None else records[-n:] if n > 0 else []

    def flush(self, timeout: float = 1.0) -> None:
        """Build every pending record and hand it to the sinks now, on the calling thread,
        then ask each sink that can (``flush(timeout)``, e.g. the HTTP reporter) to send
        what it holds. Waits at most about ``timeout`` seconds for the sinks; for a path
        that stops training (a watch's raise), never per step."""
        deadline = time.monotonic() + timeout
        self._resolve()
        self._deliver()
        for sink in self._sinks:
            flush = getattr(sink, "flush", None)
            if flush is None:
                continue
            try:
                flush(max(deadline - time.monotonic(), 0.0))
            except Exception:
                logger.warning("ampscope: flushing sink %r failed", sink, exc_info=True)

    def close_soon(self, timeout: float = 1.0) -> None:
        """``close(timeout)`` on a short-lived daemon thread; returns at once.

        For a scaler that is garbage collected without ``close()``: its records are still
        delivered and its final record sent, then every thread it started ends.
        """
        if self._closed:
            return
        threading.Thread(
            target=self.close, args=(timeout,), name="ampscope-close", daemon=True
        ).start()

    def close(self, timeout: float = 1.0) -> None:
        """Deliver what is pending, then close the sinks (the reporter sends its final
        record). Idempotent; waits at most about ``timeout`` seconds in total (default 1).

        A call while another thread closes (a garbage-collected scaler's ``close_soon``)
        waits for that close, up to ``timeout``: interpreter exit must not cut it short.
        """
        with self._wake:
            if self._closed:
                closing_elsewhere = True
            else:
                closing_elsewhere = False
                self._closed = True
                self._stopping = True
                self._wake.notify()
        if closing_elsewhere:
            self._close_done.wait(timeout)
            return
        try:
            self._close(timeout)
        finally:
            self._close_done.set()

    def _close(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        if self._thread is not None:
            self._thread.join(max(deadline - time.monotonic(), 0.0))
        if self._thread is None or not self._thread.is_alive():
            self._resolve()
            self._deliver()
        for sink in self._sinks:
            try:
                sink.close(max(deadline - time.monotonic(), 0.0))
            except Exception:
                logger.warning("ampscope: closing sink %r failed", sink, exc_info=True)
        _LIVE.discard(self)

    # -- telemetry thread ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                if not self._stopping:
                    # Let a batch gather; close() cuts the wait short.
                    self._wake.wait(BATCH_INTERVAL)
                # Set before the check: a submit() after the check sees it and notifies,
                # one before it left a pending step that the check sees.
                self._idle = True
                while not (self._pending or self._outbox or self._stopping):
                    self._wake.wait()
                self._idle = False
                stopping = self._stopping
            try:
                self._resolve()
                self._deliver()
            except Exception:  # pragma: no cover - _resolve/_deliver catch their own
                logger.exception("ampscope: telemetry thread error")
            if stopping and not self._pending and not self._outbox:
                return

    def _resolve_and_wake(self) -> None:
        self._resolve()
        if self._outbox:
            with self._wake:
                self._wake.notify()

    def _resolve(self, keep: int = 0) -> None:
        """Turn pending steps into records, oldest first, leaving the newest ``keep``."""
        with self._resolve_lock:
            while len(self._pending) > keep:
                pending = self._pending[0]
                try:
                    record = self._builder.build(pending, pending.read())
                except Exception:
                    self._dropped += 1
                    if self._dropped == 1:
                        logger.warning(
                            "ampscope: could not build the record of step %d; dropping it "
                            "(logged once)",
                            pending.step,
                            exc_info=True,
                        )
                else:
                    self._last = record
                    self._history.append(record)
                    if self._sinks:
                        self._queue_for_sinks(record)
                self._pending.popleft()

    def _queue_for_sinks(self, record: StepRecord) -> None:
        if len(self._outbox) >= MAX_UNDELIVERED:
            try:
                self._outbox.popleft()
            except IndexError:  # the telemetry thread drained it meanwhile
                pass
            else:
                self._undelivered += 1
            if self._undelivered == 1:
                logger.warning(
                    "ampscope: sinks are %d records behind (one blocks?); the oldest are not "
                    "delivered (counted in snapshot().undelivered; logged once)",
                    MAX_UNDELIVERED,
                )
        self._outbox.append(record)

    def _deliver(self) -> None:
        with self._deliver_lock:
            while self._outbox:
                record = self._outbox.popleft()
                for sink in self._sinks:
                    try:
                        sink.emit(record)
                    except Exception:
                        self._sink_errors += 1
                        if id(sink) not in self._failed_sinks:
                            self._failed_sinks.add(id(sink))
                            logger.warning(
                                "ampscope: sink %r raised; counting its errors and going on "
                                "(logged once per sink)",
                                sink,
                                exc_info=True,
                            )
