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
rank's host, can. That clock is trusted only up to the exporter's: the store refuses
times more than ``max_clock_skew_s`` ahead of its receive time, and a restart's process
start is never later than the receive time, so a forged future record cannot make a
genuine process look dead. Any counter of the totals moving backwards at a higher step
is a restart too; a record that changes the rank's node, local rank, world size or job id
without restarting is refused (``IdentityConflict``). Not thread-safe: the ``Store``
serialises access under its lock.

Memory: a parsed StepRecord with its totals takes ~10 KB of Python objects, its JSON
~1.4 KB (8 devices, top-8 parameters). Only the newest record stays parsed; the history
holds each record as JSON with the few fields the health rules read (``nbytes`` each,
counted against the store's history budget), and window samples hold only the counters
the windowed rules difference, at most one per ``sample_interval_s`` (see ``MAX_SAMPLES``).
"""

from __future__ import annotations

import bisect
import sys
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple

from ampscope.exporter.state.fp8_series import Fp8Series, RankFp8
from ampscope.exporter.state.pauses import HeldPause, pause_after
from ampscope.exporter.state.replicas import (
    NO_REPLICA_CHECKS,
    Divergence,
    RankReplicas,
    ReplicaCounts,
    replica_offended,
)
from ampscope.exporter.state.reruns import (
    NO_RERUNS,
    RankReruns,
    RerunCounts,
    RerunEvent,
    device_offended,
)
from ampscope.exporter.state.spike_windows import RankSpikes, SpikeCounts, SpikeEvent
from ampscope.reporter.fault_rule import FAULT_KINDS
from ampscope.reporter.schema import (
    DeviceIdentity,
    Heartbeat,
    Identity,
    RankFailure,
    RankTotals,
    StepRecord,
    WeatherTotals,
)
from ampscope.reporter.spike_rule import SpikeRule
from ampscope.verdicts.fp8 import Fp8Rule
from ampscope.verdicts.ranks import is_scaler

PER_RANK_SERIES = 14
"""Per-rank label sets of every rank besides devices and parameters: info, last step, last
report time, up, steps, skipped, non-finite updates applied, reporter drops, and the six
``ampscope_rank_state`` states (a failed rank adds ``ampscope_rank_failure_info``, a paused
one its pause: ``RankState.series``)."""
SCALER_SERIES = 4
"""A scaler rank's scale, growth tracker, backoffs and growths (a watch has no scale)."""
WEATHER_SERIES = 1
"""``ampscope_weather_skipped_steps_total`` of a rank whose reporter counts weather (its
per-device weather series add one per found-inf device)."""
ALIGNED_SERIES = 3
"""A scaler's aligned scale, its step and both packed, once it has reached its first
aligned step."""
SPIKE_SERIES = 3
"""A rank that reports stats: ``ampscope_spikes_total`` of each kind (its loss and gradient
norm gauges count when its newest record holds them)."""

NO_SPIKES = SpikeCounts()

_Outcome = Literal["newest", "restart", "late", "ignored"]

MAX_SAMPLES = 8192
"""Window samples kept per rank at most, whatever the batch rate (one per batch)."""

SAMPLES_PER_WINDOW = 60
"""Window samples are at least ``window_s / SAMPLES_PER_WINDOW`` apart (10 s for the
default 600 s, the order of a scrape interval), so a rank holds at most
``SAMPLES_PER_WINDOW + 2`` of them however fast it posts; windows are exact to that
interval."""

HELD_OVERHEAD_BYTES = 200
"""A history entry's bytes beyond its JSON string and device names: the tuple, its
numbers and flags, a deque slot."""


class IdentityConflict(Exception):
    """A record changes a live rank's node, local rank or world size without a restart."""


class HeldRecord(NamedTuple):
    """One history entry: what the health rules and the web view's series read, and the
    whole record as JSON."""

    step: int
    time: float
    scale_after: float
    skipped: bool
    backoff: bool
    inf_local: tuple[str, ...]
    """Devices whose local gradient shards held inf/NaN at this step (usually none)."""
    inf_origin: tuple[str, ...]
    """Devices whose pre-reduction gradients held inf/NaN at this step (usually none)."""
    json: str
    loss: float | None = None
    grad_norm: float | None = None
    """The record's stats (``None``: not reported, or an overflow iteration)."""

    @classmethod
    def of(cls, record: StepRecord) -> HeldRecord:
        stats = record.stats
        return cls(
            record.step,
            record.time,
            record.scale_after,
            record.skipped,
            record.event == "backoff",
            _hits(record.found_inf_local),
            _hits(record.found_inf_origin),
            record.model_dump_json(),
            None if stats is None else stats.loss,
            None if stats is None else stats.grad_norm,
        )

    def record(self) -> StepRecord:
        """The record, parsed again (it was valid when it arrived). ~50 us."""
        return StepRecord.model_validate_json(self.json)

    @property
    def nbytes(self) -> int:
        """Memory this entry holds, as counted against the history byte budget."""
        devices = self.inf_local + self.inf_origin
        extra = (
            sum(map(sys.getsizeof, devices))
            + sys.getsizeof(self.inf_local)
            + sys.getsizeof(self.inf_origin)
            if devices
            else 0
        )
        return sys.getsizeof(self.json) + HELD_OVERHEAD_BYTES + extra


def _hits(found_inf: Mapping[str, bool]) -> tuple[str, ...]:
    # The empty tuple is a shared singleton: clean steps (most of them) cost nothing extra.
    return tuple(device for device, hit in found_inf.items() if hit)


class WindowCounts(NamedTuple):
    """The cumulative counters the windowed health rules difference."""

    steps: int
    skipped_steps: int
    found_inf_local: Mapping[str, int]
    found_inf_origin: Mapping[str, int]
    """Shared with the record's totals, not copied: nothing mutates them."""
    weather: WeatherTotals | None = None
    """What of them the fault rule called the scaler's weather (``RankTotals.weather``);
    ``None`` from a reporter that predates it."""

    @classmethod
    def of(cls, totals: RankTotals) -> WindowCounts:
        return cls(
            totals.steps,
            totals.skipped_steps,
            totals.found_inf_local,
            totals.found_inf_origin,
            totals.weather,
        )


class Sample(NamedTuple):
    """The rank's cumulative counters as of one accepted batch, for windowed health rules."""

    received: float
    """Exporter clock when the batch arrived."""
    counts: WindowCounts
    """Counters of the newest record after the batch."""
    scale: float
    """The scale ``scale_collapse`` measures from as of that record (``collapse_reference``:
    its clean scale, else its scale after ``update()``)."""
    peak_scale: float
    """Highest ``collapse_reference`` of the records the batch advanced through."""


class SkipEvent(NamedTuple):
    """The newest step a rank skipped (its optimizer did not step: inf/NaN gradients)."""

    step: int
    origin: bool | None
    """Its own gradients held inf/NaN at that step; ``None`` when origin tracking is off."""
    received: float
    """Exporter clock when the record arrived."""

    @classmethod
    def of(cls, record: StepRecord, now: float) -> SkipEvent:
        own = record.found_inf_origin
        return cls(record.step, any(own.values()) if own else None, now)


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
    last_progress: float = 0.0
    """Exporter clock of the batch that last advanced the newest step (the stall clock)."""
    finished_at: float | None = None
    """Exporter clock of the rank's final heartbeat; ``None`` while it has not ended."""
    pause: HeldPause | None = None
    """The pause its heartbeats say (it stops stepping on purpose); ``None``: none."""
    failure: RankFailure | None = None
    """What its final heartbeat said training ended on: the rank ended ``failed``;
    ``None`` while running, and for a rank that finished normally."""
    stop_signal: int | None = None
    """The signal its final heartbeat said stopped it (15: SIGTERM): the rank ended
    ``stopped`` (unless it also failed); ``None`` while running, and for a rank that
    ended by itself."""
    spike_counts: SpikeCounts = NO_SPIKES
    """Spike iterations per kind the exporter found (``ampscope_spikes_total``)."""
    spikes: tuple[SpikeEvent, ...] = ()
    """The most recent of them, oldest first."""
    device: DeviceIdentity | None = None
    """The device the rank's current process named (``None``: not heard yet, or a reporter
    that predates it)."""
    last_offence: float | None = None
    """Record time of the newest step at which the rank was an offender: its own gradients
    held inf/NaN (origin tracking) and no rerun reproduced it, its flagged result was not
    reproduced by a rerun (``transient_fault``), or a majority of its replicas outvoted it
    (``replica_divergence``); ``None`` while none was seen. An origin outlier is none: its
    batch may be the cause (``catalogue.OFFENCE_KINDS``)."""
    last_skip: SkipEvent | None = None
    """The current process's newest skipped step the exporter received."""
    fp8: tuple[Fp8Series, ...] = ()
    """The rank's FP8 series (torchao ``Float8Linear`` layers), when it reports them."""
    rerun_counts: RerunCounts = NO_RERUNS
    """Reruns of its own flagged results, by result (``ampscope_reruns_total``)."""
    reruns: tuple[RerunEvent, ...] = ()
    """The most recent of them, oldest first."""
    rerun_data_origins: int = 0
    """Origin detections of steps whose rerun reproduced the rank's flagged result (the
    data's): left out of the device's ``nonfinite_origin`` offences."""
    replica_counts: ReplicaCounts = NO_REPLICA_CHECKS
    """Replica checks of its group, by result (``ampscope_replica_checks_total``)."""
    replica_divergence: Divergence | None = None
    """The first check of its current process whose replicas disagreed."""
    replica_offences: int = 0
    """Diverged checks in which a majority of its replicas outvoted it (its device's
    ``replica_divergence`` offences)."""

    @property
    def identity(self) -> Identity:
        return self.newest.identity

    def reported_within(self, now: float, seconds: float) -> bool:
        """Whether the rank's last report is at most ``seconds`` old: with the stale TTL,
        the one definition of a rank being up (``ampscope_rank_up``, the API, health)."""
        return now - self.last_report <= seconds


def collapse_reference(record: StepRecord, *, after: bool = False) -> float:
    """The scale ``scale_collapse`` measures a fall from, as one record tells it: the fault
    rule's clean scale (the scale at which the run trained cleanly: a warm-up from a high
    ``init_scale``, or a probe upward, is no height to fall from), 0 while there is none
    yet; a record of a reporter that predates the rule, its scales (``after``: its scale
    after ``update()`` alone)."""
    totals = record.totals
    if totals.faults is not None:
        return 0.0 if totals.clean_scale is None else totals.clean_scale
    return record.scale_after if after else max(record.scale_before, record.scale_after)


def series_of(record: StepRecord) -> int:
    """Label sets the collector exposes for a rank whose newest record is ``record``."""
    totals = record.totals
    scaler = is_scaler(record.setup.mode)
    stats = record.stats
    return (
        PER_RANK_SERIES
        + (SCALER_SERIES if scaler else 0)
        + (ALIGNED_SERIES if scaler and totals.aligned_scale is not None else 0)
        + len(totals.found_inf_local)
        + len(totals.found_inf_origin)
        + len(totals.nonfinite_params)
        + (0 if totals.faults is None else len(FAULT_KINDS))
        + (
            0
            if totals.weather is None
            else WEATHER_SERIES + len(totals.found_inf_local) + len(totals.found_inf_origin)
        )
        + (1 if scaler and totals.clean_scale is not None else 0)
        + (
            0
            if stats is None
            else SPIKE_SERIES
            + sum(v is not None for v in (stats.loss, stats.grad_norm, stats.grad_norm_origin))
        )
    )


def _map_fell(new: Mapping[str, int], old: Mapping[str, int]) -> bool:
    # Per-device counts only grow in one process; a device that vanished fell to zero.
    # Most records repeat the previous counts: one comparison in C settles those.
    return new != old and any(new.get(key, 0) < count for key, count in old.items())


def _weather_fell(new: WeatherTotals | None, old: WeatherTotals | None) -> bool:
    # A reporter that stops sending the field (a downgrade) lost the counters too.
    if old is None or new is old:
        return False
    return (
        new is None
        or new.skipped_steps < old.skipped_steps
        or _map_fell(new.found_inf_local, old.found_inf_local)
        or _map_fell(new.found_inf_origin, old.found_inf_origin)
    )


def counters_fell(new: RankTotals, old: RankTotals) -> bool:
    """Whether any counter the exporter exposes is lower in ``new`` than in ``old``.

    Parameters that left the top K are not a decrease (their series goes away); one
    still listed with a lower count is. O(devices + parameters).
    """
    if (
        new.steps < old.steps
        or new.skipped_steps < old.skipped_steps
        or new.backoffs < old.backoffs
        or new.growths < old.growths
        or new.nonfinite_applied < old.nonfinite_applied
        or _map_fell(new.found_inf_local, old.found_inf_local)
        or _map_fell(new.found_inf_origin, old.found_inf_origin)
        or _weather_fell(new.weather, old.weather)
    ):
        return True
    old_params = {p.name: p.count for p in old.nonfinite_params}
    return any(p.count < old_params.get(p.name, 0) for p in new.nonfinite_params)


def _classify(record: StepRecord, newest: StepRecord | None, process_start: float) -> _Outcome:
    """What a record does to a rank whose newest record is ``newest``; "late" may still
    be ignored when the history already holds the step or is full of newer ones."""
    if record.time < process_start:
        return "ignored"
    if newest is None:
        return "newest"
    if record.step > newest.step:
        # A new process that already got past the old one's step count.
        return "restart" if counters_fell(record.totals, newest.totals) else "newest"
    if record.step == newest.step:
        return "ignored"
    return "restart" if record.time > newest.time else "late"


def _same_rank(a: Identity, b: Identity) -> bool:
    # The job id too: a rank of another job reusing the run id is not this process.
    return (a.node, a.local_rank, a.world_size, a.job_id) == (
        b.node,
        b.local_rank,
        b.world_size,
        b.job_id,
    )


def newest_after(
    newest: StepRecord | None, process_start: float, records: list[StepRecord], now: float
) -> StepRecord:
    """The record that would be newest after applying ``records`` (oldest first) at
    exporter time ``now``, without changing anything: what the store's series limit is
    checked on. O(records x (devices + parameters)).

    Raises:
        IdentityConflict: a record that is not a restart names another node, local rank,
            world size or job id than the newest record before it.
    """
    for record in records:
        outcome = _classify(record, newest, process_start)
        if outcome == "ignored":
            continue
        if (
            newest is not None
            and outcome != "restart"
            and not _same_rank(record.identity, newest.identity)
        ):
            old, new = newest.identity, record.identity
            raise IdentityConflict(
                f"step {record.step} of rank {new.rank} of run {new.run!r} says node "
                f"{new.node!r}, local_rank {new.local_rank}, world_size {new.world_size}, "
                f"job_id {new.job_id}; the live rank is node {old.node!r}, local_rank "
                f"{old.local_rank}, world_size {old.world_size}, job_id {old.job_id} (a "
                "restart may change these; a running "
                "process may not)"
            )
        if outcome == "restart":
            process_start = min(record.time, now)
        if outcome != "late":
            newest = record
    assert newest is not None  # records is never empty
    return newest


class RankState:
    """Mutable state of one rank. Every method is O(records applied) unless noted.

    Args:
        history_length: records kept (oldest dropped first).
        sample_interval_s: least spacing of window samples: while the newest sample is
            closer than that to the one before it, a batch replaces it instead of adding.
        spike_rule: the spike rule applied to the rank's loss and gradient norm.
    """

    def __init__(
        self,
        *,
        history_length: int,
        sample_interval_s: float = 0.0,
        spike_rule: SpikeRule | None = None,
        fp8_rule: Fp8Rule | None = None,
    ) -> None:
        self.spikes = RankSpikes(spike_rule or SpikeRule())
        self.fp8 = RankFp8(fp8_rule or Fp8Rule())
        self.reruns = RankReruns()
        self.replicas = RankReplicas()
        self.newest: StepRecord | None = None
        self.last_report = 0.0
        self.dropped_records = 0
        self.restarts = 0
        self.first_step = 0
        self.history: deque[HeldRecord] = deque(maxlen=history_length)
        self.history_bytes = 0
        """Sum of the history entries' ``nbytes``."""
        self.samples: deque[Sample] = deque(maxlen=MAX_SAMPLES)
        self._sample_interval_s = sample_interval_s
        self.last_progress = 0.0
        self.finished_at: float | None = None
        self.pause: HeldPause | None = None
        """The pause its newest heartbeat said (``paused()`` on the rank), until a
        heartbeat without one or a new step."""
        self.device: DeviceIdentity | None = None
        """What the current process said it runs on (see ``note_device``)."""
        self.last_offence: float | None = None
        """Record time of the newest offence seen (see ``note_offence``)."""
        self.last_skip: SkipEvent | None = None
        self.failure: RankFailure | None = None
        self.stop_signal: int | None = None
        # Records produced before this wall-clock time belong to a dead process.
        self._process_start = float("-inf")

    def series(self) -> int:
        """Label sets the collector exposes for this rank: its newest record's, the failure
        info of a failed rank, the pause of a paused one (counted while held: a leftover the
        collector leaves out counts too, one per rank at most), its exported FP8 series and
        its non-zero rerun counters. Contract: the rank holds a record. O(devices)."""
        assert self.newest is not None
        reruns = sum(count > 0 for count in self.reruns.counts)
        reruns += sum(count > 0 for count in self.replicas.counts)
        said = (self.failure is not None) + (self.pause is not None)
        return series_of(self.newest) + said + self.fp8.exposed() + reruns

    def newest_after(self, records: list[StepRecord], now: float) -> StepRecord:
        """See the module's ``newest_after``: this rank's newest record after ``records``."""
        return newest_after(self.newest, self._process_start, records, now)

    def apply_batch(
        self,
        records: list[StepRecord],
        dropped_records: int,
        now: float,
        on_accept: Callable[[StepRecord], None] | None = None,
    ) -> tuple[int, int]:
        """Apply one batch's records (oldest first) received at exporter time ``now``.

        Contract: the caller checked the batch is from this rank, within limits and free
        of identity conflicts (``newest_after``). Updates newest, history, the dropped
        count and, when the newest advanced, the window samples. ``last_report`` moves to
        ``now`` for any batch from a live process. Records that advance the newest step feed
        the spike windows, in step order; late ones (retries of older steps) do not, as the
        windows hold the past of each value. ``on_accept`` sees every accepted record.

        Returns:
            (records accepted, records ignored as duplicates or from a dead process).
        """
        accepted = ignored = 0
        advanced = restarted = False
        peak = 0.0
        for record in records:
            outcome = self._apply(record, now)
            if outcome == "ignored":
                ignored += 1
                continue
            accepted += 1
            if on_accept is not None:
                on_accept(record)
            if outcome in ("newest", "restart"):
                if outcome == "restart":
                    restarted, peak = True, 0.0
                advanced = True
                peak = max(peak, collapse_reference(record))
        if accepted == 0:
            return 0, ignored
        self.last_report = now
        # The reporter's drop count is cumulative per process: monotonic until a restart.
        if restarted:
            self.dropped_records = dropped_records
        else:
            self.dropped_records = max(self.dropped_records, dropped_records)
        if advanced:
            # A new step from a rank that had said goodbye is a new process: running again
            # (the next elastic generation of a rank its launcher stopped, too).
            self.last_progress, self.finished_at = now, None
            self.failure = self.stop_signal = None
            self.pause = None  # a new step ends a pause; the next heartbeat may say another
        if advanced and self.newest is not None:
            self._sample(now, peak)
        return accepted, ignored

    def heartbeat(self, beat: Heartbeat, now: float) -> bool:
        """Apply a heartbeat received at exporter time ``now``. O(1).

        Contract: the rank holds a record. A heartbeat produced before the newest record of
        a process that has since restarted is ignored; any other moves ``last_report``, and
        a final one marks the rank finished, failed when it carries a ``failure``, or
        stopped when it carries a ``stop_signal`` (its next new step makes it running
        again). A failure wins over an earlier plain final heartbeat: an exception that
        reached the process's hook after the rank closed. A non-final one also sets, or
        ends, the rank's pause: what it says.

        Returns:
            Whether the heartbeat was applied.

        Raises:
            IdentityConflict: the heartbeat names another node, local rank, world size or job id
                than the rank's newest record (another job reusing the run id): as for a
                record, it must not keep the rank alive or finish it.
        """
        if beat.time < self._process_start:
            return False
        assert self.newest is not None
        if not _same_rank(beat.identity, self.newest.identity):
            old, new = self.newest.identity, beat.identity
            raise IdentityConflict(
                f"a heartbeat of rank {new.rank} of run {new.run!r} says node {new.node!r}, "
                f"local_rank {new.local_rank}, world_size {new.world_size}, job_id "
                f"{new.job_id}; the live rank is node {old.node!r}, local_rank "
                f"{old.local_rank}, world_size {old.world_size}, job_id {old.job_id}"
            )
        self.last_report = max(self.last_report, now)
        self.dropped_records = max(self.dropped_records, beat.dropped_records)
        self.pause = None if beat.final else pause_after(beat.pause, now, beat.time, self.pause)
        if beat.final and self.finished_at is None:
            self.finished_at = now
        if beat.failure is not None:
            self.failure = beat.failure
        if beat.stop_signal is not None:
            self.stop_signal = beat.stop_signal
        return True

    def note_device(self, device: DeviceIdentity | None) -> None:
        """Keep the device a batch of the current process named. O(1).

        Contract: called after ``apply_batch`` accepted records of the batch; a ``None``
        (a batch that does not say) keeps what is known.
        """
        if device is not None:
            self.device = device

    def note_offence(self, when: float) -> None:
        """The rank offended at record time ``when``: a record its device offended at (a
        fault of its own no rerun reproduced, a replica minority). O(1)."""
        if self.last_offence is None or when > self.last_offence:
            self.last_offence = when

    def _sample(self, now: float, peak: float) -> None:
        samples = self.samples
        if (
            len(samples) >= 2
            and samples[-1].received - samples[-2].received < self._sample_interval_s
        ):
            # The newest sample is too close to the one before to be kept: it moves on.
            peak = max(peak, samples.pop().peak_scale)
        assert self.newest is not None
        samples.append(
            Sample(
                received=now,
                counts=WindowCounts.of(self.newest.totals),
                scale=collapse_reference(self.newest, after=True),
                peak_scale=peak,
            )
        )

    def _apply(self, record: StepRecord, now: float) -> _Outcome:
        outcome = _classify(record, self.newest, self._process_start)
        if outcome != "ignored" and (device_offended(record) or replica_offended(record)):
            self.note_offence(record.time)
        if outcome == "newest":
            if self.newest is None:
                self.first_step = record.step
            self.newest = record
            self._append(HeldRecord.of(record))
            self.spikes.observe(record, now)
            self.fp8.observe(record, now)
            self.reruns.observe(record, now)
            self.replicas.observe(record, now)
        elif outcome == "restart":
            self._process_start = min(record.time, now)
            self.restarts += 1
            self.device = None  # the new process says its own (a rank may move)
            self.history.clear()
            self.history_bytes = 0
            self.samples.clear()
            self.spikes.reset()
            self.last_skip = None
            self.fp8.reset()
            self.reruns.reset()
            self.replicas.reset()
            self.newest = record
            self.first_step = record.step
            self._append(HeldRecord.of(record))
            self.spikes.observe(record, now)
            self.fp8.observe(record, now)
            self.reruns.observe(record, now)
            self.replicas.observe(record, now)
        elif outcome == "late" and not self._insert_late(record):
            return "ignored"
        if record.skipped and (self.last_skip is None or record.step > self.last_skip.step):
            self.last_skip = SkipEvent.of(record, now)
        return outcome

    def _append(self, held: HeldRecord) -> None:
        if len(self.history) == self.history.maxlen:
            self.history_bytes -= self.history[0].nbytes
        self.history.append(held)
        self.history_bytes += held.nbytes

    def record_at(self, step: int) -> StepRecord | None:
        """The held record of ``step``, parsed again, or ``None``. O(history) + ~50 us: for
        the rare step that turned out an outlier."""
        steps = [held.step for held in self.history]
        at = bisect.bisect_left(steps, step)
        if at < len(steps) and steps[at] == step:
            return self.history[at].record()
        return None

    def drop_oldest(self) -> int:
        """Drop the oldest history entry (the store's byte budget); returns its bytes."""
        nbytes = self.history.popleft().nbytes
        self.history_bytes -= nbytes
        return nbytes

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
        self.history_bytes = sum(held.nbytes for held in self.history)
        return True

    def trim_samples(self, keep_after: float) -> None:
        """Drop samples no window needs: all older than ``keep_after`` except the newest of
        those, which is the baseline of a window starting at ``keep_after``. O(dropped)."""
        samples = self.samples
        while len(samples) >= 2 and samples[1].received <= keep_after:
            samples.popleft()

    def snapshot(self, *, history: bool = True) -> RankSnapshot:
        """Copy for lock-free reading. O(history + samples), C-speed tuple copies; without
        ``history`` (the record history and window samples left empty, and the FP8 series
        without their spike baselines) O(recent spikes + FP8 series), for readers of the
        newest state only (the collector, the run listing)."""
        assert self.newest is not None
        return RankSnapshot(
            newest=self.newest,
            last_report=self.last_report,
            dropped_records=self.dropped_records,
            restarts=self.restarts,
            first_step=self.first_step,
            history=tuple(self.history) if history else (),
            samples=tuple(self.samples) if history else (),
            last_progress=self.last_progress,
            finished_at=self.finished_at,
            pause=self.pause,
            failure=self.failure,
            stop_signal=self.stop_signal,
            spike_counts=self.spikes.counts,
            spikes=tuple(self.spikes.recent),
            device=self.device,
            last_offence=self.last_offence,
            last_skip=self.last_skip,
            fp8=self.fp8.view(baselines=history),
            rerun_counts=self.reruns.counts,
            reruns=tuple(self.reruns.recent),
            rerun_data_origins=self.reruns.data_origins,
            replica_counts=self.replicas.counts,
            replica_divergence=self.replicas.first,
            replica_offences=self.replicas.offences,
        )
