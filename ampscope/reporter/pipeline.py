"""The reporter's queue and sender thread (see :mod:`ampscope.reporter.http`).

:class:`Pipeline` owns a bounded queue of records and one daemon thread that encodes them
and POSTs batches through :class:`~ampscope.reporter.transport.IngestTransport`, with the
retry, drop and logging policy the ``http`` module describes. It holds no reference to its
:class:`~ampscope.reporter.http.HttpReporter`, so a reporter that was never closed can be
garbage collected, which then stops the thread.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ampscope.reporter import failure, pause
from ampscope.reporter.schema import (
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_PATH,
    MAX_RECORDS_PER_BATCH,
    SCHEMA_VERSION,
    DeviceIdentity,
    Heartbeat,
    Identity,
    RankPause,
    StepRecord,
)
from ampscope.reporter.tls import ClientTls, clear_text_warning, credentials_in_clear
from ampscope.reporter.transport import URL_ENV, IngestTransport, Outcome, PostResult

logger = logging.getLogger("ampscope")

__all__ = ["HttpReporterConfig", "Pipeline"]

_NEWER_FIELDS = ("pause", "stop_signal")
"""Heartbeat fields added after schema version 1, newest first: an exporter older than one
refuses it (422, unknown field), and one that knows a field knows the older ones (so the
reporter drops the newest first when a heartbeat carries more than one)."""

MAX_DEVICE_KEYS = 64
"""(run, rank) pairs whose device a pipeline remembers (one, unless a reporter is shared)."""


@dataclass(frozen=True, kw_only=True)
class HttpReporterConfig:
    """Validated settings of one HttpReporter."""

    url: str
    """Exporter base URL; batches go to ``{url}/api/v1/ingest``."""
    token: str | None = field(default=None, repr=False)
    """Bearer token sent as ``Authorization: Bearer <token>``; ``None`` sends none."""
    tls: ClientTls = field(default_factory=ClientTls)
    """For ``https://``: the CA to trust and the client certificate to show."""
    flush_interval: float = 0.5
    """Seconds between sends while fewer than ``max_batch`` records are waiting."""
    max_batch: int = 512
    """Most records per POST (at most the schema's ``MAX_RECORDS_PER_BATCH``)."""
    max_queue: int = 10_000
    """Most records waiting to be sent; beyond it the oldest are dropped and counted."""
    timeout: float = 5.0
    """Socket timeout in seconds for connecting and for each request."""
    retry_initial: float = 0.25
    """First retry delay in seconds after a failed POST; doubles per failure."""
    retry_max: float = 5.0
    """Cap on the retry delay (also on a server's ``Retry-After``)."""
    exit_timeout: float = 2.0
    """Seconds the interpreter-exit flush may take, across all reporters of the process."""
    heartbeat_interval: float = HEARTBEAT_INTERVAL_S
    """Most seconds between posts while no record is sent; the exporter may ask for less
    (a quarter of its ``--stale-after``), which then wins."""
    sigterm_handler: bool = True
    """Install the process's SIGTERM handler (``ampscope.reporter.stop_signal``; from the
    main thread, once per process): a rank its launcher stops with SIGTERM sends its final
    heartbeat, saying so, and ends ``stopped`` instead of ``lost``."""

    def __post_init__(self) -> None:
        positive = {
            "flush_interval": self.flush_interval,
            "heartbeat_interval": self.heartbeat_interval,
            "timeout": self.timeout,
            "retry_initial": self.retry_initial,
            "retry_max": self.retry_max,
        }
        for name, value in positive.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if not self.exit_timeout >= 0:
            raise ValueError(f"exit_timeout must be >= 0 seconds, got {self.exit_timeout!r}")
        if self.retry_max < self.retry_initial:
            raise ValueError(
                f"retry_max ({self.retry_max}) must be >= retry_initial ({self.retry_initial})"
            )
        for name, value in (("max_batch", self.max_batch), ("max_queue", self.max_queue)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_batch > MAX_RECORDS_PER_BATCH:
            raise ValueError(
                f"max_batch must be <= {MAX_RECORDS_PER_BATCH} (the exporter's limit per "
                f"batch), got {self.max_batch}"
            )


@dataclass(frozen=True)
class _Encoded:
    seq: int
    key: tuple[str, int]
    """(run, rank): one batch holds records of one rank only."""
    json: bytes
    identity: Identity
    step: int


def retry_delay(
    config: HttpReporterConfig,
    failures: int,
    retry_after: float | None,
    jitter: Callable[[float, float], float] = random.uniform,
) -> float:
    """Seconds to wait after the ``failures``-th failure in a row: ``retry_initial``
    doubling per failure up to ``retry_max``, scaled by ``jitter(0.5, 1.0)`` so that the
    ranks of a node do not retry in lockstep, and at least a server's ``Retry-After``
    (itself capped at ``retry_max``)."""
    delay = min(config.retry_max, config.retry_initial * 2 ** (failures - 1))
    delay *= jitter(0.5, 1.0)
    if retry_after is not None:
        delay = max(delay, min(retry_after, config.retry_max))
    return delay


class Pipeline:
    """Queue and sender thread state; holds no reference to its HttpReporter.

    That lets a reporter that was never closed be garbage collected, which then stops
    the thread (``weakref.finalize``).
    """

    def __init__(self, config: HttpReporterConfig) -> None:
        self.config = config
        self.transport = IngestTransport(
            config.url, token=config.token, timeout=config.timeout, tls=config.tls
        )
        if config.token and credentials_in_clear(config.url):
            logger.warning(
                "ampscope reporter: %s", clear_text_warning("the bearer token", config.url)
            )
        self.cond = threading.Condition()
        self.waiting: deque[tuple[int, StepRecord]] = deque()
        self.next_seq = 0
        self.inflight_head: int | None = None
        self.inflight_count = 0
        self.flush_until = 0
        self.closing = False
        self.deadline = float("inf")
        self.dropped = 0
        self.sent = 0
        self.batch_limit = config.max_batch
        self.failures = 0
        self.failing_since = 0.0
        self.last_error = ""
        self._logged: set[str] = set()
        # Heartbeats (sender thread only): the newest delivered record (who this rank is,
        # its step, and what to send again to an exporter that forgot the rank), and when
        # the exporter must hear from it next.
        self.newest: _Encoded | None = None
        self.heartbeat_interval = config.heartbeat_interval
        self.next_beat = float("inf")
        self.finished_sent = False
        # (run, rank) -> the device its first record named, as JSON: repeated on every batch
        # of that rank, so an exporter that restarted learns it again (sender thread only).
        self.devices: dict[tuple[str, int], bytes] = {}
        # How the rank ended (see ``ampscope.reporter.failure``): decided when closing
        # begins, from the newest noted exception and the newest record's time.
        self.newest_time: float | None = None
        self.failure: failure.Noted | None = None
        self.pause_refused = False
        """The exporter refused a heartbeat that said a pause and took it without one (it
        predates pauses): the next ones go without."""
        self.closed_by: int | None = None
        """``threading.get_ident()`` of the thread that began the close."""
        self.stop_signal: int | None = None
        """The signal that stopped the process (``note_stop``): the final heartbeat says so."""
        self.thread = threading.Thread(target=self._run, name="ampscope-reporter", daemon=True)

    # ---- called by HttpReporter (any thread) ----

    def put(self, record: StepRecord) -> None:
        overflow = False
        with self.cond:
            if self.closing:
                self.dropped += 1
                return
            self.waiting.append((self.next_seq, record))
            self.next_seq += 1
            if self.newest_time is None or record.time > self.newest_time:
                self.newest_time = record.time
            if len(self.waiting) > self.config.max_queue:
                self.waiting.popleft()
                self.dropped += 1
                overflow = True
            if len(self.waiting) >= min(self.batch_limit, self.config.max_queue):
                self.cond.notify_all()
        if overflow:
            self.log_once(
                "overflow",
                logging.WARNING,
                "ampscope reporter: queue full (max_queue=%d), dropping the oldest records; "
                "the newest cumulative totals still reach %s",
                self.config.max_queue,
                self.config.url,
            )

    def unresolved_head(self) -> int:
        """Sequence number of the oldest record not yet delivered or given up. Lock held."""
        if self.inflight_head is not None:
            return self.inflight_head
        return self.waiting[0][0] if self.waiting else self.next_seq

    def flush(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        with self.cond:
            target = self.next_seq
            self.flush_until = max(self.flush_until, target)
            self.cond.notify_all()
            while self.unresolved_head() < target:
                remaining = end - time.monotonic()
                if remaining <= 0 or not self.thread.is_alive():
                    return False
                self.cond.wait(remaining)
            return True

    def begin_close(self, deadline: float) -> None:
        """Stop taking records; send what waits until ``deadline``, then the final heartbeat,
        which carries the exception training ended on, if any (``failure.void_after``)."""
        with self.cond:
            if not self.closing:
                self.closing = True
                self.deadline = deadline
                self.failure = failure.void_after(failure.noted(), self.newest_time)
                self.closed_by = threading.get_ident()
            self.cond.notify_all()

    def note_stop(self, signum: int) -> None:
        """The process was stopped by ``signum`` (the SIGTERM handler): the final heartbeat,
        unless it went already, says so, and the rank ends ``stopped``. Any thread."""
        with self.cond:
            if not self.finished_sent:
                self.stop_signal = signum

    def correct(self, found: failure.Noted, deadline: float) -> bool:
        """Send the final heartbeat once more, now with ``found``, after the rank already
        said it finished: an exception reached the main thread's hook after the close (a
        ``finally: close()``), or killed the thread that closed. Runs on the hook's thread,
        only once the sender thread has ended. Returns whether the exporter applied it."""
        if self.thread.is_alive() or not self.finished_sent or self.failure is not None:
            return False
        if self.stop_signal is not None:
            # Stopped by its launcher: an exception after that is the stop unwinding the
            # training loop (a chained handler raising to leave it), not the rank's fault.
            return False
        if found.seen_by == "thread" and found.thread != self.closed_by:
            return False  # another thread's exception: training ended before it, normally
        newest = self.newest
        if newest is None:
            return False
        with self.cond:
            self.failure = found
            self.deadline = deadline
        try:
            result = self._post_beat(newest, final=True)
        finally:
            self.transport.close()
        return result is not None and result.outcome is Outcome.DELIVERED and bool(result.applied)

    def join(self, deadline: float) -> None:
        if not self.thread.is_alive():
            return
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive():
            # Blocked in a socket call whose timeout outlives the deadline: cut it short.
            self.transport.abort()
            self.thread.join(0.2)

    # ---- the sender thread ----

    def _run(self) -> None:
        try:
            while self._send_next():
                pass
            self._send_final()
        except Exception:  # a bug here must not take the process down; say so once
            logger.exception("ampscope reporter: sender thread failed; records are dropped")
        finally:
            with self.cond:
                abandoned = len(self.waiting) + self.inflight_count
                self.dropped += abandoned
                self.waiting.clear()
                self.inflight_head = None
                self.inflight_count = 0
                self.closing = True
                self.cond.notify_all()
            self.transport.close()
            if abandoned:
                logger.warning(
                    "ampscope reporter: gave up on %d records at close: %s unreachable (%s)",
                    abandoned,
                    self.config.url,
                    self.last_error or "deadline reached",
                )

    def _send_next(self) -> bool:
        """Send one batch. Returns False when the thread should exit."""
        with self.cond:
            while not self._batch_due():
                if self.closing:
                    return False
                if time.monotonic() >= self.next_beat:
                    break
                self.cond.wait(min(self.config.flush_interval, self.heartbeat_interval))
                if self.waiting:
                    break  # the flush interval elapsed (or a notify): send what is there
            count = min(self.batch_limit, len(self.waiting))
            taken = [self.waiting.popleft() for _ in range(count)]
            if taken:
                self.inflight_head = taken[0][0]
                self.inflight_count = len(taken)
        if taken:
            self._deliver(self._encode(taken))
        elif time.monotonic() >= self.next_beat:
            self._beat(final=False)
        with self.cond:
            return not (self.closing and (not self.waiting or self._past_deadline()))

    def _beat(self, *, final: bool) -> bool:
        """POST one heartbeat (sender thread). Returns whether the exporter applied it.

        A failed one is not retried: the next is due a heartbeat interval later, and the
        records' own retries report an unreachable exporter. An exporter that answers
        ``applied: false`` holds no record of this rank (it restarted, or its retention
        dropped the rank) and would never show it again while the rank sends no records:
        the newest delivered record goes to it once more, once per such answer, which
        brings the rank back with exact counters (they are cumulative); a final heartbeat
        is then sent again, so the rank ends ``finished`` (or ``failed``). Costs one POST, at
        most three.
        """
        newest = self.newest
        if newest is None:
            return False
        result = self._post_beat(newest, final=final)
        if result is None or result.outcome is not Outcome.DELIVERED:
            return False
        if result.applied is not False:
            return True
        if not self._resend(newest):
            return False
        if not final:
            return True  # the record itself was news of the rank: the next beat is due later
        result = self._post_beat(newest, final=True)
        return result is not None and result.outcome is Outcome.DELIVERED and bool(result.applied)

    def _post_beat(self, newest: _Encoded, *, final: bool) -> PostResult | None:
        """POST a heartbeat speaking for ``newest``'s rank; ``None`` when out of time.

        A non-final one says the rank's open pause (:mod:`ampscope.reporter.pause`); a final
        one the signal that stopped the process, if one did. An exporter that predates such
        a field refuses it (422): the heartbeat goes again without it (``_post_taken``); a
        refused pause is left out of the later heartbeats too (logged once)."""
        told = self.failure if final else None
        with self.cond:
            stop_signal = self.stop_signal if final else None
        now = None if final or self.pause_refused else pause.current()
        beat = Heartbeat(
            schema_version=1,
            identity=newest.identity,
            time=time.time(),
            step=newest.step,
            final=final,
            dropped_records=self.dropped,
            failure=None if told is None else told.failure(newest.step),
            stop_signal=stop_signal,
            pause=None if now is None else RankPause(reason=now.reason, seconds=now.seconds),
        )
        return self._post_taken(beat)

    def _post_taken(self, beat: Heartbeat) -> PostResult | None:
        """POST ``beat``, then, while the exporter answers 422, again without the newest of
        ``_NEWER_FIELDS`` it still carries; ``None`` when out of time. Costs one POST per
        such field at most besides the first. A field is noted refused (a pause: left out
        from then on) only when the heartbeat without it was taken. Logs what the exporter
        refused."""
        result = self._post_heartbeat(beat)
        for name in _NEWER_FIELDS:
            if result is None or result.status != 422:
                break
            if getattr(beat, name) is None:
                continue
            beat = beat.model_copy(update={name: None})
            result = self._post_heartbeat(beat)
            if result is not None and result.outcome is Outcome.DELIVERED:
                # Taken without it: that field was what the exporter refused. A 422 again
                # says nothing of it (the heartbeat is refused for another reason too).
                self._note_field_refused(name)
        if result is None:
            return None
        if result.outcome is Outcome.REJECTED and result.refused:
            self.log_once(
                f"heartbeat-{result.status}",
                logging.WARNING,
                "ampscope reporter: %s refused a heartbeat (HTTP %s): %s",
                self.config.url,
                result.status,
                result.detail,
            )
        elif result.outcome is Outcome.REJECTED:
            self.log_once(
                f"heartbeat-{result.status}",
                logging.WARNING,
                "ampscope reporter: %s rejected a heartbeat with HTTP %s: %s; an older "
                "exporter? idle ranks may then show as lost (logged once per status)",
                self.config.url,
                result.status,
                result.detail,
            )
        return result

    def _note_field_refused(self, name: str) -> None:
        """The exporter answered 422 to a heartbeat carrying field ``name`` (see
        ``_NEWER_FIELDS``): say what the heartbeat goes without (once per field)."""
        if name == "pause":
            self.pause_refused = True
            self.log_once(
                "pause-refused",
                logging.WARNING,
                "ampscope reporter: %s refused a heartbeat that says a pause (an older "
                "exporter?); heartbeats go without it, and a long pause may show as a stall "
                "(logged once)",
                self.config.url,
            )
        else:
            # Tell it the rank ended, which it reads as finished, rather than nothing (lost).
            self.log_once(
                "stop-signal-422",
                logging.INFO,
                "ampscope reporter: %s does not know stop_signal (an older exporter?); "
                "the final heartbeat goes without it, so the rank reads finished there",
                self.config.url,
            )

    def _post_heartbeat(self, beat: Heartbeat) -> PostResult | None:
        """POST ``beat`` as JSON; ``None`` when out of time. A field of ``_NEWER_FIELDS``
        that is ``None`` is left out of the JSON rather than sent as ``null``: an exporter
        that predates the field (it refuses unknown fields) then takes every heartbeat it
        took before."""
        remaining = self._remaining()
        if remaining is not None and remaining <= 0:
            return None
        unset = {name for name in _NEWER_FIELDS if getattr(beat, name) is None}
        body = beat.model_dump_json(exclude=unset or None)
        result = self.transport.post(body.encode(), timeout=remaining, path=HEARTBEAT_PATH)
        self._note_contact(result)
        return result

    def _resend(self, newest: _Encoded) -> bool:
        """Send the newest delivered record again to an exporter that holds no record of
        the rank. Returns whether it took it. Not retried: the next heartbeat asks again."""
        remaining = self._remaining()
        if remaining is not None and remaining <= 0:
            return False
        self.log_once(
            "resend",
            logging.INFO,
            "ampscope reporter: %s holds no record of rank %d of run %r (restarted?); "
            "sending its newest record (step %d) again (logged once)",
            self.config.url,
            newest.identity.rank,
            newest.identity.run,
            newest.step,
        )
        result = self._post([newest])
        if result.outcome in (Outcome.REJECTED, Outcome.TOO_LARGE):
            self._log_rejected(result, 1)
        return result.outcome is Outcome.DELIVERED

    def _remaining(self) -> float | None:
        """Seconds left before the close deadline, or ``None`` while not closing."""
        with self.cond:
            return self.deadline - time.monotonic() if self.closing else None

    def _send_final(self) -> None:
        """Tell the exporter this rank ended (finished, failed, or stopped by a signal),
        once, after its last records."""
        with self.cond:
            if self.finished_sent:
                return
            self.finished_sent = True  # under the lock: note_stop then comes too late
        self._beat(final=True)

    def _note_contact(self, result: PostResult) -> None:
        # Any post attempt restarts the heartbeat clock; the exporter may shorten it.
        if result.heartbeat_interval is not None:
            self.heartbeat_interval = min(self.config.heartbeat_interval, result.heartbeat_interval)
        self.next_beat = time.monotonic() + self.heartbeat_interval

    def _batch_due(self) -> bool:
        if not self.waiting:
            return False
        return (
            self.closing
            or len(self.waiting) >= self.batch_limit
            or self.waiting[0][0] < self.flush_until
        )

    def _past_deadline(self) -> bool:
        return time.monotonic() >= self.deadline

    def _encode(self, taken: list[tuple[int, StepRecord]]) -> list[_Encoded]:
        encoded = []
        for seq, record in taken:
            try:
                key = (record.identity.run, record.identity.rank)
                if isinstance(record.device, DeviceIdentity):
                    if key not in self.devices and len(self.devices) >= MAX_DEVICE_KEYS:
                        self.devices.clear()  # a reporter shared by many runs: stay bounded
                    self.devices[key] = record.device.model_dump_json().encode()
                encoded.append(
                    _Encoded(
                        seq, key, record.model_dump_json().encode(), record.identity, record.step
                    )
                )
            except Exception as exc:  # not a StepRecord: drop it rather than poison the batch
                self.log_once(
                    "encode", logging.ERROR, "ampscope reporter: cannot encode a record: %r", exc
                )
        if len(encoded) < len(taken):
            self._resolve(len(taken) - len(encoded), delivered=False, remaining=encoded)
        return encoded

    def _deliver(self, batch: list[_Encoded]) -> None:
        """Send ``batch`` in one or more POSTs until delivered, rejected, or closed."""
        while batch:
            n = 1
            while n < min(self.batch_limit, len(batch)) and batch[n].key == batch[0].key:
                n += 1
            result = self._post(batch[:n])
            if result.outcome is Outcome.DELIVERED:
                self._note_recovery()
                # Heartbeats speak for the rank the exporter now holds (never for one whose
                # records it refused). A reference: the record's JSON exists already.
                self.newest = batch[n - 1]
                del batch[:n]
                self._resolve(n, delivered=True, remaining=batch)
            elif result.outcome is Outcome.TOO_LARGE and n > 1:
                self.batch_limit = max(1, n // 2)
            elif result.outcome in (Outcome.REJECTED, Outcome.TOO_LARGE):
                self._note_recovery()
                del batch[:n]
                self._resolve(n, delivered=False, remaining=batch)
                self._log_rejected(result, n)
            elif not self._wait_to_retry(result):
                return  # closing and out of time: _run counts what is left

    def _log_rejected(self, result: PostResult, count: int) -> None:
        self.log_once(
            f"status-{result.status}",
            logging.ERROR,
            "ampscope reporter: %s rejected %d records with HTTP %s: %s; dropping "
            "them (logged once per status)",
            self.config.url,
            count,
            result.status,
            result.detail,
        )

    def _post(self, chunk: list[_Encoded]) -> PostResult:
        with self.cond:
            dropped = self.dropped
        remaining = self._remaining()
        device = self.devices.get(chunk[0].key)
        body = b"".join(
            (
                b'{"schema_version":%d,"records":[' % SCHEMA_VERSION,
                b",".join(item.json for item in chunk),
                b'],"dropped_records":%d' % dropped,
                b"" if device is None else b',"device":' + device,
                b"}",
            )
        )
        result = self.transport.post(body, timeout=remaining)
        self._note_contact(result)
        return result

    def _resolve(self, count: int, *, delivered: bool, remaining: list[_Encoded]) -> None:
        """Account for ``count`` records that left the in-flight batch; wake flush() waiters."""
        with self.cond:
            if delivered:
                self.sent += count
            else:
                self.dropped += count
            self.inflight_head = remaining[0].seq if remaining else None
            self.inflight_count = len(remaining)
            self.cond.notify_all()

    def _wait_to_retry(self, result: PostResult) -> bool:
        """Back off after a retryable failure. Returns False when closing ran out of time."""
        self.failures += 1
        status = f"HTTP {result.status}: " if result.status else ""
        self.last_error = status + result.detail
        if self.failures == 1 and result.refused:
            self.failing_since = time.monotonic()
            logger.error(
                "ampscope reporter: %s refused the connection: %s; retrying with backoff (up "
                "to %.1fs), queueing up to %d records",
                self.config.url,
                result.detail,
                self.config.retry_max,
                self.config.max_queue,
            )
        elif self.failures == 1:
            self.failing_since = time.monotonic()
            logger.warning(
                "ampscope reporter: cannot deliver to %s (%s); retrying with backoff (up to "
                "%.1fs), queueing up to %d records. Start an exporter on that node with "
                "`ampscope serve`, point %s at a running one, or set %s=off to turn "
                "reporting off",
                self.config.url,
                self.last_error,
                self.config.retry_max,
                self.config.max_queue,
                URL_ENV,
                URL_ENV,
            )
        delay = retry_delay(self.config, self.failures, result.retry_after)
        with self.cond:
            was_closing = self.closing
            end = min(time.monotonic() + delay, self.deadline)
            while not self._past_deadline() and time.monotonic() < end:
                if self.closing and not was_closing:
                    break  # close() was called: try again at once, then back off until the deadline
                self.cond.wait(end - time.monotonic())
            return not (self.closing and self._past_deadline())

    def _note_recovery(self) -> None:
        if self.failures:
            logger.info(
                "ampscope reporter: delivering to %s again after %d failed attempts over %.1fs "
                "(%d records dropped so far)",
                self.config.url,
                self.failures,
                time.monotonic() - self.failing_since,
                self.dropped,
            )
            self.failures = 0

    def log_once(
        self, key: str, level: int, message: str, *args: object, exc_info: bool = False
    ) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.log(level, message, *args, exc_info=exc_info)
