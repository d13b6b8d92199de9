"""``/metrics`` bytes with each rank's part rendered once per change of its state.

The :class:`~ampscope.exporter.metrics.collector.StoreCollector` rebuilds every family of every
rank on each scrape and prometheus_client formats every sample again: about 2,300 samples
at 64 ranks x 8 devices x 8 parameters, tens of milliseconds of Python per scrape. A rank's
samples change only when a batch of it is accepted, while Prometheus scrapes every 15 s
and ranks report every 0.5 s, or when it stops reporting and is scraped again and again.

:class:`Exposition` keeps, per rank, its sample lines of each family as bytes, keyed by
the state they were rendered from (the newest record object, the last report time, the
reporter's drop count, the rank's spike counts and its device). A scrape snapshots the
store (O(ranks) under its lock), re-renders only the ranks whose state changed, from the
collector's own rows (``StoreCollector.rank_rows``, so a rank that cannot be rendered is
left out and counted the same way), computes the families that depend on the current time
(``ampscope_rank_up``), the per-device families (offenders only) and the exporter's own
counters, and joins the parts in catalogue order. The output is byte for byte what
``generate_latest`` makes of the collector
(``tests/exporter/metrics/test_exposition.py`` holds them equal).
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.utils import floatToGoString

from ampscope.exporter.metrics.catalogue import CATALOGUE, RANK_LABELS, MetricSpec
from ampscope.exporter.metrics.collector import (
    TIME_DEPENDENT,
    UNRENDERABLE,
    StoreCollector,
    device_families,
)
from ampscope.exporter.state.ranks import RankSnapshot
from ampscope.exporter.state.store import Store

GZIP_LEVEL = 1
"""Level 1 compresses the exposition about 10x in a few milliseconds; level 9 (what
prometheus_client uses) takes several times longer for a few percent less."""

Values = list[tuple[tuple[str, ...], float]]
"""(values of the family's labels beyond the rank's own, sample value) pairs."""


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class _Family:
    """One catalogue family: its header and how to format one of its samples."""

    def __init__(self, spec: MetricSpec) -> None:
        self.name = spec.name
        help_text = spec.help.replace("\\", r"\\").replace("\n", r"\n")
        self.header = f"# HELP {spec.name} {help_text}\n# TYPE {spec.name} {spec.type}\n".encode()
        self.labels = spec.labels
        self.per_rank = spec.labels[: len(RANK_LABELS)] == RANK_LABELS
        extra = spec.labels[len(RANK_LABELS) :] if self.per_rank else spec.labels
        # The templates' slots take the labels beyond the rank's in sorted order (the
        # order prometheus_client writes them in); rows give them in catalogue order.
        self.slot_order = tuple(sorted(range(len(extra)), key=extra.__getitem__))

    def template(self, label_values: Sequence[str]) -> str:
        """A %-format string for this family's lines with ``label_values`` for its first
        labels: ``%s`` slots for the remaining labels' escaped values, then the value."""
        given = {
            name: _escape_label(value).replace("%", "%%")
            for name, value in zip(self.labels, label_values, strict=False)
        }
        # prometheus_client writes label pairs sorted by label name.
        pairs = ",".join(f'{name}="{given.get(name, "%s")}"' for name in sorted(self.labels))
        return f"{self.name}{{{pairs}}} %s\n" if pairs else f"{self.name} %s\n"


_FAMILIES = tuple(_Family(spec) for spec in CATALOGUE)


class _RankTemplates:
    """Per family, the line template of one rank's labels; kept while its labels are."""

    def __init__(self, labels: tuple[str, ...]) -> None:
        self.labels = labels
        self.of = {f.name: (f.template(labels), f.slot_order) for f in _FAMILIES if f.per_rank}

    def lines(self, name: str, values: Values) -> bytes:
        template, order = self.of[name]
        return "".join(
            template % (*(_escape_label(extra[i]) for i in order), floatToGoString(v))
            for extra, v in values
        ).encode()


@dataclass(frozen=True)
class _RankEntry:
    """One rank's rendered lines and the state they were rendered from."""

    newest: object
    last_report: float
    dropped_records: int
    spike_counts: tuple[int, ...]
    device: object
    templates: _RankTemplates
    lines: dict[str, bytes]

    def matches(self, snap: RankSnapshot) -> bool:
        # The spike counts too: another rank's record can make this one an origin outlier.
        return (
            self.newest is snap.newest
            and self.last_report == snap.last_report
            and self.dropped_records == snap.dropped_records
            and self.spike_counts == snap.spike_counts
            and self.device == snap.device
        )


def _render_rank(
    collector: StoreCollector, snap: RankSnapshot, now: float, previous: _RankEntry | None
) -> _RankEntry:
    """Raises: one of ``UNRENDERABLE`` (from the collector's rows)."""
    values: dict[str, Values] = {}
    labels: tuple[str, ...] = ()
    for name, row_labels, value in collector.rank_rows(snap, now):
        if name in TIME_DEPENDENT:
            continue
        labels = tuple(row_labels[: len(RANK_LABELS)])
        values.setdefault(name, []).append((tuple(row_labels[len(RANK_LABELS) :]), value))
    if previous is not None and previous.templates.labels == labels:
        templates = previous.templates
    else:
        templates = _RankTemplates(labels)
    lines = {name: templates.lines(name, v) for name, v in values.items()}
    return _RankEntry(
        snap.newest,
        snap.last_report,
        snap.dropped_records,
        snap.spike_counts,
        snap.device,
        templates,
        lines,
    )


class _Families:
    """Adapts already built families to what ``generate_latest`` reads."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


class Exposition:
    """Renders ``/metrics`` from the store, caching each rank's lines between changes.

    Thread-safe: scrapes may run concurrently (FastAPI's thread pool); the cache is
    swapped whole under a lock held only for the swap.

    Args:
        store: Where rank state lives.
        collector: The registry's collector: its rows per rank, its handling of ranks
            that cannot be rendered, and the exporter's own families.
        clock: Current Unix time (injectable for tests).
        stale_after_s: A rank with no report for this long has ``ampscope_rank_up`` 0.
    """

    def __init__(
        self,
        store: Store,
        collector: StoreCollector,
        clock: Callable[[], float],
        stale_after_s: float,
    ) -> None:
        self._store = store
        self._collector = collector
        self._clock = clock
        self._stale_after_s = stale_after_s
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, int], _RankEntry] = {}
        self._gzip_of: tuple[bytes, bytes] = (b"", gzip.compress(b"", GZIP_LEVEL))
        self.rendered_ranks = 0
        """Ranks rendered afresh so far (cache misses); for tests and benchmarks."""

    def render(self) -> bytes:
        """The text exposition of every rank and the exporter's own counters.

        Cost: O(ranks) to snapshot and join, plus rendering the ranks whose state changed
        since the previous scrape (tens of microseconds per rank with 8 devices and 8
        parameters).
        """
        now = self._clock()
        latest = self._store.latest()
        with self._lock:
            previous = self._entries
        entries: dict[tuple[str, int], _RankEntry] = {}
        ordered: list[tuple[_RankEntry, RankSnapshot]] = []
        fresh = left_out = 0
        for run, rank, snap in latest:
            entry = previous.get((run, rank))
            if entry is None or not entry.matches(snap):
                try:
                    entry = _render_rank(self._collector, snap, now, entry)
                except UNRENDERABLE as exc:
                    left_out += 1
                    self._collector.note_unrenderable(run, rank, exc)
                    continue
                fresh += 1
            entries[(run, rank)] = entry
            ordered.append((entry, snap))
        with self._lock:
            self._entries = entries
            self.rendered_ranks += fresh
        # The clock-driven families of every rank, computed on every scrape.
        timed = {id(entry): self._collector.time_rows(snap, now) for entry, snap in ordered}
        parts: list[bytes] = []
        for family in _FAMILIES:
            if not family.per_rank:
                continue
            parts.append(family.header)
            if family.name in TIME_DEPENDENT:
                parts.extend(
                    entry.templates.lines(
                        family.name,
                        [
                            (tuple(labels[len(RANK_LABELS) :]), value)
                            for name, labels, value in timed[id(entry)]
                            if name == family.name
                        ],
                    )
                    for entry, _ in ordered
                )
            else:
                parts.extend(entry.lines.get(family.name, b"") for entry, _ in ordered)
        # The catalogue lists the per-device families (few: offenders only, built afresh)
        # and then the exporter's own after the per-rank ones.
        parts.append(generate_latest(_Families(device_families(snap for _, snap in ordered))))
        parts.append(generate_latest(_Families(self._collector.self_metrics(left_out))))
        return b"".join(parts)

    def render_gzip(self) -> tuple[bytes, bytes]:
        """``(body, gzip of body)``; the compression is reused while the body is unchanged."""
        body = self.render()
        with self._lock:
            cached_body, cached_gzip = self._gzip_of
        if cached_body == body:
            return body, cached_gzip
        compressed = gzip.compress(body, GZIP_LEVEL)
        with self._lock:
            self._gzip_of = (body, compressed)
        return body, compressed
