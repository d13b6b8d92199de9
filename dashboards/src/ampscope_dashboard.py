"""The ampscope Grafana dashboard, as code: ``dashboards/ampscope.json`` is written from here.

Built with Grafana's grafana-foundation-sdk (the version pinned in constraints/pins.txt);
the panel shapes are in ``panels.py``, the variables and annotations in ``templating.py``.
Edit this file, never the JSON, then regenerate it::

    python dashboards/src/ampscope_dashboard.py --write

and, since the Kubernetes ConfigMap carries the dashboard,
``python -m ampscope.bundle.kubernetes deploy/kubernetes``. Without ``--write`` the JSON goes
to standard output. tests/deploy/test_grafana_dashboards.py fails while the committed JSON
and this file disagree, and names the panel that differs.

A new panel is one call in its row's list below; give it the next unused id (the largest
in use plus one), so that links to existing panels keep their target.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.cog import builder as cog_builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as dashboard_models
from panels import (
    LINEAR,
    RANK_LEGEND,
    Query,
    bars,
    label_table,
    number,
    per_rank,
    row,
    series,
    series_heatmap,
    states,
    top_bars,
)
from templating import (
    datasource_variable,
    grafana_annotations,
    label_values,
    prometheus_annotation,
    single_label_value,
)

OUTPUT = Path(__file__).resolve().parents[1] / "ampscope.json"

Panel = cog_builder.Builder[dashboard_models.Panel]

# Every rank exports ampscope_rank_info, scaler or watch, so a bf16 run (no loss scale) is
# listed too.
RUNS = "label_values(ampscope_rank_info, run)"
NODES = 'label_values(ampscope_rank_info{run=~"$run"}, node)'
RANKS = 'label_values(ampscope_rank_info{run=~"$run", node=~"$node"}, rank)'
# The FP8 row draws one rank's layers: the ranks (of the chosen runs and nodes) that export
# FP8 series. A single value, so that a heatmap's rows are one rank's layers.
FP8_RANKS = 'label_values(ampscope_fp8_amax{run=~"$run", node=~"$node"}, rank)'
FP8_SELECTOR = 'run=~"$run", node=~"$node", rank=~"$fp8_rank"'
FP8_LEGEND = "{{layer}} {{tensor}}"

SPIKE_MARKS = f"changes({per_rank('ampscope_spikes_total')}[1m]) > 0"


def _increase(selector: str) -> str:
    return f"increase({selector}[$__rate_interval])"


def _grown(selector: str) -> str:
    """What a counter exposed from its rank's start (skips, found-inf detections, spikes)
    counted per interval, as the alerts count their windows (deploy/prometheus/rules, the
    file's top comment): its value minus its smallest sample in the interval, not
    ``increase()``. VictoriaMetrics' ``increase()`` counts a first sample under 10 from zero
    where none lies within 5 minutes before the interval: after a longer gap in the scrapes
    a rank's few old detections were drawn again. Consecutive intervals
    (``$__rate_interval`` is at least a step and a scrape) overlap, so no growth falls
    between two."""
    return f"({selector} - min_over_time({selector}[$__rate_interval]))"


def _counted(selector: str) -> str:
    """What a counter exposed once non-zero counted per interval, its first sample included,
    as the alerts count their 10 minutes (deploy/prometheus/rules, the ampscope-reruns group):
    by what the series had at the interval's start. There: its increase. Absent there: its
    value where it had no sample within the hour before (``increase()`` cannot count a
    series' first sample), or where its exporter's scrape succeeded (a restart's zero); else
    its growth since its last sample. A failed scrape at the interval's start then draws no
    old count again."""
    start = "offset $__rate_interval"
    last = f"last_over_time({selector}[1h] {start})"
    present = f"(({_increase(selector)}) > 0 and {selector} {start})"
    first = f"({selector} * 1 unless {last})"
    back = f"(({selector} * 1 unless {selector} {start}) and on (job, instance) (up {start} == 1))"
    return f"({present} or {first} or {back} or ({selector} - {last}) > 0)"


RANK_ON = "run, node, rank, local_rank"
"""The rank labels, for ``on (...)`` matching."""


def _rate(selector: str) -> str:
    return f"rate({selector}[$__rate_interval])"


def what_the_ranks_run() -> list[Panel]:
    """Mode, policy and gradient dtype per rank; optimizer steps on inf/NaN gradients."""
    info = per_rank("ampscope_rank_info")
    return [
        label_table(
            24,
            "Mode and policy per rank",
            "From ampscope_rank_info. mode scaler: an fp16 loss scaler (it skips every step "
            "with inf/NaN gradients). mode watch: a GradWatch on a bf16/fp32 run, which has no "
            "loss scale; policy observe steps anyway, skip skips the step on every rank, raise "
            "stops the run.",
            Query(info, instant=True, table=True),
            columns=["run", "node", "rank", "local_rank", "mode", "policy", "grad_dtype"],
            hidden=["Time", "Value", "__name__", "instance", "job"],
            width=12,
            height=7,
        ),
        number(
            25,
            "Ranks by mode and policy",
            "Ranks per run by what they run (ampscope_rank_info). scaler: an fp16 loss scaler. "
            'watch: a GradWatch on a bf16/fp32 run, marked "no loss scale": the loss scale row '
            "shows nothing for those ranks, which is not missing data. Their skips (policy "
            "skip), found-inf origins and non-finite parameters show in the rows below as for "
            "scalers.",
            Query(
                f"label_replace(count by (run, mode, policy) ({info}), "
                '"scale", "(no loss scale)", "mode", "watch")',
                "{{run}}: {{mode}}, policy {{policy}} {{scale}}",
                instant=True,
            ),
            width=6,
            height=7,
            no_value="no ranks",
            color="blue",
        ),
        number(
            26,
            "Optimizer steps on inf/NaN gradients",
            "ampscope_nonfinite_updates_applied_total: steps a GradWatch under policy observe "
            "let the optimizer take on inf/NaN gradients. Anything above 0 means the weights "
            "hold inf/NaN from the first such step on (AmpscopeNonfiniteUpdateApplied fires; "
            "the run's health names the step and the origin rank). Scalers and the skip and "
            "raise policies never take such a step.",
            Query(
                f"max by (run) ({per_rank('ampscope_nonfinite_updates_applied_total')})",
                "{{run}}",
            ),
            width=6,
            height=7,
            no_value="0",
            red_at=1,
            background=True,
            sparkline=True,
        ),
    ]


def loss_and_gradient_norm() -> list[Panel]:
    """Loss, gradient norm and own gradient norm per rank on log axes; spike iterations."""
    # The norm is the same on every rank: counted once per run, whatever ranks are selected.
    grad_norm_spikes = 'ampscope_spikes_total{run=~"$run", kind="grad_norm"}'
    return [
        series(
            28,
            "Loss per rank",
            "Each rank's loss at its newest iteration (ampscope_loss, log10 axis), as passed "
            "to scale(). A spike on one rank only points at that rank's batch; every rank at "
            "once, at the learning rate or the model. Absent while a rank's newest iteration "
            "overflowed.",
            Query(per_rank("ampscope_loss"), RANK_LEGEND),
            interpolation=LINEAR,
            log=10,
        ),
        series(
            29,
            "Gradient norm per rank",
            "Total L2 norm of the unscaled gradients before clipping (ampscope_grad_norm, "
            "log10 axis): what clip_grad_norm_ returns, the same on every rank.",
            Query(per_rank("ampscope_grad_norm"), RANK_LEGEND),
            interpolation=LINEAR,
            log=10,
        ),
        series(
            30,
            "Own (origin) gradient norm per rank",
            "L2 norm of each rank's own gradients before the cross-rank reduction "
            "(ampscope_grad_norm_origin, log10 axis, one line per rank). At a gradient-norm "
            "spike, the rank whose line jumps made it: one that repeats across spikes points "
            "at its GPU or its data shard. Ranks report at their own pace, so lines at one "
            "instant may be a step apart.",
            Query(per_rank("ampscope_grad_norm_origin"), RANK_LEGEND),
            interpolation=LINEAR,
            log=10,
        ),
        bars(
            31,
            "Spike iterations",
            "Spike iterations the exporters found per scrape interval: loss and origin "
            "outliers per rank; the gradient norm once per run (every rank sees the same norm, "
            "so the most any rank counted).",
            Query(
                _grown(per_rank("ampscope_spikes_total", 'kind=~"loss|origin_outlier"')),
                f"{{{{kind}}}}: {RANK_LEGEND}",
            ),
            Query(f"max by (run) ({_grown(grad_norm_spikes)})", "grad_norm: {{run}}"),
        ),
        bars(
            43,
            "Reruns of flagged iterations",
            "Flagged (inf/NaN) iterations rerun from the same batch in which the rank's own "
            "result was flagged, per scrape interval (ampscope_reruns_total), a series' first "
            "rerun included. Red, transient: the rerun did not reproduce it (suspect the "
            "rank's device; AmpscopeTransientFault). Orange, reproducible: it did (the data or "
            "the numerics; AmpscopeReproducibleFault): ampscope status RUN --suspect-batches "
            "lists the step's batch ids. Empty without step(optimizer, rerun=closure) or when "
            "nothing was flagged.",
            Query(
                _counted(per_rank("ampscope_reruns_total", 'result="transient"')),
                f"transient (device): {RANK_LEGEND}",
            ),
            Query(
                _counted(per_rank("ampscope_reruns_total", 'result="reproducible"')),
                f"reproducible (data): {RANK_LEGEND}",
            ),
            colors=("red", "orange"),
        ),
        bars(
            44,
            "Replica checks that diverged",
            "Replica checks (attach(model, replica_check_every=N)) whose data-parallel replicas "
            "held different parameter values after the optimizer step, per scrape interval "
            'and rank (ampscope_replica_checks_total{result="diverged"}), a series\' first '
            "check included: silent corruption (AmpscopeReplicaDivergence). Every rank of the "
            "group counts it; the verdict replica_divergence names the disagreeing rank and "
            "the parameters, the device offences of kind replica_divergence its device. Empty "
            "while every check agrees, or without checks.",
            Query(
                _counted(per_rank("ampscope_replica_checks_total", 'result="diverged"')),
                f"diverged: {RANK_LEGEND}",
            ),
            colors=("red",),
        ),
        bars(
            47,
            "Faults per rank, by kind",
            "Non-finite iterations the fault rule called faults, per scrape interval, rank and "
            "kind (ampscope_faults_total; a series' first fault included): a non-finite loss, "
            "inf/NaN gradients without a loss scaler, an overflow at a scale the run had "
            "trained cleanly at, or a rerun's result (transient, reproducible). The loss "
            "scaler's own backoffs (warm-up, probing upward) are weather and never appear "
            "here; consequences of an applied inf/NaN update count once, at their origin.",
            Query(_counted(per_rank("ampscope_faults_total")), f"{{{{kind}}}}: {RANK_LEGEND}"),
        ),
    ]


def loss_scale() -> list[Panel]:
    """The scalers' loss scale, its desync across ranks, growth tracker, backoffs, growths."""
    newest_step = "ampscope_rank:loss_scale_aligned:newest_step"
    return [
        series(
            2,
            "Loss scale per rank",
            "Current loss scale of every rank's GradScaler (log2 axis: one grid line per "
            "halving). A staircase down is a burst of overflows; a slope down to 1 or below "
            "is a collapse. Only ranks that run a loss scaler appear: a bf16/fp32 rank watched "
            "by a GradWatch has no scale and exports none. The lines named clean: the "
            "clean scale, the recent scale the rank trained at without overflow "
            "(ampscope_loss_scale_clean; absent during warm-up), from which scale_collapse "
            "measures a fall.",
            Query(per_rank("ampscope_loss_scale"), RANK_LEGEND),
            Query(per_rank("ampscope_loss_scale_clean"), f"clean: {RANK_LEGEND}"),
            log=2,
        ),
        series(
            3,
            "Scale desync across ranks (at one step)",
            "Largest over smallest loss scale among the ranks of a run, compared at the newest "
            "step that is a multiple of 10 (ampscope_loss_scale_aligned), so a rank whose "
            "report lags behind a backoff does not count; read from the recording rules "
            "ampscope_run:loss_scale:max_over_min and "
            "ampscope_rank:loss_scale_aligned:newest_step (reporting ranks only). 1 when the "
            "ranks agree; above 1 they unscale their gradients by different factors (alert "
            "AmpscopeScaleDesync). The per-rank lines name the ranks below the run's largest "
            "scale, and by what factor.",
            Query(
                'ampscope_run:loss_scale:max_over_min{run=~"$run"}', "{{run}}: largest / smallest"
            ),
            Query(
                f'max by (run) ({newest_step}{{run=~"$run"}}) / on (run) group_right () '
                f"{per_rank(newest_step)} > 1",
                "{{run}}: largest / rank {{rank}} ({{node}})",
            ),
            min_value=1,
            red_at=1.0001,
        ),
        series(
            4,
            "Growth tracker",
            "Consecutive unskipped iterations since the scale last changed; the scale grows "
            "when it reaches growth_interval and resets to 0 on every overflow.",
            Query(per_rank("ampscope_growth_tracker"), RANK_LEGEND),
        ),
        bars(
            5,
            "Scale backoffs and growths",
            "Loss scale changes per rate interval: backoffs (overflow seen) and growths "
            "(growth_interval clean steps).",
            Query(_grown(per_rank("ampscope_scale_backoffs_total")), f"backoff {RANK_LEGEND}"),
            Query(_grown(per_rank("ampscope_scale_growths_total")), f"growth {RANK_LEGEND}"),
        ),
        series(
            46,
            "Aligned scale per rank",
            "Each rank's loss scale after its newest step that is a multiple of 10 "
            "(ampscope_loss_scale_aligned; the step is on the last-reported-step panel): ranks "
            "at the same aligned step hold the same scale in a healthy run. The desync rule "
            "reads both from one sample (ampscope_loss_scale_aligned_packed), so that no store "
            "pairs a new step with an old scale.",
            Query(per_rank("ampscope_loss_scale_aligned"), RANK_LEGEND),
            width=24,
            log=2,
        ),
    ]


def skipped_steps() -> list[Panel]:
    """Skipped and all steps per second, the loss scaler's weather among them; the skipped
    ratio without the weather against the skip storm line."""
    skipped = _rate(per_rank("ampscope_skipped_steps_total"))
    weather_family = per_rank("ampscope_weather_skipped_steps_total")
    weather = _rate(weather_family)
    steps = _rate(per_rank("ampscope_steps_total"))
    # As the alert counts: without the weather, never below 0 (a reporter whose weather rose
    # more than its skips); every skip of a reporter without the count; each count by what
    # the series had at the interval's start (a gap draws no old skip). The skips' window is
    # read once: a reporter without the count subtracts 0 (its skips * 0), as the rule does.
    skipped_family = per_rank("ampscope_skipped_steps_total")
    none = f"({skipped_family} * 0 unless on ({RANK_ON}) {weather_family})"
    counted = f"clamp_min({_grown(skipped_family)} - ({_grown(weather_family)} or {none}), 0)"
    grown_steps = _grown(per_rank("ampscope_steps_total"))
    return [
        series(
            7,
            "Skipped steps per second",
            "Iterations whose optimizer step was skipped for inf/NaN gradients, those the "
            "fault rule called the loss scaler's weather (warm-up, growth probes, its edge), "
            "and all iterations.",
            Query(skipped, f"skipped {RANK_LEGEND}"),
            Query(weather, f"weather {RANK_LEGEND}"),
            Query(steps, f"all {RANK_LEGEND}"),
            unit="ops",
            min_value=0,
        ),
        series(
            8,
            "Skipped step ratio",
            "Fraction of iterations skipped for inf/NaN the fault rule did not call the loss "
            "scaler's weather. Above 25% over 5 minutes is a skip storm (alert "
            "AmpscopeSkipStorm).",
            Query(f"{counted} / {grown_steps}", RANK_LEGEND),
            unit="percentunit",
            min_value=0,
            red_at=0.25,
        ),
    ]


def overflow_origins() -> list[Panel]:
    """Found-inf per rank and device, local and origin; top non-finite parameters."""
    device_legend = f"{RANK_LEGEND} {{{{device}}}}"
    return [
        bars(
            10,
            "Local found-inf by rank and device",
            "Iterations with inf/NaN in a rank's local gradient shards, after the gradient "
            "reduce-scatter. Under FSDP one rank's inf reaches every rank's shard, so this "
            "shows who saw it, not who caused it.",
            Query(_grown(per_rank("ampscope_found_inf_total")), device_legend),
        ),
        bars(
            11,
            "Origin found-inf by rank and device",
            "Iterations with inf/NaN in a rank's own gradients before the cross-rank "
            "reduction (scaler.attach(model, track_origin=True)). The rank that stands out "
            "caused the overflow (alert AmpscopeInfHotspot).",
            Query(_grown(per_rank("ampscope_found_inf_origin_total")), device_legend),
        ),
        top_bars(
            12,
            "Top non-finite parameters",
            "Parameters whose local gradient shards held the most non-finite elements since "
            "their scaler started, summed over the selected nodes' ranks (each rank reports "
            "its top K; the recording rule ampscope_node_param:nonfinite_grads:sum sums them "
            "per node, so the rank variable does not apply).",
            Query(
                "topk(10, sum by (run, param) "
                '(ampscope_node_param:nonfinite_grads:sum{run=~"$run", node=~"$node"}))',
                "{{run}} {{param}}",
                instant=True,
            ),
        ),
        top_bars(
            13,
            "Found-inf totals by rank and device",
            "Cumulative found-inf iterations per rank and device: origin (own gradients, "
            "before the reduction) and local (shards, after it), and of each the part on "
            "iterations the fault rule called the loss scaler's weather (AmpscopeInfHotspot "
            "leaves it out).",
            Query(
                per_rank("ampscope_found_inf_origin_total"),
                f"origin {device_legend}",
                instant=True,
            ),
            Query(per_rank("ampscope_found_inf_total"), f"local {device_legend}", instant=True),
            Query(
                per_rank("ampscope_weather_found_inf_origin_total"),
                f"weather origin {device_legend}",
                instant=True,
            ),
            Query(
                per_rank("ampscope_weather_found_inf_total"),
                f"weather local {device_legend}",
                instant=True,
            ),
        ),
    ]


def ranks() -> list[Panel]:
    """Rank state over time, up, time since the last report, last step, dropped records."""
    # running 0, stalled 1, lost 2, finished 3, failed 4, stopped 5: each state's series is 1
    # while it holds (a new state takes the next number, so the old ones keep theirs).
    state = " + ignoring (state) ".join(
        factor + per_rank("ampscope_rank_state", f'state="{name}"')
        for factor, name in (
            ("", "stalled"),
            ("2 * ", "lost"),
            ("3 * ", "finished"),
            ("4 * ", "failed"),
            ("5 * ", "stopped"),
        )
    )
    return [
        states(
            22,
            "Rank state",
            "Each rank's state over time: running (steps advancing), stalled (heartbeats "
            "arrive but no new step for the exporter's --stall-after, 10 min by default: a "
            "hang or a long pause; alert AmpscopeRankStalled), lost (nothing heard for "
            "--stale-after, 60 s by default, and no final record: the process died; alert "
            "AmpscopeRankLost), finished (the scaler closed and said so; no alert fires for "
            "it), failed (training ended on an exception, named by ampscope_rank_failure_info; "
            "alert AmpscopeRankFailed), stopped (its launcher stopped it with SIGTERM: "
            "torchrun's elastic restart, a preemption, an eviction; it said so, never lost, "
            "no alert).",
            Query(state, RANK_LEGEND),
            names=[
                ("running", "green"),
                ("stalled", "orange"),
                ("lost", "red"),
                ("finished", "blue"),
                ("failed", "dark-red"),
                ("stopped", "purple"),
            ],
        ),
        series(
            15,
            "Rank up",
            "1 while the exporter hears from the rank (records or heartbeats) within its "
            "stale TTL (60 s by default), else 0: a lost, finished, failed or stopped rank "
            "(see Rank state).",
            Query(per_rank("ampscope_rank_up"), RANK_LEGEND),
            width=8,
            min_value=0,
            max_value=1,
        ),
        series(
            16,
            "Time since last report",
            "Seconds since the exporter last received a record from the rank.",
            Query(f"time() - {per_rank('ampscope_last_report_timestamp_seconds')}", RANK_LEGEND),
            unit="s",
            width=8,
            min_value=0,
        ),
        series(
            17,
            "Last reported step",
            "Newest iteration (update() count) each rank reported; ranks of one run should "
            "move together. The lines named aligned: each scaler rank's newest aligned step "
            "(a multiple of 10, ampscope_loss_scale_aligned_step), where the desync rule "
            "compares scales.",
            Query(per_rank("ampscope_last_step"), RANK_LEGEND),
            Query(per_rank("ampscope_loss_scale_aligned_step"), f"{RANK_LEGEND} aligned"),
            width=8,
        ),
        bars(
            18,
            "Reporter dropped records",
            "Records a rank's reporter dropped (queue full or exporter unreachable). Counters "
            "stay exact regardless: every record carries cumulative totals.",
            Query(_grown(per_rank("ampscope_reporter_dropped_records_total")), RANK_LEGEND),
            width=12,
            height=6,
        ),
        label_table(
            37,
            "Failed ranks",
            "Ranks whose training ended on an exception (state failed), from "
            "ampscope_rank_failure_info: the exception's class, its kind (nonfinite_gradients: "
            "a GradWatch stopped training on inf/NaN gradients) and origin (yes: this rank's "
            "own gradients held the inf/NaN). The step and the message are in the run's "
            "rank_failed verdict (ampscope status, the web view). Alert AmpscopeRankFailed.",
            Query(per_rank("ampscope_rank_failure_info"), instant=True, table=True),
            columns=["run", "node", "rank", "local_rank", "exception", "kind", "origin"],
            hidden=["Time", "Value", "__name__", "instance", "job"],
            width=12,
            height=6,
        ),
        label_table(
            48,
            "Paused ranks",
            "Ranks whose heartbeats say they stopped stepping on purpose (a checkpoint save, "
            "an evaluation: paused() on the rank side, or an integration's evaluation and "
            "save), with the reason and the seconds since the pause began, from "
            "ampscope_rank_pause_start_timestamp_seconds. A paused rank's step stays flat and "
            "it reads running until the exporter's --pause-limit (2 h by default), then "
            "stalled (alert AmpscopeRankStalled); a rank past its limit stays listed here.",
            Query(
                f"round(time() - {per_rank('ampscope_rank_pause_start_timestamp_seconds')})",
                instant=True,
                table=True,
            ),
            columns=["run", "node", "rank", "local_rank", "reason", "Value"],
            hidden=["Time", "__name__", "instance", "job"],
            renamed={"Value": "paused for (s)"},
            width=12,
            height=6,
        ),
    ]


def exporter() -> list[Panel]:
    """The exporters' own ingest, memory and health thresholds (no rank labels: one series per
    exporter)."""
    return [
        series(
            20,
            "Ingest",
            "Batches and records the exporter accepted, and requests it rejected by reason.",
            Query(_rate("ampscope_exporter_ingest_batches_total"), "batches {{instance}}"),
            Query(_rate("ampscope_exporter_ingest_records_total"), "records {{instance}}"),
            Query(
                f"sum by (instance, reason) ({_rate('ampscope_exporter_ingest_rejections_total')})",
                "rejected {{reason}} {{instance}}",
            ),
            unit="reqps",
            min_value=0,
        ),
        series(
            21,
            "Tracked runs, ranks and series; unrenderable ranks",
            "What the exporter holds in memory; bounded by its limits (stale ranks are "
            "dropped after the retention, 1 h by default).",
            Query("ampscope_exporter_tracked_runs", "runs {{instance}}"),
            Query("ampscope_exporter_tracked_ranks", "ranks {{instance}}"),
            Query("ampscope_exporter_tracked_series", "series {{instance}}"),
            Query("ampscope_exporter_unrenderable_ranks", "unrenderable ranks {{instance}}"),
            min_value=0,
        ),
        label_table(
            38,
            "Health thresholds per exporter",
            "From ampscope_exporter_health_threshold: the numbers each exporter's health rules "
            "judge with (its settings). `ampscope status --prometheus` judges with these too; "
            "exporters that disagree are worth a look.",
            Query("ampscope_exporter_health_threshold", instant=True, table=True),
            columns=["threshold", "instance", "Value"],
            hidden=["Time", "__name__", "job"],
            width=24,
            height=8,
        ),
    ]


def suspect_devices() -> list[Panel]:
    """Devices that keep failing across runs, beside their DCGM errors where Prometheus has
    DCGM-exporter's series (docs/hardware-triage.md)."""
    return [
        top_bars(
            33,
            "Devices by runs with offences (30 days)",
            "Per device (on CUDA the GPU UUID, as DCGM-exporter labels it), the distinct runs in "
            "which a rank on it was the origin of inf/NaN gradients, a transient fault or a "
            "replica minority, over 30 days (recording rule "
            "ampscope_device:offending_runs:count_30d). Two runs or more fires "
            "AmpscopeRepeatOffenderDevice: drain the node and run the vendor's "
            "diagnostics. All runs, whatever the run variable.",
            Query(
                "topk(20, ampscope_device:offending_runs:count_30d)",
                "{{device}}",
                instant=True,
            ),
        ),
        top_bars(
            34,
            "Offences by device and kind, selected runs",
            "ampscope_device_offences_total: the steps at which a rank on the device was the "
            "origin of inf/NaN gradients (nonfinite_origin), computed a flagged result its "
            "rerun did not reproduce (transient_fault) or was outvoted by its replicas "
            "(replica_divergence), in the selected runs and nodes. An origin outlier alone "
            "is none (its batch may be the cause); older exporters' origin_outlier series "
            "are left out.",
            Query(
                "sum by (device, node, kind) "
                "(ampscope_device_offences_total"
                '{run=~"$run", node=~"$node", kind=~"nonfinite_origin|transient_fault|'
                'replica_divergence"})',
                "{{device}} on {{node}} {{kind}}",
                instant=True,
            ),
        ),
        label_table(
            35,
            "Last offence per device and run",
            "When a rank on each device last offended in each selected run "
            "(ampscope_device_last_offence_timestamp_seconds, as a date).",
            Query(
                "max by (device, node, run) "
                '(ampscope_device_last_offence_timestamp_seconds{run=~"$run", node=~"$node"}) '
                "* 1000",
                instant=True,
                table=True,
            ),
            columns=["device", "node", "run", "Value"],
            hidden=["Time"],
            width=12,
            height=8,
        ).unit("dateTimeAsIso"),
        label_table(
            36,
            "DCGM errors of offending devices",
            "DCGM-exporter's XID, double-bit ECC and row-remap fields of the devices that "
            "offended in the last 30 days, joined on UUID (recording rule "
            "ampscope_device:dcgm_errors:offenders, which fills hostname from "
            "DCGM-exporter's Hostname label and UUID from --use-old-namespace's uuid). Empty "
            "where Prometheus holds no DCGM-exporter series.",
            Query("ampscope_device:dcgm_errors:offenders", instant=True, table=True),
            columns=["UUID", "hostname", "gpu", "field", "Value"],
            hidden=[
                "Time",
                "__name__",
                "Hostname",
                "uuid",
                "instance",
                "job",
                "device",
                "modelName",
                "DCGM_FI_DRIVER_VERSION",
            ],
            width=12,
            height=8,
        ),
    ]


def fp8_layers() -> list[Panel]:
    """One rank's torchao Float8Linear layers: amax and underflow per layer and tensor as
    heatmaps of layers by time, and each cast's scale."""
    layers = (
        " Choose one run: rows are named by layer and tensor. At most fp8_max_layers layers "
        "per rank (default 16) are exported: those with a live "
        "FP8 verdict first, then the highest underflow; the exporter's JSON API and the web "
        "view's run page hold all. Empty for runs without FP8 layers."
    )
    return [
        series_heatmap(
            40,
            "FP8 amax per layer, log10 (rank $fp8_rank)",
            "log10 of the largest |value| each FP8 layer's cast saw (ampscope_fp8_amax; "
            "grad_output unscaled under a loss scaler), one row per layer and tensor, for the "
            'rank chosen in "FP8 rank" (of one run): a cell 1 above the rest of its row is '
            "10x their amax. A spike on one rank's input points at its batch, on every rank's "
            "weight at the optimizer step before (docs: FP8 training). A NaN amax is a gap (alert "
            "AmpscopeFp8NonfiniteAmax); the fp8_amax_spike verdict (ampscope status) names the "
            "step." + layers,
            Query(f"log10(ampscope_fp8_amax{{{FP8_SELECTOR}}})", FP8_LEGEND),
            unit="none",
            scheme="Spectral",
        ),
        series_heatmap(
            41,
            "FP8 underflow ratio per layer (rank $fp8_rank)",
            "Share of each tensor's non-zero elements that the layer's own FP8 cast turned "
            "into zero (ampscope_fp8_underflow_ratio), one row per layer and tensor, for the "
            'rank chosen in "FP8 rank". Above 10 % for 10 minutes: alert '
            "AmpscopeFp8Underflow; persistent underflow on grad_output (e5m2) means gradients "
            "lose signal." + layers,
            Query(f"ampscope_fp8_underflow_ratio{{{FP8_SELECTOR}}}", FP8_LEGEND),
            unit="percentunit",
            scheme="Oranges",
            min_value=0,
            max_value=1,
        ),
        series(
            42,
            "FP8 scale per layer (rank $fp8_rank)",
            "The scale each FP8 cast multiplied by (ampscope_fp8_scale): tensorwise, or the "
            "smallest row scale (rowwise); it follows the amax down when an outlier arrives. "
            'For the rank chosen in "FP8 rank".' + layers,
            Query(f"ampscope_fp8_scale{{{FP8_SELECTOR}}}", FP8_LEGEND),
            width=24,
            log=2,
        ),
        bars(
            45,
            "FP8 non-finite amax observations (rank $fp8_rank)",
            "Observed iterations whose amax of a layer's tensor was inf or NaN, on iterations "
            "the rank did not skip for overflow (ampscope_fp8_nonfinite_amax_total, counted by "
            "the exporter for every layer; alert AmpscopeFp8NonfiniteAmax). Empty while none "
            'was: the counter appears once non-zero. For the rank chosen in "FP8 rank".',
            Query(_counted(f"ampscope_fp8_nonfinite_amax_total{{{FP8_SELECTOR}}}"), FP8_LEGEND),
            width=24,
        ),
    ]


def build() -> dashboard_models.Dashboard:
    """The whole dashboard: settings, variables, annotations, then each row and its panels."""
    dashboard = (
        dashboard_builders.Dashboard("ampscope: mixed-precision loss scaling")
        .uid("ampscope-loss-scaling")
        .description(
            "Per-rank loss scale, skipped steps and overflow origins reported by ampscope; for "
            "bf16/fp32 runs watched by a GradWatch (no loss scale), each rank's mode and policy "
            "and the optimizer steps taken on inf/NaN gradients."
        )
        .tags(["ampscope", "pytorch", "mixed-precision"])
        .editable()
        .tooltip(dashboard_models.DashboardCursorSync.CROSSHAIR)
        .version(1)
        .time("now-30m", "now")
        .refresh("10s")
        .timezone("")
        .links([])
        .with_variable(datasource_variable())
        .with_variable(
            label_values("run", "Run", RUNS, dashboard_models.VariableSort.ALPHABETICAL_ASC)
        )
        .with_variable(
            label_values("node", "Node", NODES, dashboard_models.VariableSort.ALPHABETICAL_ASC)
        )
        .with_variable(
            label_values("rank", "Rank", RANKS, dashboard_models.VariableSort.NUMERICAL_ASC)
        )
        .with_variable(
            single_label_value(
                "fp8_rank", "FP8 rank", FP8_RANKS, dashboard_models.VariableSort.NUMERICAL_ASC
            )
        )
        .annotation(grafana_annotations())
        .annotation(
            prometheus_annotation(
                "Spikes",
                SPIKE_MARKS,
                color="orange",
                title="{{kind}} spike",
                text="run {{run}} rank {{rank}} (node {{node}})",
                tags=["kind", "rank"],
            )
        )
    )
    rows = [
        (23, "What the ranks run", what_the_ranks_run()),
        (27, "Loss and gradient norm: spikes, and which rank made them", loss_and_gradient_norm()),
        # A watch rank exports none of the scaler-only families: say so where they are drawn.
        (1, "Loss scale (fp16 scaler ranks only: bf16/fp32 watch ranks have none)", loss_scale()),
        (6, "Skipped steps", skipped_steps()),
        (9, "Where the overflows come from", overflow_origins()),
        (39, "FP8 layers (torchao Float8Linear): one rank's layers", fp8_layers()),
        (14, "Ranks", ranks()),
        (19, "Exporter", exporter()),
        (32, "Suspect devices: the devices that keep failing across runs", suspect_devices()),
    ]
    for row_id, title, panels in rows:
        dashboard = dashboard.with_row(row(row_id, title))
        for panel in panels:
            dashboard = dashboard.with_panel(panel)
    return dashboard.build()


def render() -> str:
    """The dashboard's JSON text as committed: keys sorted, two-space indent, final newline."""
    return json.dumps(build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write {OUTPUT.name} in place")
    args = parser.parse_args(argv)
    if args.write:
        OUTPUT.write_text(render(), encoding="utf-8")
        print(OUTPUT)
    else:
        sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
