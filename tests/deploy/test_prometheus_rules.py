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
from ampscope.exporter.metrics.catalogue import BY_NAME, SCALER_ONLY
from ampscope.verdicts.fp8 import Fp8Rule
from ampscope.verdicts.thresholds import Thresholds

ALERTS = {
    "AmpscopeScaleCollapse",
    "AmpscopeSkipStorm",
    "AmpscopeScaleDesync",
    "AmpscopeRankLost",
    "AmpscopeRankStalled",
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
    known = set(BY_NAME) | set(recording_rules())
    for rule in [*alert_rules().values(), *recording_rules().values()]:
        names = metric_names(rule["expr"])
        assert names, rule
        assert names <= known, (rule.get("alert") or rule.get("record"), names - known)


def test_alert_thresholds_are_the_shared_defaults() -> None:
    alerts = alert_rules()
    recorded = recording_rules()
    collapse = alerts["AmpscopeScaleCollapse"]["expr"]
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
        assert f'increase(ampscope_spikes_total{{kind="{kind}"}}{window})' in expr, name
        assert ") > 0\n" in expr, name
        assert alerts[name]["labels"]["severity"] == "warning", name
    # The grad norm is the same on every rank: one alert per run, not one per rank.
    assert alerts["AmpscopeGradNormSpike"]["expr"].startswith("max by (run) (")


def test_rerun_alerts_read_the_counter_by_result_with_the_verdicts_window() -> None:
    alerts = alert_rules()
    transient = alerts["AmpscopeTransientFault"]
    assert transient["labels"]["severity"] == "critical"
    assert 'ampscope_reruns_total{result="transient"} > 0' in transient["expr"]
    reproducible = alerts["AmpscopeReproducibleFault"]
    assert reproducible["labels"]["severity"] == "warning"
    expr = " ".join(reproducible["expr"].split())
    window = f"[{Thresholds().spike_verdict_window_s / 60:g}m]"
    counter = 'ampscope_reruns_total{result="reproducible"}'
    assert f"increase({counter}{window}) > 0" in expr
    # The counter appears once non-zero, at 1: a series new within the window counts too.
    assert f"{counter} * 1 unless {counter} offset {window[1:-1]}" in expr
    # The on-call finds the batch ids in the exporter, not in Prometheus.
    assert "--suspect-batches" in reproducible["annotations"]["description"]


def test_no_alert_fires_for_a_finished_rank() -> None:
    # Rank-state alerts select their state; every other alert excludes finished ranks (a
    # run-level alert: runs whose every rank finished). promtool proves it on data.
    finished = 'ampscope_rank_state{state="finished"} == 1'
    for name, rule in alert_rules().items():
        expr = " ".join(rule["expr"].split())
        if name in DEVICE_ALERTS:
            continue  # about finished runs by design: a device's record across them
        if name in ("AmpscopeRankLost", "AmpscopeRankStalled", "AmpscopeRankFailed"):
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
    # Only NaN differs from itself; a NaN sample makes the window's sum NaN.
    assert expr.startswith(
        f"sum_over_time(ampscope_fp8_amax{window}) != sum_over_time(ampscope_fp8_amax{window})"
    )
    # A skipped overflow iteration is not judged by the verdict; the alert leaves it out too.
    assert (
        "unless on (run, node, rank, local_rank) "
        f"increase(ampscope_skipped_steps_total{window}) > 0" in expr
    )
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
    assert "max_over_time(ampscope_device_offences_total[30d])" in runs
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
