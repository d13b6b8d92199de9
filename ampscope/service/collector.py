"""The Prometheus collector: fresh metric families from the store on every scrape.

Registered on a per-app ``CollectorRegistry`` (never the global one). Names, types,
help texts and label names all come from the catalogue. Cost per scrape: O(series)
with the store's lock held only for an O(ranks) snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ampscope.service.catalogue import BY_NAME
from ampscope.service.stats import IngestStats
from ampscope.service.store import Store


def _family(name: str) -> GaugeMetricFamily | CounterMetricFamily:
    spec = BY_NAME[name]
    if spec.type == "counter":
        # CounterMetricFamily wants the name without the _total suffix it adds back.
        return CounterMetricFamily(spec.name.removesuffix("_total"), spec.help, labels=spec.labels)
    return GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)


class StoreCollector(Collector):
    """Exposes every rank's newest state and the exporter's ingest counters.

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

    def collect(self) -> Iterator[Metric]:
        now = self._clock()
        ranks = self._store.latest()
        scale = _family("ampscope_loss_scale")
        tracker = _family("ampscope_growth_tracker")
        last_step = _family("ampscope_last_step")
        aligned = _family("ampscope_loss_scale_aligned")
        aligned_step = _family("ampscope_loss_scale_aligned_step")
        last_report = _family("ampscope_last_report_timestamp_seconds")
        up = _family("ampscope_rank_up")
        steps = _family("ampscope_steps_total")
        skipped = _family("ampscope_skipped_steps_total")
        backoffs = _family("ampscope_scale_backoffs_total")
        growths = _family("ampscope_scale_growths_total")
        found_inf = _family("ampscope_found_inf_total")
        found_inf_origin = _family("ampscope_found_inf_origin_total")
        nonfinite = _family("ampscope_nonfinite_grads_total")
        dropped = _family("ampscope_reporter_dropped_records_total")
        for _, _, snap in ranks:
            record = snap.newest
            who = record.identity
            labels = [who.run, who.node, str(who.rank), str(who.local_rank)]
            totals = record.totals
            scale.add_metric(labels, record.scale_after)
            tracker.add_metric(labels, record.growth_tracker)
            last_step.add_metric(labels, record.step)
            if totals.aligned_scale is not None:
                aligned.add_metric(labels, totals.aligned_scale.scale)
                aligned_step.add_metric(labels, totals.aligned_scale.step)
            last_report.add_metric(labels, snap.last_report)
            up.add_metric(labels, float(snap.reported_within(now, self._stale_after_s)))
            steps.add_metric(labels, totals.steps)
            skipped.add_metric(labels, totals.skipped_steps)
            backoffs.add_metric(labels, totals.backoffs)
            growths.add_metric(labels, totals.growths)
            dropped.add_metric(labels, snap.dropped_records)
            for device, count in totals.found_inf_local.items():
                found_inf.add_metric([*labels, device], count)
            for device, count in totals.found_inf_origin.items():
                found_inf_origin.add_metric([*labels, device], count)
            for param in totals.nonfinite_params:
                nonfinite.add_metric([*labels, param.name], param.count)
        yield from (scale, tracker, last_step, aligned, aligned_step, last_report, up)
        yield from (steps, skipped, backoffs, growths, found_inf, found_inf_origin, nonfinite)
        yield dropped
        yield from self._self_metrics()

    def _self_metrics(self) -> Iterator[Metric]:
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
        yield from (batches, records, rejections, tracked_runs, tracked_ranks, tracked_series)
