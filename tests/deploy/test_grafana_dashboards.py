"""The Grafana dashboard JSON and provisioning files."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_files import (
    DASHBOARD_DIR,
    DASHBOARD_GENERATOR,
    dashboard_differences,
    dashboard_expressions,
    dashboards,
    generated_dashboard,
    metric_names,
    panels,
    recording_rules,
    selected_families,
    substitute,
)
from support import need_module, need_tool

from ampscope.exporter.metrics.catalogue import BY_NAME, RANK_LABELS, SCALER_ONLY

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RANK_FAMILIES = {spec.name for spec in BY_NAME.values() if spec.labels[:4] == RANK_LABELS}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    found = dashboards()
    assert list(found) == ["ampscope.json"]
    return found["ampscope.json"]


def test_dashboard_identity_and_schema(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "ampscope-loss-scaling"
    assert dashboard["schemaVersion"] >= 39
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    kinds = {p["type"] for p in panels(dashboard)}
    assert "timeseries" in kinds
    assert "graph" not in kinds  # the pre-8.0 panel type


def test_committed_json_is_what_the_generator_writes(dashboard: dict[str, Any]) -> None:
    # The dashboard is written from Python (grafana-foundation-sdk); a hand edit of the JSON,
    # or a generator change not written out, shows here with the panel it touches.
    need_module("grafana_foundation_sdk")
    text = generated_dashboard()
    regenerate = (
        f"regenerate with: python {DASHBOARD_GENERATOR.relative_to(DASHBOARD_DIR.parent)} --write"
    )
    differences = dashboard_differences(dashboard, json.loads(text))
    assert not differences, "\n".join([regenerate, *differences])
    # Same content: the committed text is byte for byte the generator's (a reformatted
    # file would make the next regeneration a noisy diff).
    assert (DASHBOARD_DIR / "ampscope.json").read_text() == text, regenerate


def test_dashboard_differences_name_the_panel() -> None:
    committed = {
        "uid": "u",
        "panels": [{"id": 1, "title": "Loss", "fieldConfig": {"defaults": {"unit": "short"}}}],
    }
    generated = {
        "uid": "u",
        "panels": [{"id": 1, "title": "Loss", "fieldConfig": {"defaults": {"unit": "s"}}}],
    }
    assert dashboard_differences(committed, generated) == [
        'panel 1 (\'Loss\'): fieldConfig.defaults.unit: committed "short", generated "s"'
    ]
    assert dashboard_differences(committed, committed) == []


def test_panels_tile_the_grid_under_their_rows(dashboard: dict[str, Any]) -> None:
    # Grafana pushes overlapping panels down and files a panel under the row above it on
    # screen, not the one before it in the file: the file's order must be the screen's.
    boxes = [(p["title"], p["type"], p["gridPos"]) for p in dashboard["panels"]]
    cells: dict[tuple[int, int], str] = {}
    for title, _, grid in boxes:
        assert grid["x"] + grid["w"] <= 24, title
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{title!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = title
    tops = [(grid["y"], grid["x"]) for _, _, grid in boxes]
    assert tops == sorted(tops), "panels are not in screen order"
    rows = [grid["y"] for _, kind, grid in boxes if kind == "row"]
    assert rows[0] == 0, "the first row is not at the top"
    # No gap: each row starts where the panels above it end.
    bottom = 0
    for title, kind, grid in boxes:
        if kind == "row":
            assert grid["y"] == bottom, title
        bottom = max(bottom, grid["y"] + grid["h"])


def test_variables_are_chained(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(variables) == {"datasource", "run", "node", "rank", "fp8_rank"}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    # Every rank exports ampscope_rank_info, scaler or watch: a bf16 run, which has no
    # ampscope_loss_scale, is still listed.
    assert variables["run"]["definition"] == "label_values(ampscope_rank_info, run)"
    assert variables["node"]["definition"] == 'label_values(ampscope_rank_info{run=~"$run"}, node)'
    assert (
        variables["rank"]["definition"]
        == 'label_values(ampscope_rank_info{run=~"$run", node=~"$node"}, rank)'
    )
    for name in ("run", "node", "rank"):
        assert variables[name]["datasource"] == DATASOURCE
        assert variables[name]["includeAll"]
        assert variables[name]["allValue"] == ".*"
        assert variables[name]["query"]["query"] == variables[name]["definition"]
    # The FP8 row draws one rank's layers: one rank of those exporting FP8 series.
    fp8_rank = variables["fp8_rank"]
    assert (
        fp8_rank["definition"]
        == 'label_values(ampscope_fp8_amax{run=~"$run", node=~"$node"}, rank)'
    )
    assert fp8_rank["query"]["query"] == fp8_rank["definition"]
    assert not fp8_rank["multi"]
    assert not fp8_rank["includeAll"]


def test_fp8_row_draws_one_ranks_layers_as_heatmaps_of_layers_by_time(
    dashboard: dict[str, Any],
) -> None:
    by_title = {p["title"]: p for p in panels(dashboard)}
    selector = 'run=~"$run", node=~"$node", rank=~"$fp8_rank"'
    for title, expr in (
        ("FP8 amax per layer, log10 (rank $fp8_rank)", f"log10(ampscope_fp8_amax{{{selector}}})"),
        (
            "FP8 underflow ratio per layer (rank $fp8_rank)",
            f"ampscope_fp8_underflow_ratio{{{selector}}}",
        ),
    ):
        panel = by_title[title]
        assert panel["type"] == "heatmap", title
        # The series are the rows (no buckets computed), named by layer and tensor, and no
        # value is filtered out (the SDK's default hides values at or below 1e-9).
        assert panel["options"]["calculate"] is False, title
        assert panel["options"]["rowsFrame"]["layout"] == "unknown", title
        assert panel["options"]["filterValues"] == {}, title
        (target,) = panel["targets"]
        assert target["expr"] == expr, title
        assert target["legendFormat"] == "{{layer}} {{tensor}}", title
        assert not target["instant"], title
    underflow = by_title["FP8 underflow ratio per layer (rank $fp8_rank)"]["options"]["color"]
    assert (underflow["min"], underflow["max"]) == (0, 1)
    scale = by_title["FP8 scale per layer (rank $fp8_rank)"]
    assert scale["targets"][0]["expr"] == f"ampscope_fp8_scale{{{selector}}}"


def test_every_panel_and_target_uses_the_datasource_variable(dashboard: dict[str, Any]) -> None:
    for panel in panels(dashboard):
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]


def test_expressions_use_catalogued_metrics_and_cover_the_catalogue(
    dashboard: dict[str, Any],
) -> None:
    used: set[str] = set()
    for title, expr in dashboard_expressions(dashboard):
        names = metric_names(expr)
        assert names, (title, expr)
        # Raw families, or the shipped recording rules where the raw query is slow at
        # scale (docs/performance.md, "Whole job at scale"), or ``up``, which Prometheus
        # writes for every scrape (the counts of counters exposed once non-zero read it).
        known = set(BY_NAME) | set(recording_rules()) | {"up"}
        assert names <= known, (title, names - known)
        used |= selected_families(expr) - {"up"}
    # Every family, per-rank, per-device and exporter self-metrics alike, is on some panel.
    assert used == set(BY_NAME)


def test_every_expression_is_valid_promql(dashboard: dict[str, Any], tmp_path: Path) -> None:
    # promtool parses expressions only inside rules, so each one becomes a recording rule.
    expressions = [substitute(expr) for _, expr in dashboard_expressions(dashboard)]
    rules = [{"record": f"dashboard:expr:{i}", "expr": e} for i, e in enumerate(expressions)]
    path = tmp_path / "dashboard-expressions.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(
        [need_tool("promtool"), "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_per_rank_selectors_follow_the_variables(dashboard: dict[str, Any]) -> None:
    for title, expr in dashboard_expressions(dashboard):
        for name in metric_names(expr) & RANK_FAMILIES:
            for selector in re.findall(rf"\b{name}\{{([^}}]*)\}}", expr) or [""]:
                assert 'run=~"$run"' in selector, (title, expr)
    # The panels that show individual ranks filter on all three variables.
    selector = 'run=~"$run", node=~"$node", rank=~"$rank"'
    by_title = dict(dashboard_expressions(dashboard))
    assert selector in by_title["Loss scale per rank"]


def test_loss_scale_axis_is_log2(dashboard: dict[str, Any]) -> None:
    (panel,) = [p for p in panels(dashboard) if p["title"] == "Loss scale per rank"]
    distribution = panel["fieldConfig"]["defaults"]["custom"]["scaleDistribution"]
    assert distribution == {"type": "log", "log": 2}


def test_provisioning_points_grafana_at_prometheus_and_the_dashboards() -> None:
    (datasources,) = (DASHBOARD_DIR / "provisioning" / "datasources").glob("*.yml")
    (source,) = yaml.safe_load(datasources.read_text())["datasources"]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    (providers,) = (DASHBOARD_DIR / "provisioning" / "dashboards").glob("*.yml")
    (provider,) = yaml.safe_load(providers.read_text())["providers"]
    assert provider["type"] == "file"
    # docker-compose.yml mounts ./dashboards at this path.
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"


def test_mode_policy_and_inf_updates_are_shown(dashboard: dict[str, Any]) -> None:
    by_title = {p["title"]: p for p in panels(dashboard)}
    (table,) = [
        p for p in by_title.values() if p["type"] == "table" and "mode" in p["title"].lower()
    ]
    (expr,) = [t["expr"] for t in table["targets"]]
    assert metric_names(expr) == {"ampscope_rank_info"}
    shown = table["transformations"][0]["options"]["indexByName"]
    assert {"run", "rank", "mode", "policy", "grad_dtype"} <= set(shown)
    modes = by_title["Ranks by mode and policy"]
    assert "no loss scale" in modes["targets"][0]["expr"]
    applied = by_title["Optimizer steps on inf/NaN gradients"]
    (expr,) = [t["expr"] for t in applied["targets"]]
    assert metric_names(expr) == {"ampscope_nonfinite_updates_applied_total"}
    red = applied["fieldConfig"]["defaults"]["thresholds"]["steps"][-1]
    assert (red["color"], red["value"]) == ("red", 1)


def test_scale_panels_draw_only_what_scaler_ranks_export(dashboard: dict[str, Any]) -> None:
    # A watch rank exports none of SCALER_ONLY, so a panel reading only those families (and
    # no ampscope_loss_scale made up from other series) shows scaler ranks alone; the row
    # says why a bf16 run leaves it empty.
    for title, expr in dashboard_expressions(dashboard):
        names = metric_names(expr)
        if names & SCALER_ONLY:
            assert names <= SCALER_ONLY, (title, names - SCALER_ONLY)
    (row,) = [p for p in dashboard["panels"] if p["type"] == "row" and "scale" in p["title"]]
    assert "watch ranks have none" in row["title"]


def test_loss_and_norms_per_rank_on_log_axes_and_spikes_marked(
    dashboard: dict[str, Any], tmp_path: Path
) -> None:
    by_title = {p["title"]: p for p in panels(dashboard)}
    selector = 'run=~"$run", node=~"$node", rank=~"$rank"'
    for title, family in (
        ("Loss per rank", "ampscope_loss"),
        ("Gradient norm per rank", "ampscope_grad_norm"),
        ("Own (origin) gradient norm per rank", "ampscope_grad_norm_origin"),
    ):
        panel = by_title[title]
        (target,) = panel["targets"]
        assert target["expr"] == f"{family}{{{selector}}}", title
        assert "{{rank}}" in target["legendFormat"], title  # one line per rank
        distribution = panel["fieldConfig"]["defaults"]["custom"]["scaleDistribution"]
        assert distribution == {"type": "log", "log": 10}, title
    spikes = [t["expr"] for t in by_title["Spike iterations"]["targets"]]
    assert all("ampscope_spikes_total" in expr for expr in spikes)
    # The grad norm is the same on every rank: counted once per run, not summed.
    assert any(expr.startswith("max by (run) (") and 'kind="grad_norm"' in expr for expr in spikes)
    # Spike times are marked on every time series panel, by a Prometheus annotation.
    (marks,) = [a for a in dashboard["annotations"]["list"] if a.get("name") == "Spikes"]
    assert marks["datasource"] == DATASOURCE
    assert metric_names(marks["expr"]) == {"ampscope_spikes_total"}
    assert selector in marks["expr"]
    path = tmp_path / "annotation.yml"
    rule = {"record": "dashboard:annotation", "expr": substitute(marks["expr"])}
    path.write_text(yaml.safe_dump({"groups": [{"name": "a", "rules": [rule]}]}))
    result = subprocess.run(
        [need_tool("promtool"), "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _reruns_panel(dashboard: dict[str, Any]) -> dict[str, Any]:
    (panel,) = [p for p in panels(dashboard) if p["id"] == 43]
    return panel


def test_reruns_panel_draws_transient_and_reproducible_apart(dashboard: dict[str, Any]) -> None:
    panel = _reruns_panel(dashboard)
    assert panel["title"] == "Reruns of flagged iterations"
    targets = {t["refId"]: t for t in panel["targets"]}
    assert set(targets) == {"A", "B"}
    assert 'result="transient"' in targets["A"]["expr"]
    assert 'result="reproducible"' in targets["B"]["expr"]
    assert targets["A"]["legendFormat"].startswith("transient (device): ")
    assert targets["B"]["legendFormat"].startswith("reproducible (data): ")
    colors = {
        o["matcher"]["options"]: o["properties"]
        for o in panel["fieldConfig"]["overrides"]
        if o["matcher"]["id"] == "byFrameRefID"
    }
    assert colors == {
        "A": [{"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}}],
        "B": [{"id": "color", "value": {"mode": "fixed", "fixedColor": "orange"}}],
    }
    assert "--suspect-batches" in panel["description"]


@pytest.mark.prometheus
def test_reruns_panel_counts_a_series_first_rerun(
    dashboard: dict[str, Any], tmp_path: Path
) -> None:
    """ampscope_reruns_total appears at 1 (exposed once non-zero), which increase() alone
    never counts: promtool evaluates the panel's queries on such a series."""
    targets = {t["refId"]: substitute(t["expr"]) for t in _reruns_panel(dashboard)["targets"]}
    labels = 'run="r",node="n0",rank="0",local_rank="0"'
    rules = tmp_path / "panel.yml"
    recorded = [
        {"record": "panel:transient", "expr": targets["A"]},
        {"record": "panel:reproducible", "expr": targets["B"]},
    ]
    rules.write_text(yaml.safe_dump({"groups": [{"name": "panel", "rules": recorded}]}))
    # Rank 0: a transient rerun appears at 1m (value 1) and a second at 5m; a reproducible
    # one appears at 3m. Scraped every 15 s.
    series = [
        {"series": f'ampscope_reruns_total{{{labels},result="transient"}}',
         "values": "_x3 1x15 2x20"},
        {"series": f'ampscope_reruns_total{{{labels},result="reproducible"}}',
         "values": "_x11 1x30"},
    ]  # fmt: skip

    def at(minutes: str, record: str, value: float | None) -> dict[str, Any]:
        result = record.split(":")[1]
        named = f'{record}{{{labels},result="{result}"}}'
        samples = [] if value is None else [{"labels": named, "value": value}]
        return {"expr": record, "eval_time": minutes, "exp_samples": samples}

    checks = [
        at("1m", "panel:transient", 1),  # the first rerun: the series' first sample
        at("1m", "panel:reproducible", None),
        at("3m", "panel:transient", None),  # nothing new within the last minute
        at("3m", "panel:reproducible", 1),
        at("5m30s", "panel:transient", 1),  # the second: increase() counts it
        at("8m", "panel:reproducible", None),
    ]
    tests = tmp_path / "panel-test.yml"
    tests.write_text(
        yaml.safe_dump(
            {
                "rule_files": [rules.name],
                "evaluation_interval": "15s",
                "tests": [{"interval": "15s", "input_series": series, "promql_expr_test": checks}],
            }
        )
    )
    result = subprocess.run(
        [need_tool("promtool"), "test", "rules", tests.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.prometheus
def test_reruns_panel_draws_no_old_rerun_again_after_a_failed_scrape(
    dashboard: dict[str, Any], tmp_path: Path
) -> None:
    """A failed scrape writes a staleness marker on each of the exporter's series: one
    interval later, an old rerun's counter is not drawn as new (as the alerts count it,
    deploy/prometheus/tests/ampscope-gaps-test.yml); a rerun during the gap is."""
    targets = {t["refId"]: substitute(t["expr"]) for t in _reruns_panel(dashboard)["targets"]}
    rules = tmp_path / "panel.yml"
    recorded = [{"record": "panel:transient", "expr": targets["A"]}]
    rules.write_text(yaml.safe_dump({"groups": [{"name": "panel", "rules": recorded}]}))
    target = 'job="ampscope",instance="n0:9478"'
    labels = {r: f'run="r",node="n0",rank="{r}",local_rank="{r}",{target}' for r in (0, 1)}
    # Both ranks' transient reruns at 45s; the scrape at 10m fails (up 0, staleness markers);
    # rank 1 reruns again then.
    series = [
        {"series": f"up{{{target}}}", "values": "1x39 0 1x20"},
        {"series": f'ampscope_reruns_total{{{labels[0]},result="transient"}}',
         "values": "_x3 1x36 stale 1x20"},
        {"series": f'ampscope_reruns_total{{{labels[1]},result="transient"}}',
         "values": "_x3 1x36 stale 2x20"},
    ]  # fmt: skip
    named = f'panel:transient{{{labels[1]},result="transient"}}'
    checks = [{"expr": "panel:transient", "eval_time": "11m",
               "exp_samples": [{"labels": named, "value": 1}]}]  # fmt: skip
    tests = tmp_path / "panel-test.yml"
    tests.write_text(
        yaml.safe_dump(
            {
                "rule_files": [rules.name],
                "evaluation_interval": "15s",
                "tests": [{"interval": "15s", "input_series": series, "promql_expr_test": checks}],
            }
        )
    )
    result = subprocess.run(
        [need_tool("promtool"), "test", "rules", tests.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.prometheus
def test_replica_panel_draws_diverged_checks_a_series_first_included(
    dashboard: dict[str, Any], tmp_path: Path
) -> None:
    """ampscope_replica_checks_total{result="diverged"} appears at 1 (exposed once
    non-zero): the panel shows it from that first sample; agreeing checks draw nothing."""
    (panel,) = [p for p in panels(dashboard) if p["id"] == 44]
    assert panel["title"] == "Replica checks that diverged"
    (target,) = panel["targets"]
    assert 'result="diverged"' in target["expr"]
    labels = 'run="r",node="n0",rank="2",local_rank="0"'
    rules = tmp_path / "panel.yml"
    recorded = [{"record": "panel:diverged", "expr": substitute(target["expr"])}]
    rules.write_text(yaml.safe_dump({"groups": [{"name": "panel", "rules": recorded}]}))
    # Agreeing checks from the start; the first diverged check at 1m, the next at 2m15s.
    series = [
        {"series": f'ampscope_replica_checks_total{{{labels},result="agree"}}',
         "values": "1+1x40"},
        {"series": f'ampscope_replica_checks_total{{{labels},result="diverged"}}',
         "values": "_x4 1x4 2x30"},
    ]  # fmt: skip
    named = f'panel:diverged{{{labels},result="diverged"}}'
    one = [{"labels": named, "value": 1}]
    checks = [
        {"expr": "panel:diverged", "eval_time": "45s", "exp_samples": []},
        {"expr": "panel:diverged", "eval_time": "1m", "exp_samples": one},  # its first sample
        {"expr": "panel:diverged", "eval_time": "2m30s", "exp_samples": one},  # increase()
    ]
    tests = tmp_path / "panel-test.yml"
    tests.write_text(
        yaml.safe_dump(
            {
                "rule_files": [rules.name],
                "evaluation_interval": "15s",
                "tests": [{"interval": "15s", "input_series": series, "promql_expr_test": checks}],
            }
        )
    )
    result = subprocess.run(
        [need_tool("promtool"), "test", "rules", tests.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
