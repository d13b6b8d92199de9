"""A whole simulated job as its exporters expose it, for loading into a TSDB at scale.

Every node of a :class:`SimulatedJob` is a real exporter core (``Store``,
``StoreCollector`` and ``Exposition``, built from the default ``Settings`` as ``ampscope
serve`` builds them), fed one schema-validated ``StepRecord`` per rank per scrape and
rendered at that scrape's time. So the series, label sets and values are what Prometheus
would scrape from ``/metrics``: per rank the info series with ``world_size`` and
``job_id``, the lifecycle state enum, one device, the top-K non-finite parameters, and the
exporter's own counters per node, and the iteration's stats (loss, gradient norms) with
the spike counters. :meth:`SimulatedJob.scrapes` yields the documents with a
millisecond timestamp on every sample, for VictoriaMetrics' ``/api/v1/import/prometheus``
(``bench.victoria``).

The job runs in step: every rank skips the same steps (an overflow every
``overflow_every`` steps halves the scale, which grows back half-way to the next), some
ranks report a step or two behind (laggards), and every rank tracks found-inf origins.
Every second overflow is the loss scaler's weather (a growth probe backing off: the
``weather`` totals), so the rules' subtraction of the weather is timed too; the other half
still makes the planted hotspot.
Every rank reports a noisy loss around 2, the job's gradient norm (one per step, the same
on every rank: it is all-reduced) and its own unreduced gradient norm (per rank, about twice
the job's); overflow iterations report none. Five faults are planted (:class:`Faults`): a
hotspot (most overflows originate on one rank's device), a scale desync (one rank holds
twice the job's scale), a lost rank (silent for the last four minutes, so its exporter
marks it lost), a missing rank (never reports, though ``world_size`` counts it) and a bad
batch (one rank's loss x4.5 and own gradient norm about x20 its node peers' at one recent
step: a loss spike and an origin outlier, found by that rank's exporter).

Cost: one record built and validated, ingested and rendered per rank per scrape (about
0.2 ms of Python each), with O(ranks) memory.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from ampscope.exporter.metrics.collector import StoreCollector
from ampscope.exporter.metrics.exposition import Exposition
from ampscope.exporter.settings import Settings
from ampscope.exporter.state.ingest_counters import IngestStats
from ampscope.reporter.schema import (
    SCALE_ALIGN_STEPS,
    AlignedScale,
    Identity,
    IngestBatch,
    NonfiniteParam,
    OptimizerDetail,
    ParamNorm,
    RankTotals,
    Setup,
    StepRecord,
    StepStats,
    WeatherTotals,
)

BASE_SCALE = 65536.0
RANKS_PER_NODE = 8
SPIKE_SCRAPES_AGO = 2
"""The bad batch is in the record sent this many scrapes before the newest (or the first
non-overflow step after it): recent enough for every 10-minute spike window."""
LOST_FOR_S = 240.0
"""The lost rank's last report is at least this long before the newest scrape: four times
the exporters' ``stale_after_s``, well past it: the newest scrapes all show the rank lost."""
PARAMS = tuple(
    f"model.layers.{i}.self_attn.o_proj.weight" if i % 2 else f"model.layers.{i}.mlp.up_proj.weight"
    for i in range(64)
)


@dataclass(frozen=True, kw_only=True)
class Faults:
    """The planted faults: global ranks (and the hotspot's device)."""

    hotspot: int
    desync: int
    lost: int
    missing: int
    spike: int
    """The bad batch's rank."""

    @classmethod
    def spread(cls, world_size: int) -> Faults:
        """One fault per quarter of the job, each on a different node; the bad batch on the
        hotspot's node, local rank 0, so that local ranks 3 and 6 report the same steps
        (laggards lag by ``rank % 3``) and its exporter can compare the origin norms."""
        quarter = world_size // 4
        return cls(
            hotspot=quarter + 3,
            desync=2 * quarter + 5,
            lost=3 * quarter + 1,
            missing=6,
            spike=quarter - quarter % RANKS_PER_NODE,
        )


class NodeExporter:
    """One node's exporter core, with a clock the job moves."""

    def __init__(self, settings: Settings) -> None:
        self.now = 0.0
        self.store = settings.store()
        self.stats = IngestStats()
        collector = StoreCollector(self.store, self.stats, self.clock, settings.thresholds())
        self.exposition = Exposition(self.store, collector, self.clock, settings.stale_after_s)

    def clock(self) -> float:
        return self.now


def _noise(*key: int) -> float:
    """A deterministic pseudo-random number in [-1, 1) for ``key`` (splitmix64's mixer):
    the same step gives the same gradient norm on every rank, without a shared generator."""
    mask = (1 << 64) - 1
    x = 0
    for part in key:
        x = (x ^ part) * 0x9E3779B97F4A7C15 & mask
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & mask
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & mask
        x ^= x >> 31
    return x / (1 << 63) - 1.0


def _scale_after(step: int, every: int) -> float:
    # Halved at every overflow step, grown back half-way to the next.
    return BASE_SCALE / 2 if step >= every and step % every < every // 2 else BASE_SCALE


@dataclass(kw_only=True)
class SimulatedJob:
    """``nodes`` x 8 ranks of one run, scraped every ``interval_s`` for ``scrapes`` scrapes.

    Args:
        run: The run id.
        nodes: Nodes (one exporter each); at least 4, so that each fault has its own node.
        job_id: The scheduler's job id on ``ampscope_rank_info``.
        top_k: Non-finite parameters each rank reports (the scaler's default is 8).
        steps_per_s: Training steps per second of every rank.
        overflow_every: Every n-th step overflows on every rank (DDP reduces found-inf).
        interval_s: Seconds between scrapes.
        scrapes_per_series: Samples per series (the newest at the time ``scrapes`` is
            called). They must span more than the longest rule window (600 s) plus the
            lookback, so that every window has a sample before it, as a live scrape's has:
            VictoriaMetrics' ``increase`` counts a counter that starts inside the window
            from zero. And at least ``spike_min_window`` + 4: the exporter finds the bad
            batch's spike only after that many values of its rank.
    """

    run: str
    nodes: int
    job_id: str = "4242"
    top_k: int = 8
    steps_per_s: float = 2.0
    overflow_every: int = 100
    interval_s: float = 60.0
    scrapes_per_series: int = 24
    faults: Faults = field(init=False)

    def __post_init__(self) -> None:
        if self.nodes < 4:
            raise ValueError("nodes >= 4 required: each planted fault has its own node")
        if not 1 <= self.top_k <= len(PARAMS):
            raise ValueError(f"top_k must be within [1, {len(PARAMS)}]")
        self.world_size = self.nodes * RANKS_PER_NODE
        self.faults = Faults.spread(self.world_size)
        settings = Settings()
        if self.scrapes_per_series < settings.spike_min_window + SPIKE_SCRAPES_AGO + 2:
            raise ValueError(
                f"scrapes_per_series >= {settings.spike_min_window + SPIKE_SCRAPES_AGO + 2} "
                "required: the bad batch's rank needs spike_min_window values before it"
            )
        self.settings = settings
        self.exporters = [NodeExporter(settings) for _ in range(self.nodes)]

    @property
    def hotspot_device(self) -> str:
        return f"cuda:{self.faults.hotspot % RANKS_PER_NODE}"

    def node_name(self, index: int) -> str:
        return f"node{index:04d}"

    def node_of(self, rank: int) -> str:
        return self.node_name(rank // RANKS_PER_NODE)

    def _origins(self, rank: int, overflows: int) -> int:
        """Overflows up to the ``overflows``-th that started on ``rank``: 19 in 20 on the
        hotspot, the 20th on a rank spread over the job."""
        if rank == self.faults.hotspot:
            return overflows - overflows // 20
        return sum(1 for k in range(20, overflows + 1, 20) if (k * 7919) % self.world_size == rank)

    def _weather_origins(self, rank: int, overflows: int) -> int:
        """Of :meth:`_origins`, those of even-numbered overflows (the weather): on the
        hotspot every even one but each 20th, elsewhere all (each 20th is even)."""
        if rank == self.faults.hotspot:
            return overflows // 2 - overflows // 20
        return self._origins(rank, overflows)

    def stats(self, rank: int, step: int, *, bad_batch: bool = False) -> StepStats:
        """Rank ``rank``'s loss and gradient norms at ``step`` (none on an overflow step).
        ``bad_batch``: the planted loss spike and origin outlier, flagged by the rank's own
        spike rule, with its top parameters."""
        if step % self.overflow_every == 0:
            return StepStats(loss=None, grad_norm=None, grad_norm_origin=None)
        grad_norm = 1.0 + 0.1 * _noise(step)
        own = grad_norm * (2.0 + 0.2 * _noise(step, rank))
        if not bad_batch:
            return StepStats(
                loss=2.0 + 0.05 * _noise(step, rank, 1), grad_norm=grad_norm, grad_norm_origin=own
            )
        return StepStats(
            loss=9.0,
            grad_norm=grad_norm,
            grad_norm_origin=40.0 * grad_norm,
            spikes=["loss"],
            top_params=[ParamNorm(name=PARAMS[1], norm=35.0 * grad_norm)],
        )

    def record(self, rank: int, step: int, when: float, *, bad_batch: bool = False) -> StepRecord:
        """Rank ``rank``'s record of ``step``, sent at ``when`` (``bad_batch``: see
        :meth:`stats`)."""
        every = self.overflow_every
        factor = 2.0 if rank == self.faults.desync else 1.0
        device = f"cuda:{rank % RANKS_PER_NODE}"
        overflows = step // every
        overflow = step % every == 0
        grew = step % every == every // 2 and step > every
        aligned = step - step % SCALE_ALIGN_STEPS
        params = [
            NonfiniteParam(name=PARAMS[j], count=(overflows - j - 1) // self.top_k + 1)
            for j in range(min(self.top_k, overflows))
        ]
        origin = self._origins(rank, overflows)
        return StepRecord(
            identity=Identity(
                run=self.run,
                node=self.node_of(rank),
                rank=rank,
                local_rank=rank % RANKS_PER_NODE,
                world_size=self.world_size,
                local_world_size=RANKS_PER_NODE,
                job_id=self.job_id,
            ),
            step=step,
            time=when,
            found_inf_local={device: overflow},
            found_inf_origin={device: overflow and self._origins(rank, overflows - 1) < origin},
            found_inf_global=overflow,
            skipped=overflow,
            scale_before=factor * _scale_after(step - 1, every),
            scale_after=factor * _scale_after(step, every),
            growth_tracker=step % (every // 2),
            event="backoff" if overflow else "growth" if grew else "none",
            optimizers=[OptimizerDetail(index=0, name="AdamW", found_inf=overflow, fused=True)],
            nonfinite_params=params[:2] if overflow else [],
            totals=RankTotals(
                steps=step,
                skipped_steps=overflows,
                backoffs=overflows,
                growths=max(0, (step - every // 2) // every),
                found_inf_local={device: overflows},
                found_inf_origin={device: origin},
                nonfinite_params=params,
                min_scale=factor * BASE_SCALE / 2,
                max_scale=factor * BASE_SCALE,
                aligned_scale=AlignedScale(
                    step=aligned, scale=factor * _scale_after(aligned, every)
                ),
                weather=WeatherTotals(
                    skipped_steps=overflows // 2,
                    found_inf_local={device: overflows // 2},
                    found_inf_origin={device: self._weather_origins(rank, overflows)},
                ),
            ),
            setup=Setup(mode="scaler", policy="skip", grad_dtype="float16"),
            stats=self.stats(rank, step, bad_batch=bad_batch),
        )

    def reports(self, rank: int, when: float, end: float) -> bool:
        """Whether ``rank`` reported before the scrape at ``when`` (newest at ``end``)."""
        if rank == self.faults.missing:
            return False
        return rank != self.faults.lost or when <= end - LOST_FOR_S

    def scrapes(self, end: float | None = None) -> Iterator[tuple[int, float, bytes]]:
        """``(node index, scrape time, exposition with millisecond timestamps)`` of every
        node at every scrape, oldest scrape first. The scrapes are ``interval_s`` apart and
        end at ``end``; without it, the newest is timed when it is made (the others end
        ``interval_s`` before the call), so the data is as fresh as a live scrape's."""
        started = time.time() if end is None else end
        # The run started an hour before the oldest scrape: steps are in the thousands.
        run_start = started - self.interval_s * self.scrapes_per_series - 3600.0
        bad_batch_due = self.scrapes_per_series - 1 - SPIKE_SCRAPES_AGO
        for scrape in range(self.scrapes_per_series):
            newest = scrape == self.scrapes_per_series - 1
            if newest and end is None:
                now = max(time.time(), started)
            else:
                now = started - (self.scrapes_per_series - 1 - scrape) * self.interval_s
            step_now = int((now - run_start) * self.steps_per_s)
            stamp = b" %d\n" % int(now * 1000)
            for index, exporter in enumerate(self.exporters):
                exporter.now = now
                for rank in range(index * RANKS_PER_NODE, (index + 1) * RANKS_PER_NODE):
                    if not self.reports(rank, now, started):
                        continue
                    step = step_now - rank % 3
                    bad_batch = (
                        rank == self.faults.spike
                        and scrape >= bad_batch_due
                        and step % self.overflow_every != 0
                    )
                    if bad_batch:
                        bad_batch_due = self.scrapes_per_series  # once
                    record = self.record(rank, step, now - 0.25, bad_batch=bad_batch)
                    batch = IngestBatch(schema_version=1, records=[record], dropped_records=0)
                    exporter.store.ingest(batch, now)
                    exporter.stats.accepted(1)
                yield index, now, _with_timestamps(exporter.exposition.render(), stamp)


def _with_timestamps(body: bytes, stamp: bytes) -> bytes:
    """The exposition's sample lines, each ending in ``stamp`` (comments dropped)."""
    return b"".join(
        line + stamp for line in body.split(b"\n") if line and not line.startswith(b"#")
    )
