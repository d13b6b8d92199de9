"""Every metric the exporter serves, kept as data in one place.

The collector builds its families from this table, the docs' metric reference (generated) and
the dashboard/alert tests read it, so a name cannot drift between them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ampscope.reporter.schema import SCALE_ALIGN_STEPS

RANK_LABELS = ("run", "node", "rank", "local_rank")

DEVICE_LABELS = ("run", "device", "node")
"""Labels of the per-device families: ``device`` as ``ampscope_rank_info`` names it."""

OFFENCE_KINDS = ("nonfinite_origin", "transient_fault", "replica_divergence")
"""Offences ``ampscope_device_offences_total`` counts (its ``kind``): the kinds that point at
the device. The rank's own gradients held inf/NaN (a rerun that reproduced them says the
data did it: not counted), or a rerun did not reproduce its flagged result (inf/NaN or a
spike: ``transient_fault``); or a majority of its replicas outvoted its parameters
(``replica_divergence``). An origin outlier alone is none: a rank's own gradient norm
stands out as well when its batch does (an uneven last batch, a loss normalised by the
rank's own token count), so ``origin_outlier`` is a spike (``ampscope_spikes_total``); an
outlier that spikes the loss or the norm is rerun, and one the rerun did not reproduce is a
``transient_fault``."""

RETIRED_OFFENCE_KINDS = ("origin_outlier",)
"""Kinds older exporters counted as offences, no longer any (Prometheus may hold their
series for its retention): the repeat-offender rule and ``ampscope devices`` leave them
out."""


@dataclass(frozen=True, kw_only=True)
class MetricSpec:
    """One metric family as exposed on /metrics."""

    name: str
    """Full exposed name; counters end in ``_total``."""
    type: Literal["gauge", "counter"]
    help: str
    labels: tuple[str, ...]


def _rank(name: str, type_: Literal["gauge", "counter"], help_: str, *extra: str) -> MetricSpec:
    return MetricSpec(name=name, type=type_, help=help_, labels=(*RANK_LABELS, *extra))


SCALER_ONLY = frozenset(
    {
        "ampscope_loss_scale",
        "ampscope_growth_tracker",
        "ampscope_loss_scale_aligned",
        "ampscope_loss_scale_aligned_step",
        "ampscope_loss_scale_aligned_packed",
        "ampscope_scale_backoffs_total",
        "ampscope_scale_growths_total",
    }
)
"""Families of a loss scale: a watch rank (bf16/fp32, no scaler) exposes none of them, as
a scale it does not have is not data."""

CATALOGUE: tuple[MetricSpec, ...] = (
    # Per rank, from the newest record the rank reported.
    _rank(
        "ampscope_rank_info",
        "gauge",
        "Always 1; what the rank runs: mode (scaler: an fp16 loss scaler; watch: a GradWatch "
        "on a bf16/fp32 run, which has no loss scale), the policy for iterations with "
        "non-finite gradients (observe, skip, raise) and the gradients' dtype (unknown when "
        "not reported); the run's world_size and the scheduler's job_id (empty when none "
        "was set), so a job is found by its id: `... * on(run, node, rank, local_rank) "
        "group_left(job_id) ampscope_rank_info`. device: on CUDA the GPU's UUID as "
        "DCGM-exporter's UUID label writes it (GPU-...), else <node>:<local_rank>; pci_bus_id: "
        "the GPU's PCI address as DCGM-exporter writes it (empty without a GPU); hostname: "
        "the machine's host name, on Kubernetes the node's (NODE_NAME from the Downward "
        "API), as DCGM-exporter's Hostname (hostname) holds it, whatever node says.",
        "mode",
        "policy",
        "grad_dtype",
        "world_size",
        "job_id",
        "device",
        "pci_bus_id",
        "hostname",
    ),
    _rank("ampscope_loss_scale", "gauge", "Current loss scale of the rank's scaler."),
    _rank(
        "ampscope_growth_tracker",
        "gauge",
        "Consecutive unskipped iterations since the scale last changed.",
    ),
    _rank("ampscope_last_step", "gauge", "Newest iteration (update() count) the rank reported."),
    _rank(
        "ampscope_loss_scale_aligned",
        "gauge",
        "Loss scale after the rank's newest iteration whose step is a multiple of "
        f"{SCALE_ALIGN_STEPS}: ranks at the same ampscope_loss_scale_aligned_step must agree "
        "on it.",
    ),
    _rank(
        "ampscope_loss_scale_aligned_step",
        "gauge",
        f"The step (a multiple of {SCALE_ALIGN_STEPS}) at which ampscope_loss_scale_aligned was "
        "taken.",
    ),
    _rank(
        "ampscope_loss_scale_aligned_packed",
        "gauge",
        "ampscope_loss_scale_aligned_step and ampscope_loss_scale_aligned in one sample, so "
        "that no store can pair a new step with an old scale: step + (log2(scale) + 1024) / "
        "2048. floor() is the step, 2 ^ ((x - floor(x)) * 2048 - 1024) the scale (within a "
        "factor of 1.0007 below step 2**31). What AmpscopeScaleDesync compares.",
    ),
    _rank(
        "ampscope_loss_scale_clean",
        "gauge",
        "The fault rule's clean scale: the newest scale at which the rank's scaler trained "
        "cleanly; an overflow at or below it is a fault, and scale_collapse measures the fall "
        "from it. Absent during the warm-up (no clean scale yet).",
    ),
    _rank(
        "ampscope_loss",
        "gauge",
        "The rank's loss at its newest iteration, as passed to scale() and unscaled (with "
        "gradient accumulation, the mean over the update's scale() calls). Absent while the "
        "newest iteration overflowed, and for ranks that report no stats.",
    ),
    _rank(
        "ampscope_grad_norm",
        "gauge",
        "Total L2 norm of the unscaled gradients before clipping at the rank's newest "
        "iteration (what clip_grad_norm_ returns; the same on every rank).",
    ),
    _rank(
        "ampscope_grad_norm_origin",
        "gauge",
        "L2 norm of this rank's own, unreduced gradients at its newest iteration (origin "
        "tracking), in ampscope_grad_norm's units: a rank far above the others points at its "
        "data or its GPU.",
    ),
    _rank(
        "ampscope_last_report_timestamp_seconds",
        "gauge",
        "Unix time at which the exporter last received a report from the rank.",
    ),
    _rank(
        "ampscope_rank_up",
        "gauge",
        "1 while the rank is heard from (records or heartbeats) within the stale TTL, else 0.",
    ),
    _rank(
        "ampscope_rank_state",
        "gauge",
        "1 for the rank's current state, 0 for the others: running (steps advancing), stalled "
        "(heard from, no new step for the stall TTL), lost (silent for the stale TTL, no final "
        "record), finished (sent its final record: training ended normally), failed (sent its "
        "final record: training ended on an exception, see ampscope_rank_failure_info), stopped "
        "(sent its final record: its launcher stopped it with a signal, SIGTERM; never lost).",
        "state",
    ),
    _rank(
        "ampscope_rank_pause_start_timestamp_seconds",
        "gauge",
        "While a running or stalled rank's heartbeats say it stopped stepping on purpose "
        '(paused("checkpoint") on the rank side, or an integration\'s evaluation or save): '
        "Unix time, on the exporter's clock, at which the pause began; absent otherwise. The "
        "rank stays running until the exporter's pause limit (2 h by default), then stalls; "
        "time() minus this is how long it has been paused.",
        "reason",
    ),
    _rank(
        "ampscope_rank_failure_info",
        "gauge",
        "1 while the rank is failed, absent otherwise: the class of the exception its training "
        "ended on (NonFiniteGradientsError, RuntimeError, ...), its kind (nonfinite_gradients: "
        "a GradWatch stopped training on inf/NaN gradients; exception: any other) and origin "
        "(yes: this rank's own gradients held inf/NaN at that stop, before the reduction; "
        "no: they did not; unknown: origin not tracked, or not a non-finite stop). The "
        "message and step are in the exporter's JSON API.",
        "exception",
        "kind",
        "origin",
    ),
    # Per rank, cumulative: exact even across dropped batches and exporter restarts.
    _rank("ampscope_steps_total", "counter", "Iterations (update() calls) of the rank's scaler."),
    _rank(
        "ampscope_skipped_steps_total",
        "counter",
        "Iterations whose optimizer step was skipped for inf/NaN gradients.",
    ),
    _rank("ampscope_scale_backoffs_total", "counter", "Times the loss scale was backed off."),
    _rank("ampscope_scale_growths_total", "counter", "Times the loss scale was grown."),
    _rank(
        "ampscope_found_inf_total",
        "counter",
        "Iterations with inf/NaN in this rank's local gradient shards (before the found-inf "
        "all-reduce).",
        "device",
    ),
    _rank(
        "ampscope_found_inf_origin_total",
        "counter",
        "Iterations with inf/NaN in this rank's own gradients before the cross-rank gradient "
        "reduction (origin tracking).",
        "device",
    ),
    _rank(
        "ampscope_weather_skipped_steps_total",
        "counter",
        "The part of ampscope_skipped_steps_total that the fault rule called the loss "
        "scaler's weather (warm-up, growth probes, its edge: skipping and backing off is the "
        "scaler's job); the skip-storm rules count the rest. 0 for a watch. Absent for ranks "
        "whose reporter predates it (docs/scalers.md).",
    ),
    _rank(
        "ampscope_weather_found_inf_total",
        "counter",
        "The part of ampscope_found_inf_total on iterations the fault rule called the loss "
        "scaler's weather; the hotspot rules count the rest. One series per device of "
        "ampscope_found_inf_total; absent for ranks whose reporter predates it.",
        "device",
    ),
    _rank(
        "ampscope_weather_found_inf_origin_total",
        "counter",
        "The part of ampscope_found_inf_origin_total on iterations the fault rule called the "
        "loss scaler's weather. One series per device of ampscope_found_inf_origin_total; "
        "absent for ranks whose reporter predates it.",
        "device",
    ),
    _rank(
        "ampscope_nonfinite_grads_total",
        "counter",
        "Non-finite gradient elements seen in a parameter's local shard (top K per rank).",
        "param",
    ),
    _rank(
        "ampscope_nonfinite_updates_applied_total",
        "counter",
        "Iterations whose optimizer step ran on inf/NaN gradients (a watch under policy "
        "observe, or a DeepSpeed engine that applied them): from the first one on, the "
        "rank's weights hold inf/NaN. Always 0 for torch's scalers and for the skip and "
        "raise policies.",
    ),
    _rank(
        "ampscope_faults_total",
        "counter",
        "Iterations the fault rule called a fault of the rank's own loss or gradients, by "
        "kind: nonfinite_loss, nonfinite_gradients (no loss scaler), overflow_at_clean_scale "
        "(an overflow at or below the scale at which the run recently trained cleanly), "
        "transient (a rerun did not reproduce it), reproducible (a rerun reproduced it: the "
        "data). The loss scaler's own backoffs (warm-up, probing upward) and the "
        "consequences of an earlier applied update are never counted (docs/scalers.md). "
        "Exposed for every kind once the rank's reporter applies the rule.",
        "kind",
    ),
    _rank(
        "ampscope_spikes_total",
        "counter",
        "Spike iterations the exporter found for the rank, by kind: loss and grad_norm (the "
        "value more than 6 sigma above the mean of the rank's preceding 100 iterations and at "
        "least 3 times their median, by default), origin_outlier (the rank's own gradient norm "
        "at least 10 times the median of the other ranks this exporter holds at that step). "
        "Counted from the exporter's start, or the rank process's.",
        "kind",
    ),
    _rank(
        "ampscope_reruns_total",
        "counter",
        "Flagged iterations (inf/NaN) rerun from the same batch (step(optimizer, "
        "rerun=closure)) in which the rank's own result was flagged, by result: transient "
        "(the rerun did not reproduce it: suspect the rank's device), reproducible (it did: "
        "the data or the numerics). Counted from the exporter's start, or the rank "
        "process's; each result exposed once non-zero.",
        "result",
    ),
    _rank(
        "ampscope_replica_checks_total",
        "counter",
        "Replica checks (attach(model, replica_check_every=N)) of the rank's replica group, "
        "by result: agree (every replica's parameters were bit-identical after the optimizer "
        "step), diverged (some replica's were not: silent corruption). Every rank of the "
        "group counts each check of the group. Counted from the exporter's start, or the "
        "rank process's; each result exposed once non-zero.",
        "result",
    ),
    _rank(
        "ampscope_fp8_amax",
        "gauge",
        "Largest |value| an FP8 layer (torchao Float8Linear) cast in the rank's newest observed "
        "iteration, by layer and tensor (input, weight, grad_output; grad_output unscaled "
        "under a loss scaler); NaN when it was inf or NaN. At most fp8_max_layers layers per "
        "rank: those with a live FP8 verdict, then the highest underflow.",
        "layer",
        "tensor",
    ),
    _rank(
        "ampscope_fp8_underflow_ratio",
        "gauge",
        "Share of the tensor's non-zero elements that the layer's own FP8 cast turned into "
        "zero, in the rank's newest observed iteration (same layers as ampscope_fp8_amax).",
        "layer",
        "tensor",
    ),
    _rank(
        "ampscope_fp8_scale",
        "gauge",
        "The scale the layer's FP8 cast multiplied by (tensorwise), or the smallest row scale "
        "(rowwise), in the rank's newest observed iteration (same layers as "
        "ampscope_fp8_amax); absent when not finite.",
        "layer",
        "tensor",
    ),
    _rank(
        "ampscope_fp8_nonfinite_amax_total",
        "counter",
        "Observed iterations whose amax of the layer's tensor was inf or NaN, on iterations "
        "the rank did not skip for overflow (a skipped overflow is no FP8 fault), by layer and "
        "tensor, for every layer (not only the fp8_max_layers exposed in the gauges). What "
        "AmpscopeFp8NonfiniteAmax reads: every store keeps a count, where VictoriaMetrics "
        "drops the gauge's NaN. Counted from the exporter's start, or the rank process's; "
        "exposed once non-zero.",
        "layer",
        "tensor",
    ),
    _rank(
        "ampscope_reporter_dropped_records_total",
        "counter",
        "Records the rank's reporter dropped because its queue was full or the exporter "
        "was unreachable.",
    ),
    # Per device of a run: what triage across runs reads (docs/hardware-triage.md).
    MetricSpec(
        name="ampscope_device_offences_total",
        type="counter",
        help="Iterations at which a rank on this device was an offender, by kind: "
        "nonfinite_origin (its own gradients held inf/NaN before the cross-rank reduction, "
        "origin tracking; not where a rerun reproduced them, which points at the data), "
        "transient_fault (a rerun from the same batch did not reproduce its flagged "
        'result, as ampscope_reruns_total{result="transient"} counts it), '
        "replica_divergence (a majority of the rank's replicas held other parameter values "
        "at a replica check). Exposed once non-zero; the ranks of a run that share a device "
        "are summed. An origin outlier alone is no offence (its batch may be the cause): "
        'ampscope_spikes_total{kind="origin_outlier"} counts it.',
        labels=(*DEVICE_LABELS, "kind"),
    ),
    MetricSpec(
        name="ampscope_device_last_offence_timestamp_seconds",
        type="gauge",
        help="Unix time (the rank's clock) of the newest iteration at which a rank on this "
        "device was an offender; exposed once one was seen by this exporter.",
        labels=DEVICE_LABELS,
    ),
    # The exporter's own health.
    MetricSpec(
        name="ampscope_exporter_ingest_batches_total",
        type="counter",
        help="Ingest batches accepted.",
        labels=(),
    ),
    MetricSpec(
        name="ampscope_exporter_ingest_records_total",
        type="counter",
        help="Records accepted.",
        labels=(),
    ),
    MetricSpec(
        name="ampscope_exporter_ingest_rejections_total",
        type="counter",
        help="Ingest requests rejected, by reason.",
        labels=("reason",),
    ),
    MetricSpec(
        name="ampscope_exporter_tracked_runs",
        type="gauge",
        help="Runs held in memory.",
        labels=(),
    ),
    MetricSpec(
        name="ampscope_exporter_tracked_ranks",
        type="gauge",
        help="Ranks held in memory, stale ones included until retention drops them.",
        labels=(),
    ),
    MetricSpec(
        name="ampscope_exporter_tracked_series",
        type="gauge",
        help="Label sets the exporter's per-rank families expose.",
        labels=(),
    ),
    MetricSpec(
        name="ampscope_exporter_health_threshold",
        type="gauge",
        help="The exporter's health-rule thresholds, one series per threshold, named as its "
        "setting (stale_after_s, lost_critical_share, skip_storm_window_s, ...), so a view "
        "over Prometheus (`ampscope status --prometheus`) judges with the exporters' numbers.",
        labels=("threshold",),
    ),
    MetricSpec(
        name="ampscope_exporter_unrenderable_ranks",
        type="gauge",
        help="Ranks the latest scrape left out because their data could not be rendered.",
        labels=(),
    ),
)

BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in CATALOGUE}
