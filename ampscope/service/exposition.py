"""``/metrics`` bytes with each rank's part rendered once per change of its state.

The :class:`~ampscope.service.collector.StoreCollector` rebuilds every family of every
rank on each scrape and prometheus_client formats every sample again: about 2,300 samples
at 64 ranks x 8 devices x 8 parameters, tens of milliseconds of Python per scrape. A rank's
samples change only when a batch of it is accepted, while Prometheus scrapes every 15 s
and ranks report every 0.5 s, or when it stops reporting and is scraped again and again.

:class:`Exposition` keeps, per rank, its sample lines of each family as bytes, keyed by
the state they were rendered from (the newest record object, the last report time and
the reporter's drop count). A scrape snapshots the store (O(ranks) under its lock),
re-renders only the ranks whose state changed, computes the families that depend on the
current time (``ampscope_rank_up``) and the exporter's own counters, and joins the parts
in catalogue order. The output is byte for byte what ``generate_latest`` makes of the
collector (``tests/service/test_exposition.py`` holds them equal), so the collector stays
the reference and the registry path for anyone who reads it directly.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prometheus_client.utils import floatToGoString

from ampscope.service.catalogue import CATALOGUE, RANK_LABELS, MetricSpec
from ampscope.service.ranks import RankSnapshot
from ampscope.service.stats import IngestStats
from ampscope.service.store import Store

GZIP_LEVEL = 1
"""Level 1 compresses the exposition about 10x in a few milliseconds; level 9 (what
prometheus_client uses) takes several times longer for a few percent less."""

Values = list[tuple[tuple[str, ...], float]]
"""(values of the family's labels beyond the rank's own, sample value) pairs."""


def _rank_values(snap: RankSnapshot) -> dict[str, Values]:
    """Every per-rank family's samples that depend only on the rank's state."""
    record = snap.newest
    totals = record.totals
    aligned = totals.aligned_scale
    return {
        "ampscope_loss_scale": [((), record.scale_after)],
        "ampscope_growth_tracker": [((), record.growth_tracker)],
        "ampscope_last_step": [((), record.step)],
        "ampscope_loss_scale_aligned": [] if aligned is None else [((), aligned.scale)],
        "ampscope_loss_scale_aligned_step": [] if aligned is None else [((), aligned.step)],
        "ampscope_last_report_timestamp_seconds": [((), snap.last_report)],
        "ampscope_steps_total": [((), totals.steps)],
        "ampscope_skipped_steps_total": [((), totals.skipped_steps)],
        "ampscope_scale_backoffs_total": [((), totals.backoffs)],
        "ampscope_scale_growths_total": [((), totals.growths)],
        "ampscope_found_inf_total": [((d,), c) for d, c in totals.found_inf_local.items()],
        "ampscope_found_inf_origin_total": [((d,), c) for d, c in totals.found_inf_origin.items()],
        "ampscope_nonfinite_grads_total": [((p.name,), p.count) for p in totals.nonfinite_params],
        "ampscope_reporter_dropped_records_total": [((), snap.dropped_records)],
    }


TimeValues = Callable[[RankSnapshot, float, float], Values]

_TIME_DEPENDENT: dict[str, TimeValues] = {
    "ampscope_rank_up": lambda snap, now, stale_after_s: [
        ((), float(snap.reported_within(now, stale_after_s)))
    ],
}
"""Per-rank families whose value moves with the clock alone: computed on every scrape."""


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
        # The templates fill the labels after the rank's own in sorted order; with one
        # such label at most (device, param, reason) that is the catalogue's order too.
        if len(spec.labels) - (len(RANK_LABELS) if self.per_rank else 0) > 1:
            raise ValueError(f"{spec.name}: more than one label beyond the rank's")

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

    def line(self, label_values: Sequence[str], value: float) -> str:
        return self.template(label_values) % floatToGoString(value)


_FAMILIES = tuple(_Family(spec) for spec in CATALOGUE)
_BY_NAME = {family.name: family for family in _FAMILIES}


class _RankTemplates:
    """Per family, the line template of one rank's labels; kept while its labels are."""

    def __init__(self, labels: tuple[str, ...]) -> None:
        self.labels = labels
        self.of = {f.name: f.template(labels) for f in _FAMILIES if f.per_rank}

    def lines(self, name: str, values: Values) -> bytes:
        template = self.of[name]
        return "".join(
            template % (*map(_escape_label, extra), floatToGoString(v)) for extra, v in values
        ).encode()


@dataclass(frozen=True)
class _RankEntry:
    """One rank's rendered lines and the state they were rendered from."""

    newest: object
    last_report: float
    dropped_records: int
    templates: _RankTemplates
    lines: dict[str, bytes]

    def matches(self, snap: RankSnapshot) -> bool:
        return (
            self.newest is snap.newest
            and self.last_report == snap.last_report
            and self.dropped_records == snap.dropped_records
        )


def _render_rank(snap: RankSnapshot, previous: _RankEntry | None) -> _RankEntry:
    who = snap.newest.identity
    labels = (who.run, who.node, str(who.rank), str(who.local_rank))
    if previous is not None and previous.templates.labels == labels:
        templates = previous.templates
    else:
        templates = _RankTemplates(labels)
    lines = {name: templates.lines(name, values) for name, values in _rank_values(snap).items()}
    return _RankEntry(snap.newest, snap.last_report, snap.dropped_records, templates, lines)


class Exposition:
    """Renders ``/metrics`` from the store, caching each rank's lines between changes.

    Thread-safe: scrapes may run concurrently (FastAPI's thread pool); the cache is
    swapped whole under a lock held only for the swap.

    Args:
        store: Where rank state lives.
        stats: The ingest self-metrics.
        clock: Current Unix time (injectable for tests).
        stale_after_s: A rank with no report for this long has ``ampscope_rank_up`` 0.
    """

    def __init__(
        self,
        store: Store,
        stats: IngestStats,
        clock: Callable[[], float],
        stale_after_s: float,
    ) -> None:
        self._store = store
        self._stats = stats
        self._clock = clock
        self._stale_after_s = stale_after_s
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, int], _RankEntry] = {}
        self._gzip_of: tuple[bytes, bytes] = (b"", gzip.compress(b"", GZIP_LEVEL))
        self.rendered_ranks = 0
        """Ranks rendered afresh so far (cache misses); for tests and benchmarks."""

    def render(self) -> bytes:
        """The text exposition (format 0.0.4) of every rank and the exporter's counters.

        Cost: O(ranks) to snapshot and join, plus rendering the ranks whose state changed
        since the previous scrape (~0.1 ms per rank with 8 devices and 8 parameters).
        """
        now = self._clock()
        latest = self._store.latest()
        with self._lock:
            previous = self._entries
        entries: dict[tuple[str, int], _RankEntry] = {}
        fresh = 0
        for run, rank, snap in latest:
            entry = previous.get((run, rank))
            if entry is None or not entry.matches(snap):
                entry = _render_rank(snap, entry)
                fresh += 1
            entries[(run, rank)] = entry
        with self._lock:
            self._entries = entries
            self.rendered_ranks += fresh
        ordered = [(entries[(run, rank)], snap) for run, rank, snap in latest]
        parts: list[bytes] = []
        own = self._self_metrics()
        for family in _FAMILIES:
            parts.append(family.header)
            time_values = _TIME_DEPENDENT.get(family.name)
            if time_values is not None:
                parts.extend(
                    entry.templates.lines(family.name, time_values(snap, now, self._stale_after_s))
                    for entry, snap in ordered
                )
            elif family.per_rank:
                parts.extend(entry.lines[family.name] for entry, _ in ordered)
            else:
                parts.extend(
                    family.line(labels, value).encode()
                    for labels, value in own.get(family.name, ())
                )
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

    def _self_metrics(self) -> dict[str, Iterable[tuple[tuple[str, ...], float]]]:
        runs, ranks, series = self._store.counts()
        return {
            "ampscope_exporter_ingest_batches_total": [((), self._stats.batches)],
            "ampscope_exporter_ingest_records_total": [((), self._stats.records)],
            "ampscope_exporter_ingest_rejections_total": [
                ((reason,), count) for reason, count in self._stats.rejections().items()
            ],
            "ampscope_exporter_tracked_runs": [((), runs)],
            "ampscope_exporter_tracked_ranks": [((), ranks)],
            "ampscope_exporter_tracked_series": [((), series)],
        }
