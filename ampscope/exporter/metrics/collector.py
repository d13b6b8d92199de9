"""The Prometheus collector: fresh metric families from the store on every scrape.

Registered on a per-app ``CollectorRegistry`` (never the global one). Names, types,
help texts and label names all come from the catalogue. Cost per scrape: O(series)
with the store's lock held only for an O(ranks) snapshot.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import fields

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ampscope.exporter.metrics.catalogue import BY_NAME, CATALOGUE, RANK_LABELS
from ampscope.exporter.state.fp8_series import exported
from ampscope.exporter.state.ingest_counters import IngestStats
from ampscope.exporter.state.lifecycle import Lifecycle
from ampscope.exporter.state.ranks import RankSnapshot
from ampscope.exporter.state.spike_windows import SPIKE_KINDS
from ampscope.exporter.state.store import Store
from ampscope.reporter.fault_rule import DEVICE_FAULT_KINDS, FAULT_KINDS
from ampscope.verdicts import aligned
from ampscope.verdicts.ranks import LIVE_STATES, STATES, is_scaler
from ampscope.verdicts.thresholds import Thresholds

log = logging.getLogger(__name__)

MAX_LOGGED_RANKS = 1024
"""Unrenderable ranks remembered so each is logged once; beyond this, no more logs."""

Row = tuple[str, list[str], float]
"""(family name, label values, value) of one sample."""

UNRENDERABLE = (ArithmeticError, ValueError, TypeError)
"""What ``rank_rows`` raises for a rank whose data cannot be rendered."""

TIME_DEPENDENT = frozenset(
    {
        "ampscope_rank_up",
        "ampscope_rank_state",
        "ampscope_rank_pause_start_timestamp_seconds",
        "ampscope_rank_failure_info",
    }
)
"""Per-rank families whose values move with the clock or a heartbeat alone (``time_rows``)."""


def _family(name: str) -> GaugeMetricFamily | CounterMetricFamily:
    spec = BY_NAME[name]
    if spec.type == "counter":
        # CounterMetricFamily wants the name without the _total suffix it adds back.
        return CounterMetricFamily(spec.name.removesuffix("_total"), spec.help, labels=spec.labels)
    return GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)


_RANK_FAMILIES = tuple(
    spec.name for spec in CATALOGUE if spec.labels[: len(RANK_LABELS)] == RANK_LABELS
)
"""Per-rank families, in the order they are served."""


def device_labels(snap: RankSnapshot) -> tuple[str, str, str]:
    """(device, pci_bus_id, hostname) of a rank: what its process said, else
    ``<node>:<local_rank>`` and empty strings (a reporter that predates the field)."""
    device = snap.device
    if device is None:
        who = snap.identity
        return f"{who.node}:{who.local_rank}", "", ""
    return device.device, device.pci_bus_id or "", device.hostname


def device_families(snaps: Iterable[RankSnapshot]) -> list[Metric]:
    """``ampscope_device_offences_total`` and ``ampscope_device_last_offence_timestamp_seconds``
    of the ranks ``snaps``: only devices that offended, the ranks of a run that share a
    device summed (their newest offence for the time). Kinds as ``OFFENCE_KINDS``; origin
    detections of steps whose rerun reproduced the result are the data's, not counted, and
    an origin outlier is none (``ampscope_spikes_total`` counts it). O(ranks)."""
    counts: dict[tuple[str, str, str, str], int] = {}
    newest: dict[tuple[str, str, str], float] = {}
    for snap in snaps:
        who = snap.identity
        key = (who.run, device_labels(snap)[0], who.node)
        # A reproduced rerun said the data did it: its origin detections are not the device's.
        faults = snap.newest.totals.faults
        if faults is None:  # a reporter that predates the fault rule
            origins = sum(snap.newest.totals.found_inf_origin.values()) - snap.rerun_data_origins
        else:  # the rank's own faults, before a rerun told the device from the data
            origins = sum(n for kind, n in faults.items() if kind in DEVICE_FAULT_KINDS)
        offences: tuple[tuple[str, int], ...] = (
            ("nonfinite_origin", max(0, origins)),
            ("transient_fault", snap.rerun_counts.transient),
            ("replica_divergence", snap.replica_offences),
        )
        for kind, count in offences:
            if count:
                labels = (*key, kind)
                counts[labels] = counts.get(labels, 0) + count
        if snap.last_offence is not None:
            newest[key] = max(newest.get(key, snap.last_offence), snap.last_offence)
    offences_family = _family("ampscope_device_offences_total")
    for offence, count in counts.items():
        offences_family.add_metric(list(offence), float(count))
    last = _family("ampscope_device_last_offence_timestamp_seconds")
    for device, when in newest.items():
        last.add_metric(list(device), when)
    return [offences_family, last]


class StoreCollector(Collector):
    """Exposes every rank's newest state and the exporter's ingest counters.

    Args:
        store: Where rank state lives.
        stats: The ingest self-metrics.
        clock: Current Unix time (injectable for tests).
        thresholds: The health rules' thresholds: their stale and stall clocks decide
            ``ampscope_rank_up`` and ``ampscope_rank_state``, and every one is published
            (``ampscope_exporter_health_threshold``).
    """

    def __init__(
        self,
        store: Store,
        stats: IngestStats,
        clock: Callable[[], float],
        thresholds: Thresholds,
    ) -> None:
        self._store = store
        # An FP8 layer with a spike or non-finite amax this recent is exported first.
        self._fp8_window_s = thresholds.spike_verdict_window_s
        self._stats = stats
        self._clock = clock
        self._stale_after_s = thresholds.stale_after_s
        self._lifecycle = Lifecycle.of(thresholds)
        self._thresholds = [
            (f.name, float(getattr(thresholds, f.name))) for f in fields(thresholds)
        ]
        self._logged: set[tuple[str, int]] = set()

    def collect(self) -> Iterator[Metric]:
        now = self._clock()
        families = {name: _family(name) for name in _RANK_FAMILIES}
        skipped = 0
        rendered: list[RankSnapshot] = []
        for run, rank, snap in self._store.latest():
            # Every value is made a float before any is added, so a rank whose data cannot
            # be rendered (schema bounds make that a bug, not an input) is left out whole
            # instead of failing the scrape for every other rank.
            try:
                rows = self.rank_rows(snap, now)
            except UNRENDERABLE as exc:
                skipped += 1
                self.note_unrenderable(run, rank, exc)
                continue
            for name, labels, value in rows:
                families[name].add_metric(labels, value)
            rendered.append(snap)
        yield from families.values()
        yield from device_families(rendered)
        yield from self.self_metrics(unrenderable=skipped)

    def time_rows(self, snap: RankSnapshot, now: float) -> list[Row]:
        """The samples of one rank's ``TIME_DEPENDENT`` families at time ``now``."""
        who = snap.newest.identity
        labels = [who.run, who.node, str(who.rank), str(who.local_rank)]
        up = snap.reported_within(now, self._stale_after_s)
        current = self._lifecycle.state(snap, now)
        # Prometheus' enum convention: every state, 1 for the current one.
        rows: list[Row] = [
            ("ampscope_rank_up", labels, float(up)),
            *(("ampscope_rank_state", [*labels, name], float(name == current)) for name in STATES),
        ]
        # A heartbeat alone starts or ends a pause, so it is rendered with the state.
        pause = self._lifecycle.pause_of(snap) if current in LIVE_STATES else None
        if pause is not None:
            rows.append(
                (
                    "ampscope_rank_pause_start_timestamp_seconds",
                    [*labels, pause.reason],
                    pause.since,
                )
            )
        failure = snap.failure
        if current == "failed" and failure is not None:
            origin = (
                "unknown"
                if failure.origin_ranks is None
                else "yes"
                if who.rank in failure.origin_ranks
                else "no"
            )
            info = [*labels, failure.exception, failure.kind, origin]
            rows.append(("ampscope_rank_failure_info", info, 1.0))
        return rows

    def rank_rows(self, snap: RankSnapshot, now: float) -> list[Row]:
        """Every sample of one rank at time ``now``, ``time_rows`` included. Raises one of
        ``UNRENDERABLE`` for a rank whose data cannot be rendered; the exposition cache
        (``ampscope.exporter.metrics.exposition``) builds on this too."""
        record = snap.newest
        who = record.identity
        labels = [who.run, who.node, str(who.rank), str(who.local_rank)]
        totals = record.totals
        setup = record.setup
        # A watch rank has no loss scale: its records carry 1.0 and zero counts, which are
        # not data, so none of the scale families is exposed for it.
        scaler = is_scaler(setup.mode)
        rows: list[Row] = [
            (
                "ampscope_rank_info",
                [
                    *labels,
                    setup.mode,
                    setup.policy,
                    setup.grad_dtype or "unknown",
                    str(who.world_size),
                    who.job_id or "",
                    *device_labels(snap),
                ],
                1.0,
            )
        ]
        if scaler:
            rows.append(("ampscope_loss_scale", labels, float(record.scale_after)))
            rows.append(("ampscope_growth_tracker", labels, float(record.growth_tracker)))
        rows.append(("ampscope_last_step", labels, float(record.step)))
        stats = record.stats
        if stats is not None:
            for name, value in (
                ("ampscope_loss", stats.loss),
                ("ampscope_grad_norm", stats.grad_norm),
                ("ampscope_grad_norm_origin", stats.grad_norm_origin),
            ):
                if value is not None:
                    rows.append((name, labels, float(value)))
        if scaler and totals.aligned_scale is not None:
            rows.append(("ampscope_loss_scale_aligned", labels, float(totals.aligned_scale.scale)))
            rows.append(
                ("ampscope_loss_scale_aligned_step", labels, float(totals.aligned_scale.step))
            )
            rows.append(
                (
                    "ampscope_loss_scale_aligned_packed",
                    labels,
                    aligned.pack(totals.aligned_scale.step, float(totals.aligned_scale.scale)),
                )
            )
        if scaler and totals.clean_scale is not None:
            rows.append(("ampscope_loss_scale_clean", labels, float(totals.clean_scale)))
        rows.append(("ampscope_last_report_timestamp_seconds", labels, float(snap.last_report)))
        rows += self.time_rows(snap, now)
        rows += [
            ("ampscope_steps_total", labels, float(totals.steps)),
            ("ampscope_skipped_steps_total", labels, float(totals.skipped_steps)),
        ]
        if scaler:
            rows.append(("ampscope_scale_backoffs_total", labels, float(totals.backoffs)))
            rows.append(("ampscope_scale_growths_total", labels, float(totals.growths)))
        for device, count in totals.found_inf_local.items():
            rows.append(("ampscope_found_inf_total", [*labels, device], float(count)))
        for device, count in totals.found_inf_origin.items():
            rows.append(("ampscope_found_inf_origin_total", [*labels, device], float(count)))
        if (weather := totals.weather) is not None:
            # Every device of the full counters, 0 or not: PromQL subtracts one from the
            # other label set for label set.
            rows.append(
                ("ampscope_weather_skipped_steps_total", labels, float(weather.skipped_steps))
            )
            for device in totals.found_inf_local:
                count = weather.found_inf_local.get(device, 0)
                rows.append(("ampscope_weather_found_inf_total", [*labels, device], float(count)))
            for device in totals.found_inf_origin:
                count = weather.found_inf_origin.get(device, 0)
                rows.append(
                    ("ampscope_weather_found_inf_origin_total", [*labels, device], float(count))
                )
        for param in totals.nonfinite_params:
            rows.append(
                ("ampscope_nonfinite_grads_total", [*labels, param.name], float(param.count))
            )
        rows.append(
            ("ampscope_nonfinite_updates_applied_total", labels, float(totals.nonfinite_applied))
        )
        if totals.faults is not None:
            for fault in FAULT_KINDS:
                rows.append(
                    ("ampscope_faults_total", [*labels, fault], float(totals.faults.get(fault, 0)))
                )
        if stats is not None:
            counts = snap.spike_counts
            for kind in SPIKE_KINDS:
                rows.append(
                    ("ampscope_spikes_total", [*labels, kind], float(getattr(counts, kind)))
                )
        for result, count in snap.rerun_counts._asdict().items():
            if count:  # none in a healthy fleet: no series (docs/deployment.md, Sizing)
                rows.append(("ampscope_reruns_total", [*labels, result], float(count)))
        for result, count in snap.replica_counts._asdict().items():
            if count:  # ranks that check expose agree; diverged once one diverged
                rows.append(("ampscope_replica_checks_total", [*labels, result], float(count)))
        if snap.fp8:
            chosen = exported(snap.fp8, self._store.fp8_rule.max_layers, now, self._fp8_window_s)
            for series in chosen:
                entry = series.entry
                at = [*labels, series.layer, series.tensor]
                amax = math.nan if entry.amax is None else float(entry.amax)
                rows.append(("ampscope_fp8_amax", at, amax))
                rows.append(("ampscope_fp8_underflow_ratio", at, float(entry.underflow_ratio)))
                scale = entry.scale_min if entry.rowwise else entry.scale
                if scale is not None:
                    rows.append(("ampscope_fp8_scale", at, float(scale)))
            # Every series that counted one, chosen or not: the count is what the alerts read
            # (VictoriaMetrics drops the gauge's NaN on ingest), and there are few.
            for series in snap.fp8:
                if series.nonfinite_count:
                    rows.append(
                        (
                            "ampscope_fp8_nonfinite_amax_total",
                            [*labels, series.layer, series.tensor],
                            float(series.nonfinite_count),
                        )
                    )
        rows.append(
            ("ampscope_reporter_dropped_records_total", labels, float(snap.dropped_records))
        )
        return rows

    def note_unrenderable(self, run: str, rank: int, exc: Exception) -> None:
        """Log a rank left out of a scrape, once per rank."""
        key = (run, rank)
        if key in self._logged or len(self._logged) >= MAX_LOGGED_RANKS:
            return
        self._logged.add(key)
        log.error(
            "rank %d of run %r left out of /metrics: its data cannot be rendered (%s: %s)",
            rank,
            run,
            type(exc).__name__,
            exc,
        )

    def self_metrics(self, unrenderable: int) -> Iterator[Metric]:
        """The exporter's own families; ``unrenderable``: ranks this scrape left out."""
        batches = _family("ampscope_exporter_ingest_batches_total")
        batches.add_metric([], self._stats.batches)
        records = _family("ampscope_exporter_ingest_records_total")
        records.add_metric([], self._stats.records)
        rejections = _family("ampscope_exporter_ingest_rejections_total")
        for reason, count in self._stats.rejections().items():
            rejections.add_metric([reason], count)
        runs, ranks, series = self._store.counts()
        tracked_runs = _family("ampscope_exporter_tracked_runs")
        tracked_runs.add_metric([], runs)
        tracked_ranks = _family("ampscope_exporter_tracked_ranks")
        tracked_ranks.add_metric([], ranks)
        tracked_series = _family("ampscope_exporter_tracked_series")
        tracked_series.add_metric([], series)
        thresholds = _family("ampscope_exporter_health_threshold")
        for name, value in self._thresholds:
            thresholds.add_metric([name], value)
        left_out = _family("ampscope_exporter_unrenderable_ranks")
        left_out.add_metric([], unrenderable)
        yield from (batches, records, rejections, tracked_runs, tracked_ranks, tracked_series)
        yield from (thresholds, left_out)
