"""The exporter's in-memory store: runs → ranks → ``RankState``, under one lock.

Every public method states its contract: what it takes, what it guarantees, what it
costs. The lock is held only for the O(records) or O(ranks) bookkeeping itself; callers
build metric families, JSON and health verdicts from snapshots outside it.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from ampscope.exporter.state.batches import SPIKE_REASONS, BatchLedger
from ampscope.exporter.state.ranks import (
    SAMPLES_PER_WINDOW,
    IdentityConflict,
    RankSnapshot,
    RankState,
    series_of,
)
from ampscope.exporter.state.spike_windows import (
    OriginBoard,
    SpikeCounts,
    SpikeEvent,
    top_params,
)
from ampscope.reporter.schema import DeviceIdentity, Heartbeat, IngestBatch, StepRecord
from ampscope.reporter.spike_rule import SpikeRule
from ampscope.verdicts.fp8 import Fp8Rule

HISTORY_LOW_WATER = 7 / 8
"""Over its byte budget, the history is cut to this fraction of it, so the O(ranks log
ranks) eviction pass runs once per budget/8 bytes ingested, not on every batch."""


@dataclass(frozen=True, kw_only=True)
class StoreLimits:
    """Cardinality limits; exceeding one rejects the whole batch with ``LimitExceeded``.

    ``history_bytes`` is a budget rather than a limit: past it, the oldest history
    entries of any rank are dropped.
    """

    max_runs: int
    max_ranks_per_run: int
    max_series: int
    history_length: int
    window_s: float
    """Longest health window: per-rank window samples older than this are trimmed."""
    max_ranks: int = 1 << 30
    """Ranks of all runs together."""
    history_bytes: int = 1 << 62
    """Bytes of history (``HeldRecord.nbytes``) held across all ranks."""
    max_clock_skew_s: float = float("inf")
    """Records timed further ahead of the exporter's clock than this are refused."""

    def __post_init__(self) -> None:
        for name in (
            "max_runs",
            "max_ranks_per_run",
            "max_ranks",
            "max_series",
            "history_length",
            "history_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if not self.window_s > 0:
            raise ValueError("window_s must be positive")
        if not self.max_clock_skew_s >= 0:
            raise ValueError("max_clock_skew_s must be >= 0")


@dataclass
class BatchRefused(Exception):
    """A batch (or heartbeat) the store will not apply; nothing was changed. Says how the
    API answers it."""

    status: int
    """HTTP status to answer: 409 (identity conflict), 422 (clock skew) or 429 (a limit)."""
    reason: str
    """Rejection reason counted: ``identity_conflict``, ``clock_skew`` or ``cardinality``."""
    detail: str
    limit: str | None = None
    """The setting a 429 hit, e.g. ``max_runs``."""
    value: int | None = None
    """That setting's value."""
    retry_after_s: int | None = None
    """When retrying may succeed, if ever."""

    def __str__(self) -> str:
        return self.detail


CARDINALITY_RETRY_AFTER_S = 60
"""Retry-After of a 429: cardinality frees up only when retention drops something."""


class LimitExceeded(BatchRefused):
    """A batch would push the store past a cardinality limit (429 ``cardinality``)."""

    def __init__(self, limit: str, value: int, detail: str) -> None:
        super().__init__(429, "cardinality", detail, limit, value, CARDINALITY_RETRY_AFTER_S)


@dataclass(frozen=True, kw_only=True)
class IngestOutcome:
    """What ``Store.ingest`` did with a batch."""

    accepted: int
    """Records that changed the state (newest, history or a restart)."""
    ignored: int
    """Duplicates (retried records) and records from a process that has since restarted."""
    new_run: bool = False
    """The batch's run was not held before it: its first record."""


def _peers(record: StepRecord) -> int:
    # The ranks that can report a step to this exporter: the rank's node's, when it said.
    who = record.identity
    return who.local_world_size or who.world_size


def _device_of(records: list[StepRecord]) -> DeviceIdentity | None:
    # The newest record that names the device: a process's first record does.
    return next((r.device for r in reversed(records) if r.device is not None), None)


def _fp8_exposed(record: StepRecord, max_layers: int) -> int:
    """``RankFp8.exposed`` for a rank whose FP8 layers are those of ``record`` (with the
    non-finite amax counters ``record`` itself starts)."""
    if not record.fp8:
        return 0
    counted = 0 if record.skipped else sum(1 for entry in record.fp8 if entry.amax is None)
    return 9 * min(len({entry.layer for entry in record.fp8}), max_layers) + counted


class Store:
    """Thread-safe state of every run and rank the exporter has heard from.

    Args:
        limits: Cardinality limits and sizes.
        spike_rule: The spike rule applied to every rank's loss and gradient norm.
        origin_factor: A rank whose ``grad_norm_origin`` exceeds this many times the median
            of the other ranks held at the same step is an origin outlier.
        fp8_rule: The FP8 rule: judges each rank's FP8 series, bounds the layers exposed.
    """

    def __init__(
        self,
        limits: StoreLimits,
        *,
        spike_rule: SpikeRule | None = None,
        origin_factor: float = 10.0,
        fp8_rule: Fp8Rule | None = None,
    ) -> None:
        if not origin_factor > 1:
            raise ValueError("origin_factor must be > 1")
        self.limits = limits
        self._spike_rule = spike_rule or SpikeRule()
        self.fp8_rule = fp8_rule or Fp8Rule()
        self._origin_factor = origin_factor
        self._lock = threading.Lock()
        self._runs: dict[str, dict[int, RankState]] = {}
        self._boards: dict[str, OriginBoard] = {}
        """Per run: the origin norms of its ranks at recent steps."""
        self._ledgers: dict[str, BatchLedger] = {}
        """Per run: the batch ids of recent and of flagged steps."""
        self._series = 0
        self._ranks = 0
        self._history_bytes = 0

    def ingest(self, batch: IngestBatch, now: float) -> IngestOutcome:
        """Apply a validated batch received at exporter time ``now``.

        Contract: ``batch`` passed ``IngestBatch`` validation (one rank of one run) and the
        per-record limits (devices, parameters). Either the whole batch is applied or
        nothing is: ``LimitExceeded`` (a ``BatchRefused``) names a limit (``max_runs``,
        ``max_ranks_per_run``, ``max_ranks``, ``max_series``: series are counted on the
        record that ends up newest, restarts included); ``BatchRefused`` says the batch is
        timed too far ahead of ``now`` or changes a live rank's identity. Past
        ``history_bytes``, the oldest history of any rank is dropped. Cost: O(records) under
        the lock, plus an O(ranks log ranks) eviction pass once per ``history_bytes / 8``
        bytes ingested.
        """
        first = batch.records[0].identity
        run_id, rank = first.run, first.rank
        latest = max(record.time for record in batch.records)
        if latest > now + self.limits.max_clock_skew_s:
            raise BatchRefused(
                422,
                "clock_skew",
                f"a record of rank {rank} of run {run_id!r} is timed {latest - now:.0f} s "
                f"ahead of the exporter's clock (max_clock_skew_s="
                f"{self.limits.max_clock_skew_s:g}): fix the rank's clock",
            )
        with self._lock:
            ranks = self._runs.get(run_id)
            state = ranks.get(rank) if ranks is not None else None
            if ranks is None and len(self._runs) >= self.limits.max_runs:
                raise LimitExceeded(
                    "max_runs",
                    self.limits.max_runs,
                    f"the exporter already tracks {len(self._runs)} runs "
                    f"(max_runs={self.limits.max_runs}); run {run_id!r} is not accepted "
                    "until retention drops an old run",
                )
            if state is None and ranks is not None and len(ranks) >= self.limits.max_ranks_per_run:
                raise LimitExceeded(
                    "max_ranks_per_run",
                    self.limits.max_ranks_per_run,
                    f"run {run_id!r} already has {len(ranks)} ranks "
                    f"(max_ranks_per_run={self.limits.max_ranks_per_run}); rank {rank} "
                    "is not accepted",
                )
            if state is None and self._ranks >= self.limits.max_ranks:
                raise LimitExceeded(
                    "max_ranks",
                    self.limits.max_ranks,
                    f"the exporter already tracks {self._ranks} ranks "
                    f"(max_ranks={self.limits.max_ranks}); rank {rank} of run {run_id!r} is "
                    "not accepted until retention drops a rank",
                )
            try:
                candidate = (state or RankState(history_length=1)).newest_after(batch.records, now)
            except IdentityConflict as exc:
                raise BatchRefused(409, "identity_conflict", str(exc)) from None
            before = 0 if state is None or state.newest is None else state.series()
            # FP8 series: what the rank holds, or (a first record of FP8 layers) will hold.
            fp8_before = 0 if state is None else state.fp8.exposed()
            fp8_after = max(fp8_before, _fp8_exposed(candidate, self.fp8_rule.max_layers))
            growth = series_of(candidate) + fp8_after - before
            if growth > 0 and self._series + growth > self.limits.max_series:
                raise LimitExceeded(
                    "max_series",
                    self.limits.max_series,
                    f"accepting rank {rank} of run {run_id!r} would expose "
                    f"{self._series + growth} series (max_series={self.limits.max_series})",
                )
            new_run = ranks is None
            if ranks is None:
                ranks = self._runs[run_id] = {}
                self._boards[run_id] = OriginBoard(self._origin_factor)
                self._ledgers[run_id] = BatchLedger()
            if state is None:
                state = ranks[rank] = RankState(
                    history_length=self.limits.history_length,
                    sample_interval_s=self.limits.window_s / SAMPLES_PER_WINDOW,
                    spike_rule=self._spike_rule,
                    fp8_rule=self.fp8_rule,
                )
                self._ranks += 1
            held_before = state.history_bytes
            restarts = state.restarts
            spikes_before = state.spikes.counts
            accepted_records: list[StepRecord] = []
            accepted, ignored = state.apply_batch(
                batch.records, batch.dropped_records, now, accepted_records.append
            )
            if accepted:
                state.note_device(batch.device or _device_of(accepted_records))
            self._note_batches(run_id, rank, state, spikes_before, restarts, accepted_records)
            self._compare_origins(run_id, ranks, state.restarts != restarts, rank,
                                  accepted_records, now)  # fmt: skip
            # A fresh RankState takes any first record, so newest is set from here on.
            assert state.newest is not None
            self._series += state.series() - before
            self._history_bytes += state.history_bytes - held_before
            state.trim_samples(now - self.limits.window_s)
            if self._history_bytes > self.limits.history_bytes:
                self._evict_history()
        return IngestOutcome(accepted=accepted, ignored=ignored, new_run=new_run)

    def _compare_origins(
        self,
        run_id: str,
        ranks: dict[int, RankState],
        restarted: bool,
        rank: int,
        records: list[StepRecord],
        now: float,
    ) -> None:
        # Any accepted record may complete a step's comparison, late ones included: the
        # board does not depend on the order records arrive in.
        board = self._boards[run_id]
        if restarted:
            board.forget(rank)  # the new process's steps are not the old one's
        for record in records:
            stats = record.stats
            if stats is None:
                continue
            origin = stats.grad_norm_origin
            group = record.setup.origin_group
            for outlier in board.observe(rank, record.step, origin, _peers(record), group):
                self._ledgers[run_id].flag(outlier.rank, outlier.step, "origin_outlier")
                held = ranks[outlier.rank]
                own = record if outlier.rank == rank else held.record_at(outlier.step)
                held.spikes.add(
                    SpikeEvent(
                        kind="origin_outlier",
                        step=outlier.step,
                        value=outlier.value,
                        mean=None,
                        stdev=None,
                        median=outlier.median,
                        time=(own or record).time,
                        received=now,
                        compared=outlier.compared,
                        top_params=top_params(own) if own is not None else (),
                    )
                )

    def _note_batches(
        self,
        run_id: str,
        rank: int,
        state: RankState,
        spikes_before: SpikeCounts,
        restarts: int,
        records: list[StepRecord],
    ) -> None:
        # The ledger sees every accepted record's ids, then the spikes this batch found
        # (the newest of the rank's recent spikes); origin outliers come from the board.
        ledger = self._ledgers[run_id]
        if state.restarts != restarts:
            ledger.forget(rank)
            spikes_before = SpikeCounts()
        for record in records:
            ledger.observe(rank, record)
        after = state.spikes.counts
        found = after.loss - spikes_before.loss + after.grad_norm - spikes_before.grad_norm
        if found > 0:
            for event in list(state.spikes.recent)[-found:]:
                if event.kind in SPIKE_REASONS:
                    ledger.flag(rank, event.step, SPIKE_REASONS[event.kind])

    def suspect_batches(self, run_id: str) -> list[dict[str, object]] | None:
        """Every flagged (step, rank) of ``run_id`` with its reasons and batch ids, sorted by
        step then rank (see ``ampscope.exporter.state.batches``); ``None`` for an unknown
        run. O(suspects log suspects) under the lock."""
        with self._lock:
            ledger = self._ledgers.get(run_id)
            if ledger is None:
                return None
            return [suspect.to_json() for suspect in ledger.suspects()]

    def batch_ids(
        self, run_id: str, pairs: Iterable[tuple[int, int]]
    ) -> dict[tuple[int, int], list[int | str]]:
        """The batch ids held for each (step, rank) of ``pairs``; unknown ones left out."""
        with self._lock:
            ledger = self._ledgers.get(run_id)
            if ledger is None:
                return {}
            found = {}
            for step, rank in pairs:
                ids = ledger.ids_at(rank, step)
                if ids is not None:
                    found[(step, rank)] = list(ids.ids)
            return found

    def _evict_history(self) -> None:
        # Oldest first across ranks, by record time: times are capped at the exporter's
        # clock plus max_clock_skew_s, so post-dating buys a rank's history that much.
        low_water = int(self.limits.history_bytes * HISTORY_LOW_WATER)
        heap = [
            (state.history[0].time, id(state), state)
            for ranks in self._runs.values()
            for state in ranks.values()
            if state.history
        ]
        heapq.heapify(heap)
        while heap and self._history_bytes > low_water:
            _, key, state = heapq.heappop(heap)
            self._history_bytes -= state.drop_oldest()
            if state.history:
                heapq.heappush(heap, (state.history[0].time, key, state))

    def heartbeat(self, beat: Heartbeat, now: float) -> bool:
        """Apply a validated heartbeat received at exporter time ``now``.

        Contract: never creates a run or rank (a rank is held from its first record on), so
        no cardinality limit applies. ``BatchRefused`` (409 ``identity_conflict``) when it
        names another node, local rank or world size than the live rank, as ``ingest``
        refuses such a record; nothing is changed then. O(1) under the lock.

        Returns:
            Whether a held rank took it (``False``: unknown rank, or a dead process's).
        """
        with self._lock:
            state = self._runs.get(beat.identity.run, {}).get(beat.identity.rank)
            if state is None or state.newest is None:
                return False
            before = state.series()
            try:
                applied = state.heartbeat(beat, now)
            except IdentityConflict as exc:
                raise BatchRefused(409, "identity_conflict", str(exc)) from None
            # A failure or a pause adds its series; never refused for the limit (one per rank).
            self._series += state.series() - before
            return applied

    def prune(
        self, now: float, retention_s: float, finished_retention_s: float | None = None
    ) -> int:
        """Drop ranks whose last report is more than ``retention_s`` before ``now``, and
        finished ranks that finished more than ``finished_retention_s`` before it (when
        given, only that applies to them), then runs left without ranks, and trim every
        rank's window samples.

        Contract: a dropped rank's series disappear from the next scrape; a rank that
        reports again later starts afresh. Cost: O(ranks) under the lock.

        Returns:
            How many ranks were dropped.
        """
        dropped = 0
        with self._lock:
            for run_id in list(self._runs):
                ranks = self._runs[run_id]
                for rank in list(ranks):
                    state = ranks[rank]
                    finished = state.finished_at
                    if finished is not None and finished_retention_s is not None:
                        expired = now - finished > finished_retention_s
                    else:
                        expired = now - state.last_report > retention_s
                    if expired:
                        if state.newest is not None:
                            self._series -= state.series()
                        self._history_bytes -= state.history_bytes
                        self._ranks -= 1
                        del ranks[rank]
                        self._boards[run_id].forget(rank)
                        dropped += 1
                    else:
                        state.trim_samples(now - self.limits.window_s)
                if not ranks:
                    del self._runs[run_id]
                    del self._boards[run_id]
                    self._ledgers.pop(run_id, None)
        return dropped

    def runs(self) -> list[str]:
        """Run ids held, sorted. O(runs log runs)."""
        with self._lock:
            return sorted(self._runs)

    def ranks(self, run_id: str) -> list[RankSnapshot] | None:
        """Snapshots of every rank of ``run_id`` sorted by rank, or ``None`` for an unknown
        run. Cost: O(ranks x (history + samples)) copying under the lock."""
        with self._lock:
            ranks = self._runs.get(run_id)
            if ranks is None:
                return None
            return [ranks[r].snapshot() for r in sorted(ranks)]

    def rank(self, run_id: str, rank: int) -> RankSnapshot | None:
        """Snapshot of one rank, or ``None`` when the run or rank is unknown. O(history)."""
        with self._lock:
            state = self._runs.get(run_id, {}).get(rank)
            return state.snapshot() if state is not None else None

    def latest(self) -> list[tuple[str, int, RankSnapshot]]:
        """Every rank's newest state, recent spikes included, without history or samples,
        for the collector and the run listing: (run, rank, snapshot) sorted. O(ranks) under
        the lock."""
        with self._lock:
            out = [
                (run_id, rank, state.snapshot(history=False))
                for run_id, ranks in self._runs.items()
                for rank, state in ranks.items()
            ]
        out.sort(key=lambda item: (item[0], item[1]))
        return out

    def history_bytes(self) -> int:
        """Bytes of history held across all ranks (``HeldRecord.nbytes``). O(1)."""
        with self._lock:
            return self._history_bytes

    def counts(self) -> tuple[int, int, int]:
        """(runs, ranks, series) held now. O(runs)."""
        with self._lock:
            return len(self._runs), sum(len(r) for r in self._runs.values()), self._series
