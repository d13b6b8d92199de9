"""One rank's state in the exporter: its newest record, a bounded history, window samples.

Records of one rank can arrive out of order (a reporter retries a failed batch after a
newer one got through) and a rank can restart (a new process, step count from 1 again,
cumulative totals from 0). ``RankState.apply`` sorts this out record by record:

* a higher step than the newest is the new newest;
* the same step again is a duplicate (a retried batch) and is ignored;
* a lower step produced *after* the newest (its ``time`` is later) is a restart: the
  state starts over from it, counters reset, as Prometheus expects of a new process;
* a lower step produced *before* the newest is a late retry: it fills its place in the
  history but changes no current value;
* after a restart, records produced before the first record heard from the new process
  are ignored: they come from the dead process (a last retry in flight), or are early
  records of the new one that arrived late, which costs a gap in the history but never
  a wrong current value.

Comparing step numbers alone cannot tell a retry from a restart (both carry a lower
step and lower ``totals.steps``); the record's own wall-clock ``time``, set on the
rank's host, can. Not thread-safe: the ``Store`` serialises access under its lock.

Memory: a parsed StepRecord with its totals takes ~10 KB of Python objects, its JSON
~1.4 KB (8 devices, top-8 parameters). Only the newest record stays parsed; the history
holds each record as JSON with the few fields the health rules read, and window samples
hold only the counters the windowed rules difference.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple

from ampscope.reporter.schema import Identity, RankTotals, StepRecord

PER_RANK_SERIES = 10
"""Per-rank families without an extra label (scale, growth tracker, last step, last
report time, up, steps, skipped, backoffs, growths, reporter drops)."""
ALIGNED_SERIES = 2
"""The aligned scale and its step, once the rank has reached its first aligned step."""

_Outcome = Literal["newest", "restart", "late", "ignored"]

MAX_SAMPLES = 8192
"""Window samples kept per rank at most, whatever the batch rate (one per batch)."""


class HeldRecord(NamedTuple):
    """One history entry: what the health rules read, and the whole record as JSON."""

    step: int
    time: float
    scale_after: float
    json: str

    @classmethod
    def of(cls, record: StepRecord) -> HeldRecord:
        return cls(record.step, record.time, record.scale_after, record.model_dump_json())

    def record(self) -> StepRecord:
        """The record, parsed again (it was valid when it arrived). ~50 us."""
        return StepRecord.model_validate_json(self.json)


class WindowCounts(NamedTuple):
    """The cumulative counters the windowed health rules difference."""

    steps: int
    skipped_steps: int
    found_inf_local: Mapping[str, int]
    found_inf_origin: Mapping[str, int]
    """Shared with the record's totals, not copied: nothing mutates them."""

    @classmethod
    def of(cls, totals: RankTotals) -> WindowCounts:
        return cls(
            totals.steps, totals.skipped_steps, totals.found_inf_local, totals.found_inf_origin
        )


class Sample(NamedTuple):
    """The rank's cumulative counters as of one accepted batch, for windowed health rules."""

    received: float
    """Exporter clock when the batch arrived."""
    counts: WindowCounts
    """Counters of the newest record after the batch."""
    scale: float
    """scale_after of that record."""
    peak_scale: float
    """Highest scale (before or after) of the records the batch advanced through."""


@dataclass(frozen=True, kw_only=True)
class RankSnapshot:
    """An immutable copy of a rank's state, safe to read without the store's lock."""

    newest: StepRecord
    last_report: float
    """Exporter clock of the newest accepted batch."""
    dropped_records: int
    restarts: int
    first_step: int
    """Step of the first record seen from the current process (1: seen from its start)."""
    history: tuple[HeldRecord, ...]
    """Oldest first, ascending steps."""
    samples: tuple[Sample, ...]
    """Oldest first; the first may predate the longest window (the window's baseline)."""

    @property
    def identity(self) -> Identity:
        return self.newest.identity

    def reported_within(self, now: float, seconds: float) -> bool:
        """Whether the rank's last report is at most ``seconds`` old: with the stale TTL,
        the one definition of a rank being up (``ampscope_rank_up``, the API, health)."""
        return now - self.last_report <= seconds


def series_of(record: StepRecord) -> int:
    """Label sets the collector exposes for a rank whose newest record is ``record``."""
    totals = record.totals
    return (
        PER_RANK_SERIES
        + (ALIGNED_SERIES if totals.aligned_scale is not None else 0)
        + len(totals.found_inf_local)
        + len(totals.found_inf_origin)
        + len(totals.nonfinite_params)
    )


def _counters_fell(new: RankTotals, old: RankTotals) -> bool:
    return (
        new.steps < old.steps
        or new.skipped_steps < old.skipped_steps
        or new.backoffs < old.backoffs
        or new.growths < old.growths
    )


class RankState:
    """Mutable state of one rank. Every method is O(records applied) unless noted.

    Args:
        history_length: records kept (oldest dropped first).
    """

    def __init__(self, *, history_length: int) -> None:
        self.newest: StepRecord | None = None
        self.last_report = 0.0
        self.dropped_records = 0
        self.restarts = 0
        self.first_step = 0
        self.history: deque[HeldRecord] = deque(maxlen=history_length)
        self.samples: deque[Sample] = deque(maxlen=MAX_SAMPLES)
        # Records produced before this wall-clock time belong to a dead process.
        self._process_start = float("-inf")

    def apply_batch(
        self, records: list[StepRecord], dropped_records: int, now: float
    ) -> tuple[int, int]:
        """Apply one batch's records (oldest first) received at exporter time ``now``.

        Contract: the caller checked the batch is from this rank and within limits. Updates
        newest, history, the dropped count and, when the newest advanced, appends one
        window sample. ``last_report`` moves to ``now`` for any batch from a live process.

        Returns:
            (records accepted, records ignored as duplicates or from a dead process).
        """
        accepted = ignored = 0
        advanced = restarted = False
        peak = 0.0
        for record in records:
            outcome = self._apply(record)
            if outcome == "ignored":
                ignored += 1
                continue
            accepted += 1
            if outcome in ("newest", "restart"):
                if outcome == "restart":
                    restarted, peak = True, 0.0
                advanced = True
                peak = max(peak, record.scale_before, record.scale_after)
        if accepted == 0:
            return 0, ignored
        self.last_report = now
        # The reporter's drop count is cumulative per process: monotonic until a restart.
        if restarted:
            self.dropped_records = dropped_records
        else:
            self.dropped_records = max(self.dropped_records, dropped_records)
        if advanced and self.newest is not None:
            self.samples.append(
                Sample(
                    received=now,
                    counts=WindowCounts.of(self.newest.totals),
                    scale=self.newest.scale_after,
                    peak_scale=peak,
                )
            )
        return accepted, ignored

    def _apply(self, record: StepRecord) -> _Outcome:
        newest = self.newest
        if record.time < self._process_start:
            return "ignored"
        if newest is None:
            self._start(record)
            return "newest"
        if record.step > newest.step:
            if _counters_fell(record.totals, newest.totals):
                # A new process that already got past the old one's step count.
                self._restart(record)
                return "restart"
            self.newest = record
            self.history.append(HeldRecord.of(record))
            return "newest"
        if record.step == newest.step:
            return "ignored"
        if record.time > newest.time:
            self._restart(record)
            return "restart"
        return "late" if self._insert_late(record) else "ignored"

    def _start(self, record: StepRecord) -> None:
        self.newest = record
        self.first_step = record.step
        self.history.append(HeldRecord.of(record))

    def _restart(self, record: StepRecord) -> None:
        self._process_start = record.time
        self.restarts += 1
        self.history.clear()
        self.samples.clear()
        self._start(record)

    def _insert_late(self, record: StepRecord) -> bool:
        # Rare (a retried batch): O(history) rebuild keeps the deque sorted by step.
        steps = [r.step for r in self.history]
        at = bisect.bisect_left(steps, record.step)
        if at < len(steps) and steps[at] == record.step:
            return False
        if at == 0 and len(self.history) == self.history.maxlen:
            return False  # older than everything a full history keeps
        items = list(self.history)
        items.insert(at, HeldRecord.of(record))
        self.history = deque(items, maxlen=self.history.maxlen)  # drops the oldest if full
        return True

    def trim_samples(self, keep_after: float) -> None:
        """Drop samples no window needs: all older than ``keep_after`` except the newest of
        those, which is the baseline of a window starting at ``keep_after``. O(dropped)."""
        samples = self.samples
        while len(samples) >= 2 and samples[1].received <= keep_after:
            samples.popleft()

    def snapshot(self) -> RankSnapshot:
        """Copy for lock-free reading. O(history + samples), C-speed tuple copies."""
        assert self.newest is not None
        return RankSnapshot(
            newest=self.newest,
            last_report=self.last_report,
            dropped_records=self.dropped_records,
            restarts=self.restarts,
            first_step=self.first_step,
            history=tuple(self.history),
            samples=tuple(self.samples),
        )
