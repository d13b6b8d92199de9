"""The Prometheus config and alert rules: promtool's checks and unit tests, and house rules."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml
from deploy_files import (
    PROMETHEUS_DIR,
    RULES_FILE,
    alert_rules,
    metric_names,
    recording_rules,
    selected_families,
)
from support import need_tool

from ampscope.devices.query import DCGM_FIELDS
from ampscope.exporter.metrics.catalogue import (
    BY_NAME,
    OFFENCE_KINDS,
    RETIRED_OFFENCE_KINDS,
    SCALER_ONLY,
)
from ampscope.status.prometheus.ranks import LOOKBACK_S, grown_within
from ampscope.verdicts import aligned
from ampscope.verdicts.fp8 import Fp8Rule
from ampscope.verdicts.ranks import FINAL_STATES, LIVE_STATES
from ampscope.verdicts.thresholds import Thresholds

ALERTS = {
    "AmpscopeScaleCollapse",
    "AmpscopeSkipStorm",
    "AmpscopeScaleDesync",
    "AmpscopeRankLost",
    "AmpscopeNodeLost",
    "AmpscopeRankStalled",
    "AmpscopeRankStopped",
    "AmpscopeRankFailed",
    "AmpscopeInfHotspot",
    "AmpscopeNonfiniteUpdateApplied",
    "AmpscopeLossSpike",
    "AmpscopeGradNormSpike",
    "AmpscopeOriginOutlier",
    "AmpscopeTransientFault",
    "AmpscopeReproducibleFault",
    "AmpscopeReplicaDivergence",
    "AmpscopeRepeatOffenderDevice",
    "AmpscopeFp8NonfiniteAmax",
    "AmpscopeFp8Underflow",
}
DEVICE_ALERTS = {"AmpscopeRepeatOffenderDevice"}
"""Alerts about a device across runs: they name the device, not a run."""
UNIT_TESTS = sorted((PROMETHEUS_DIR / "tests").glob("*.yml"))
ONCE_NON_ZERO = {"ampscope_reruns_total", "ampscope_fp8_nonfinite_amax_total"}
"""Counters the exporter exposes once non-zero (catalogue), counted with ``counted_within``."""


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    promtool = need_tool("promtool")
    return subprocess.run(
        [promtool, *args],
        check=False,
        cwd=PROMETHEUS_DIR,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.prometheus
def test_promtool_accepts_config_and_rules() -> None:
    config = _promtool("check", "config", "prometheus.yml")
    assert config.returncode == 0, config.stdout + config.stderr
    # check config loads rule_files too; make sure the glob actually found our file.
    assert "1 rule files found" in config.stdout
    checked = _promtool("check", "rules", str(RULES_FILE.relative_to(PROMETHEUS_DIR)))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{len(alert_rules()) + len(recording_rules())} rules found" in checked.stdout


@pytest.mark.prometheus
def test_promtool_unit_tests_pass() -> None:
    assert UNIT_TESTS, "no promtool unit tests in deploy/prometheus/tests"
    result = _promtool("test", "rules", *(str(p.relative_to(PROMETHEUS_DIR)) for p in UNIT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAILED" not in result.stdout


def test_every_alert_is_unit_tested_firing_and_not_firing() -> None:
    firing: set[str] = set()
    silent: set[str] = set()
    for path in UNIT_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check["exp_alerts"] else silent).add(check["alertname"])
    assert firing == ALERTS
    assert silent == ALERTS


def test_vmalert_parses_every_rule() -> None:
    """vmalert (VictoriaMetrics) evaluates the same file: its parser (MetricsQL) must accept
    every expression, as tests/deploy/test_e2e_two_nodes.py needs."""
    vmalert = need_tool("vmalert")
    result = subprocess.run(
        [vmalert, "-dryRun", f"-rule={RULES_FILE}", "-loggerLevel=ERROR"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_carry_for_severity_summary_description() -> None:
    alerts = alert_rules()
    assert set(alerts) == ALERTS
    for name, rule in alerts.items():
        assert rule["for"], name
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        named = "$labels.device" if name in DEVICE_ALERTS else "$labels.run"
        assert named in rule["annotations"]["summary"], name
        description = rule["annotations"]["description"]
        assert "$labels" in description, name
        assert "$value" in description or "$labels.instance" in description, name


def test_rules_use_only_catalogued_or_recorded_metrics() -> None:
    # ``up``: the series Prometheus itself writes for every scrape (AmpscopeNodeLost).
    known = set(BY_NAME) | set(recording_rules()) | {"up"}
    for rule in [*alert_rules().values(), *recording_rules().values()]:
        names = metric_names(rule["expr"])
        assert names, rule
        assert names <= known, (rule.get("alert") or rule.get("record"), names - known)


def test_alert_thresholds_are_the_shared_defaults() -> None:
    alerts = alert_rules()
    recorded = recording_rules()
    collapse = alerts["AmpscopeScaleCollapse"]["expr"]
    # The window's peak only within the rank's current process (a restart with the same
    # labels is no fall): the step counter restarts from zero with the process.
    assert "resets(ampscope_steps_total[10m]) > 0" in collapse
    assert "ampscope_loss_scale < 1" in collapse
    assert "[10m]" in collapse
    assert ">= 256" in collapse
    storm = alerts["AmpscopeSkipStorm"]["expr"]
    assert "> 0.25" in storm
    assert ">= 10" in storm
    assert "[5m]" in recorded["ampscope_rank:skipped_steps:ratio_5m"]["expr"]
    assert alerts["AmpscopeScaleDesync"]["for"] == "2m"
    assert "> 1" in alerts["AmpscopeScaleDesync"]["expr"]
    assert alerts["AmpscopeRankLost"]["for"] == "1m"
    assert alerts["AmpscopeRankStalled"]["for"] == "1m"
    stopped = " ".join(alerts["AmpscopeRankStopped"]["expr"].split())
    grace = Thresholds().stopped_grace_s
    assert f"time() - ampscope_last_report_timestamp_seconds > {grace:g}" in stopped
    assert alerts["AmpscopeRankStopped"]["for"] == "1m"
    # An exporter's rolling update takes its ranks' series away for minutes, not a node.
    assert alerts["AmpscopeNodeLost"]["for"] == "5m"
    hotspot = alerts["AmpscopeInfHotspot"]["expr"]
    assert ">= 0.8" in hotspot
    assert ">= 5" in hotspot
    assert "[10m]" in recorded["ampscope_rank_device:found_inf_source:increase_10m"]["expr"]
    # Spike alerts fire while a spike lies within the verdicts' 600 s window.
    window = f"[{Thresholds().spike_verdict_window_s / 60:g}m]"
    for name, kind in (
        ("AmpscopeLossSpike", "loss"),
        ("AmpscopeGradNormSpike", "grad_norm"),
        ("AmpscopeOriginOutlier", "origin_outlier"),
    ):
        expr = alerts[name]["expr"]
        counter = f'ampscope_spikes_total{{kind="{kind}"}}'
        assert f"{counter} - min_over_time({counter}{window})" in expr, name
        assert ") > 0\n" in expr, name
        assert alerts[name]["labels"]["severity"] == "warning", name
    # The grad norm is the same on every rank: one alert per run, not one per rank.
    assert alerts["AmpscopeGradNormSpike"]["expr"].startswith("max by (run) (")


def _windowed_count(counter: str, window: str) -> str:
    """A counter exposed once non-zero, counted within ``window`` (``10m``) by what it had at
    the window's start: there, its increase; absent, its value where it had no sample within
    ``LOOKBACK_S`` before the window or its exporter's scrape then succeeded (a restart's
    zero), else its growth since its last sample before the window. Never an old counter
    whose scrape failed at the window's start (``up`` is 0 there)."""
    start = f"offset {window}"
    last = f"last_over_time({counter}[{LOOKBACK_S / 3600:g}h] {start})"
    present = f"(increase({counter}[{window}]) > 0 and {counter} {start})"
    first = f"({counter} * 1 unless {last})"
    back = f"( ({counter} * 1 unless {counter} {start}) and on (job, instance) (up {start} == 1) )"
    grew = f"({counter} - {last}) > 0"
    return f"( {present} or {first} or {back} or {grew} )"


def test_rerun_alerts_read_the_counter_by_result_with_the_verdicts_window() -> None:
    """One window for the rerun verdicts: the exporter's (``spike_verdict_window_s``), the
    alerts' and ``status --prometheus``'s (``health.queries``)."""
    alerts = alert_rules()
    window = f"{Thresholds().spike_verdict_window_s / 60:g}m"
    for name, result, severity in (
        ("AmpscopeTransientFault", "transient", "critical"),
        ("AmpscopeReproducibleFault", "reproducible", "warning"),
    ):
        rule = alerts[name]
        assert rule["labels"]["severity"] == severity
        expr = " ".join(rule["expr"].split())
        counter = f'ampscope_reruns_total{{result="{result}"}}'
        assert expr.startswith(_windowed_count(counter, window)), name
        assert "10 minutes" in rule["annotations"]["description"], name
    # The on-call finds the batch ids in the exporter, not in Prometheus.
    assert "--suspect-batches" in alerts["AmpscopeReproducibleFault"]["annotations"]["description"]


def test_increase_reads_only_counters_exposed_once_non_zero() -> None:
    """VictoriaMetrics' ``increase()`` counts a first sample under 10 from zero where no
    sample lies within 5 minutes before the window, so after a longer gap in the scrapes a
    healthy rank's few old skips, detections or spikes paged. Counters exposed from a rank's
    start are counted as their growth over the window's samples (``grown_within``, the form
    ``status --prometheus`` sends); ``increase()`` is read only in ``counted_within``'s form,
    for the counters exposed once non-zero, and only for series there at the window's
    start."""

    def spaced(text: str) -> str:
        return " ".join(text.replace("(", "( ").replace(")", " )").split())

    grown = 0
    for name, rule in [*alert_rules().items(), *recording_rules().items()]:
        expr = spaced(rule["expr"])
        for series, window in re.findall(r"increase\( (\S+?)\[(\w+)\] \)", expr):
            assert series.split("{")[0] in ONCE_NON_ZERO, (name, series)
            assert spaced(_windowed_count(series, window)) in expr, (name, series)
        windows = re.findall(r"min_over_time\( (ampscope_\S+?)\[(\w+)\] \)", expr)
        # Each counter's window read once: the weather's subtraction reads no count twice.
        assert len(windows) == len(set(windows)), (name, windows)
        for series, window in windows:
            seconds = int(window[:-1]) * 60
            assert spaced(grown_within(series, seconds).replace(f"{seconds}s", window)) in expr
            grown += 1
    # The skip ratio's 3 and the hotspot's 4 counters, the storm's steps, the 3 spike kinds.
    assert grown >= 11


def test_the_node_lost_alert_reads_what_status_calls_lost_over_the_same_window() -> None:
    """A dead node's exporter cannot say its ranks are lost: the alert reads the absence of
    their series, over ``status --prometheus``'s ``LOOKBACK_S``, leaving out final states."""
    rule = alert_rules()["AmpscopeNodeLost"]
    assert rule["labels"]["severity"] == "critical"
    expr = " ".join(rule["expr"].split())
    window = f"[{LOOKBACK_S / 3600:g}h]"
    assert expr.startswith("count by (run, node, job, instance) (")
    assert (
        f"last_over_time(ampscope_rank_info{window}) unless on (run, rank) ampscope_rank_info"
        in expr
    )
    final = "|".join(FINAL_STATES)
    assert f'last_over_time(ampscope_rank_state{{state=~"{final}"}}{window}) == 1' in expr


def test_the_desync_rule_reads_the_aligned_step_and_scale_from_one_sample() -> None:
    """Two series of one scrape can be paired across scrapes (VictoriaMetrics): the rule
    reads the packed series alone, with ``ampscope.verdicts.aligned``'s formula."""
    recorded = recording_rules()["ampscope_rank:loss_scale_aligned:newest_step"]["expr"]
    assert selected_families(recorded) == {"ampscope_loss_scale_aligned_packed", "ampscope_rank_up"}
    packed = "ampscope_loss_scale_aligned_packed"
    assert " ".join(recorded.split()).startswith(f"{aligned.promql_scale(packed)} and on (")
    step = aligned.promql_step(packed)
    # The ranks' steps (and the run's newest among them) as well as the scale's fraction.
    assert recorded.count(step) == 2 + aligned.promql_scale(packed).count(step)
    assert "timestamp(" not in recorded


def test_no_alert_fires_for_a_finished_rank() -> None:
    # Rank-state alerts select their state; every other alert excludes finished ranks (a
    # run-level alert: runs whose every rank finished). promtool proves it on data.
    finished = 'ampscope_rank_state{state="finished"} == 1'
    for name, rule in alert_rules().items():
        expr = " ".join(rule["expr"].split())
        if name in DEVICE_ALERTS:
            continue  # about finished runs by design: a device's record across them
        if name in ("AmpscopeRankLost", "AmpscopeNodeLost", "AmpscopeRankStalled",
                    "AmpscopeRankStopped", "AmpscopeRankFailed"):  # fmt: skip
            assert 'state="finished"' not in expr, name
            continue
        assert f"unless on (run, node, rank, local_rank) {finished}" in expr or (
            'unless on (run) min by (run) (ampscope_rank_state{state="finished"}) == 1' in expr
        ), name


def test_scale_alerts_select_only_what_watch_ranks_do_not_export() -> None:
    # A watch rank (bf16/fp32) exports none of SCALER_ONLY, so an alert that reads a scale
    # from those families alone (besides liveness) cannot fire for it; promtool shows it
    # on a bf16 run's series.
    liveness = {"ampscope_rank_state", "ampscope_rank_up"}
    # Read only after `unless`, to tell ranks whose reporter applies the fault rule: it can
    # remove a rank from the collapse alert, never select one. The clean scale is exported
    # for scaler ranks only (once they trained cleanly, so not in SCALER_ONLY, which a
    # scaler always exports).
    liveness |= {"ampscope_faults_total", "ampscope_loss_scale_clean"}
    # Also after `unless` only: a reset of the step counter within the window says the
    # rank's process changed, which removes the window's peak, never selects a rank.
    liveness |= {"ampscope_steps_total"}
    for name in ("AmpscopeScaleCollapse", "AmpscopeScaleDesync"):
        families = selected_families(alert_rules()[name]["expr"])
        assert families & SCALER_ONLY, name
        assert families <= SCALER_ONLY | liveness, (name, families - SCALER_ONLY - liveness)


def test_the_failed_alert_is_critical_selects_the_failed_state_and_names_the_exception() -> None:
    rule = alert_rules()["AmpscopeRankFailed"]
    assert rule["labels"]["severity"] == "critical"
    expr = " ".join(rule["expr"].split())
    assert expr.startswith('(ampscope_rank_state{state="failed"} == 1) * on (run, node, rank, ')
    assert "group_left (exception, kind, origin) ampscope_rank_failure_info" in expr
    assert "$labels.exception" in rule["annotations"]["summary"]


def test_nonfinite_update_alert_is_critical_and_reads_the_counter() -> None:
    rule = alert_rules()["AmpscopeNonfiniteUpdateApplied"]
    assert rule["labels"]["severity"] == "critical"
    assert "ampscope_nonfinite_updates_applied_total > 0" in rule["expr"]


def test_fp8_alerts_read_the_gauges_with_the_verdicts_thresholds() -> None:
    alerts = alert_rules()
    window = f"[{Thresholds().spike_verdict_window_s / 60:g}m]"
    nonfinite = alerts["AmpscopeFp8NonfiniteAmax"]
    assert nonfinite["labels"]["severity"] == "critical"
    expr = " ".join(nonfinite["expr"].split())
    # A count every store keeps (VictoriaMetrics drops a NaN sample), within the window;
    # the exporter counts unskipped iterations only, so no skipped-steps exclusion is needed.
    assert expr.startswith(_windowed_count("ampscope_fp8_nonfinite_amax_total", window[1:-1]))
    assert "ampscope_fp8_amax" not in selected_families(expr)
    underflow = alerts["AmpscopeFp8Underflow"]
    assert underflow["labels"]["severity"] == "warning"
    assert f"ampscope_fp8_underflow_ratio > {Fp8Rule().underflow_ratio:g}" in underflow["expr"]
    assert underflow["for"] == "10m"
    # No spike alert: the median of the previous observations is not in the scraped gauge.
    assert not [name for name in alerts if "Spike" in name and "Fp8" in name]


def test_no_alert_divides_by_a_recorded_run_total() -> None:
    """vmalert writes recording rules asynchronously: a run total recorded while some ranks'
    series were not yet searchable made a healthy rank's share look like the whole (CI, on
    VictoriaMetrics 1.79). The hotspot alert's share therefore sums the ranks in its own
    query, so that numerator and denominator come from one read."""
    alerts = alert_rules()
    assert "ampscope_run:found_inf_source" not in alerts["AmpscopeInfHotspot"]["expr"]
    assert (
        "sum by (run) (ampscope_rank_device:found_inf_source:increase_10m)"
        in alerts["AmpscopeInfHotspot"]["expr"]
    )


def test_device_rules_count_runs_over_30_days_and_join_dcgm_on_the_uuid() -> None:
    recorded = recording_rules()
    runs = " ".join(recorded["ampscope_device:offending_runs:count_30d"]["expr"].split())
    # Fault offences only, whatever kinds the exporter adds (OFFENCE_KINDS are the faults).
    kinds = "|".join(OFFENCE_KINDS)
    assert f'max_over_time(ampscope_device_offences_total{{kind=~"{kinds}"}}[30d])' in runs
    # Nor the kinds older exporters counted (Prometheus keeps their series 30 days), in the
    # rule or in the alert's description.
    description = alert_rules()["AmpscopeRepeatOffenderDevice"]["annotations"]["description"]
    for retired in RETIRED_OFFENCE_KINDS:
        assert retired not in runs
        assert retired not in description
    # By device alone: a GPU keeps its UUID when its pod (the node label on Kubernetes
    # without AMPSCOPE_NODE) or node label changes between runs.
    assert runs.startswith("count by (device) ( max by (device, run) (")
    alert = alert_rules()["AmpscopeRepeatOffenderDevice"]
    assert alert["expr"].strip() == "ampscope_device:offending_runs:count_30d >= 2"
    assert alert["labels"]["severity"] == "warning"
    # The join reads exactly the DCGM fields `ampscope devices` reads.
    joined = recorded["ampscope_device:dcgm_errors:offenders"]["expr"]
    (fields,) = re.findall(r'__name__=~"([^"]+)"', joined)
    assert fields.split("|") == list(DCGM_FIELDS)
    assert "and on (UUID)" in joined
    # Both spellings of DCGM-exporter's labels: uuid (--use-old-namespace), Hostname.
    assert '"UUID", "$1", "uuid", "(.+)"' in joined
    assert '"hostname", "$1", "Hostname", "(.+)"' in joined


def test_the_stopped_alert_reads_the_verdicts_live_states_and_matches_worlds_by_label() -> None:
    """``stopped_rank``'s definition (``liveness.stopped_alone``): live is the verdicts'
    ``LIVE_STATES``, the id must be held by no live rank on any exporter, and the world is
    matched by ``world_size`` (an elastic shrink's old ids declared the old size)."""
    rule = alert_rules()["AmpscopeRankStopped"]
    assert rule["labels"]["severity"] == "warning"
    expr = " ".join(rule["expr"].split())
    live = f'ampscope_rank_state{{state=~"{"|".join(LIVE_STATES)}"}} == 1'
    assert f"unless on (run, rank) ({live})" in expr
    assert "and on (run, world_size)" in expr
    assert 'ampscope_rank_state{state="stopped"} == 1' in expr
