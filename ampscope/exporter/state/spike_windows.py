"""The exporter's spike bookkeeping: each rank's spike windows and the run's origin board.

``RankSpikes`` feeds one rank's reported ``loss`` and ``grad_norm`` into the one spike rule
(``ampscope.reporter.spike_rule``) in step order, and keeps the spikes it found (bounded) with
their counts, which ``ampscope_spikes_total`` exposes and the health rules read.

``OriginBoard`` compares the ``grad_norm_origin`` of the ranks one exporter holds at equal
steps: a ring of the run's most recent steps, each with the norm of every rank that
reported it. Only ranks of one origin group (the replicas of a data-parallel group, which
hold the same parameters; ``Setup.origin_group``) are compared: a pipeline stage's norm
covers other parameters than the next stage's. Ranks that name no group (reporters that
predate it) are compared with each other, as one group. A rank whose own gradients stand
``factor`` times above the median of the other ranks of its group at that step is an
origin outlier. The comparison is made again whenever another rank's record of the step
arrives (ranks report at their own pace), and each (rank, step) counts once. One exporter
sees one node's ranks: across nodes, nothing compares origin norms step by step
(docs/exporter.md, "Spikes").

Not thread-safe: the store calls everything under its lock. Every method is O(1) or
O(ranks at one step x log of it) unless noted.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Literal, NamedTuple

from ampscope.reporter.schema import OriginGroup, StepRecord
from ampscope.reporter.spike_rule import SpikeRule, SpikeWindow

SpikeKindName = Literal["loss", "grad_norm", "origin_outlier"]
SPIKE_KINDS: tuple[SpikeKindName, ...] = ("loss", "grad_norm", "origin_outlier")
"""The ``kind`` label values of ``ampscope_spikes_total``."""

MAX_RECENT_SPIKES = 32
"""Spikes each rank keeps (newest last) for the verdicts and the web view."""

ORIGIN_STEPS = 256
"""Steps of a run the origin board holds at once: ranks that lag each other by more than
this many steps are not compared."""

MAX_TOP_PARAMS = 8
"""Top parameters kept with a spike (the record may carry up to 64)."""


@dataclass(frozen=True, kw_only=True)
class SpikeEvent:
    """One spike iteration of one rank, as the exporter judged it."""

    kind: SpikeKindName
    step: int
    value: float
    """The loss, the gradient norm, or (origin outlier) the rank's own gradient norm."""
    mean: float | None
    """Mean of the rank's preceding window; ``None`` for an origin outlier."""
    stdev: float | None
    """Its population standard deviation; ``None`` for an origin outlier."""
    median: float
    """Median of the preceding window, or (origin outlier) of the other ranks at the step."""
    time: float
    """The rank's wall-clock time of the step."""
    received: float
    """Exporter clock when the spike was found: what the verdict's window counts from."""
    compared: int | None = None
    """Origin outlier: the other ranks it was compared with."""
    top_params: tuple[tuple[str, float], ...] = ()
    """The rank's top parameters by gradient norm at that step (name, norm), largest first,
    when the rank recorded them (its own rule judged the step a spike too)."""


class SpikeCounts(NamedTuple):
    """Spike iterations of one rank since the exporter first heard its current process."""

    loss: int = 0
    grad_norm: int = 0
    origin_outlier: int = 0


def top_params(record: StepRecord) -> tuple[tuple[str, float], ...]:
    """The record's top parameters by gradient norm (name, norm), at most ``MAX_TOP_PARAMS``."""
    stats = record.stats
    if stats is None:
        return ()
    return tuple((p.name, p.norm) for p in stats.top_params[:MAX_TOP_PARAMS])


class RankSpikes:
    """One rank's spike windows, counts and recent spikes.

    Args:
        rule: The spike rule (thresholds) both windows apply.
    """

    def __init__(self, rule: SpikeRule) -> None:
        self._rule = rule
        self._loss = SpikeWindow(rule)
        self._grad_norm = SpikeWindow(rule)
        self.counts = SpikeCounts()
        self.recent: deque[SpikeEvent] = deque(maxlen=MAX_RECENT_SPIKES)

    def reset(self) -> None:
        """Forget everything: the rank's process restarted (counters start from zero, as
        Prometheus expects of a new process)."""
        self._loss = SpikeWindow(self._rule)
        self._grad_norm = SpikeWindow(self._rule)
        self.counts = SpikeCounts()
        self.recent.clear()

    def observe(self, record: StepRecord, received: float) -> None:
        """Judge a record that advanced the rank's newest step (so calls come in step
        order). Records without stats, and overflow iterations, change nothing.
        O(window) per value, as ``SpikeWindow.observe``."""
        stats = record.stats
        if stats is None:
            return
        for kind, window, value in (
            ("loss", self._loss, stats.loss),
            ("grad_norm", self._grad_norm, stats.grad_norm),
        ):
            spike = window.observe(value)
            if spike is None:
                continue
            self.add(
                SpikeEvent(
                    kind=kind,  # type: ignore[arg-type]
                    step=record.step,
                    value=spike.value,
                    mean=spike.mean,
                    stdev=spike.stdev,
                    median=spike.median,
                    time=record.time,
                    received=received,
                    top_params=top_params(record),
                )
            )

    def add(self, event: SpikeEvent) -> None:
        """Count ``event`` and keep it among the recent spikes."""
        self.counts = self.counts._replace(**{event.kind: getattr(self.counts, event.kind) + 1})
        self.recent.append(event)


def _median_without(ordered: list[float], index: int) -> float:
    """Median of ``ordered`` (ascending, at least 2 values) without its ``index``-th. O(1)."""
    size = len(ordered) - 1

    def at(k: int) -> float:
        return ordered[k] if k < index else ordered[k + 1]

    return (at((size - 1) // 2) + at(size // 2)) / 2


@dataclass(frozen=True)
class Outlier:
    """A rank whose own gradient norm stood out at a step."""

    rank: int
    step: int
    value: float
    median: float
    """Median of the other ranks' norms at the step."""
    compared: int
    """How many other ranks."""


class OriginBoard:
    """The ``grad_norm_origin`` of a run's ranks at its most recent steps, by origin group.

    Args:
        factor: An outlier's norm is at least this many times the median of the others.
        steps: Most recent steps held (``ORIGIN_STEPS``); older ones are dropped.
    """

    def __init__(self, factor: float, steps: int = ORIGIN_STEPS) -> None:
        self._factor = factor
        self._capacity = steps
        # step -> origin group (None: ranks that name none) -> rank -> norm
        self._norms: dict[int, dict[OriginGroup | None, dict[int, float]]] = {}
        self._flagged: dict[int, set[int]] = {}
        self._order: list[int] = []  # a min-heap of the held steps
        # origin group -> rank -> the first step it reported here: the group's members this
        # exporter holds (a group spread over nodes has only some of them on this one).
        self._members: dict[OriginGroup, dict[int, int]] = {}

    def observe(
        self,
        rank: int,
        step: int,
        norm: float | None,
        ranks: int = 2,
        group: OriginGroup | None = None,
    ) -> list[Outlier]:
        """Add ``rank``'s norm at ``step`` and compare it with its group's at that step.

        Args:
            rank: The rank reporting.
            step: Its step.
            norm: Its ``grad_norm_origin`` (``None``: an overflow, or no origin tracking).
            ranks: Ranks that can report the step here (the node's, else the world size): a
                step is judged once ``min(3, ranks)`` of them reported it, so that with
                three or more ranks one unusually low rank cannot make a normal one look
                like an outlier.
            group: The rank's origin group (``Setup.origin_group``); ``None``: it names
                none, and is compared with the other ranks that name none. With a group,
                ``ranks`` is further bounded by the group's size and by its members this
                exporter heard at earlier steps (a group spread over nodes has only some of
                them here): a group of one, or with one member here, is never compared;
                with two, a step is judged once both reported; a group's first step here is
                not judged (its members are not known yet).

        Returns:
            The ranks of the group newly found outliers at ``step`` (each (rank, step)
            once). O(ranks at the step x log of it).
        """
        if norm is None:
            return []
        if group is not None:
            members = self._members.setdefault(group, {})
            first = members.setdefault(rank, step)
            if first > step:
                members[rank] = step  # a late record of an earlier step
            # Judged against the members known before this step; a norm is kept either way,
            # for the members that report the step later.
            ranks = min(ranks, group.size, sum(1 for seen in members.values() if seen < step))
        by_group = self._norms.get(step)
        if by_group is None:
            if len(self._order) >= self._capacity:
                if step < self._order[0]:
                    return []  # older than every step held: its peers are gone
                oldest = heapq.heappop(self._order)
                del self._norms[oldest]
                self._flagged.pop(oldest, None)
            by_group = self._norms[step] = {}
            heapq.heappush(self._order, step)
        for other_group, held in by_group.items():
            if other_group != group:
                held.pop(rank, None)  # the rank restarted into another group
        at = by_group.setdefault(group, {})
        at[rank] = norm
        if ranks < 2 or len(at) < min(3, ranks):
            return []  # no peer known here yet, or not enough of them reported the step
        flagged = self._flagged.setdefault(step, set())
        ordered = sorted(at.values())
        found = []
        for other_rank, value in at.items():
            if other_rank in flagged:
                continue
            median = _median_without(ordered, ordered.index(value))
            if median > 0 and value >= self._factor * median:
                flagged.add(other_rank)
                found.append(Outlier(other_rank, step, value, median, len(at) - 1))
        return found

    def forget(self, rank: int) -> None:
        """Drop ``rank``'s norms (it restarted or was pruned), and the steps no rank holds
        any more: a job resumed from an older checkpoint reports steps below them, which a
        full board of empty steps would refuse. O(steps held)."""
        for step, by_group in list(self._norms.items()):
            for group, at in list(by_group.items()):
                at.pop(rank, None)
                if not at:
                    del by_group[group]
            if not by_group:
                del self._norms[step]
                self._flagged.pop(step, None)
        for flagged in self._flagged.values():
            flagged.discard(rank)
        for members in self._members.values():
            members.pop(rank, None)
        if len(self._order) != len(self._norms):
            self._order = list(self._norms)
            heapq.heapify(self._order)
