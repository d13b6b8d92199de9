"""End to end with a real Prometheus: the demo trains, Prometheus scrapes the exporter every
second and evaluates the real rules, then every dashboard and alert expression must return data.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from deploy_files import (
    RULES_FILE,
    alert_rules,
    dashboard_expressions,
    dashboards,
    recording_rules,
    substitute,
)
from support import (
    DEADLOCK_GUARD_S,
    free_port,
    get_json,
    need_tool,
    rules_evaluated_after,
    start_prometheus,
    stop_process,
)

from ampscope.demo.exporter import ExporterProcess

PREFIX = "e2e"
STEPS = 60
"""increase() cannot count what a counter held at its first scrape, so the hotspot run needs
a margin over the alert's 5 detections: 12 outliers, 1 s scrapes, a 0.1 s step delay."""
STALE_AFTER_S = 6.0
"""Long enough for the ranks to stay up until the demo has exited."""

pytestmark = [pytest.mark.prometheus, pytest.mark.distributed]


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        params = urllib.parse.urlencode({"query": expr, "time": f"{at:.3f}"})
        answer = get_json(f"{self.url}/api/v1/query?{params}")
        assert answer["status"] == "success", (expr, answer)
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[str, Prometheus, Path]]:
    need_tool("prometheus")
    workdir = Path(tempfile.mkdtemp(prefix="ampscope-e2e-"))
    exporter_port = free_port()
    exporter = ExporterProcess(exporter_port, stale_after=STALE_AFTER_S)
    exporter.start()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES_FILE)],
        "scrape_configs": [
            {
                "job_name": "ampscope",
                "static_configs": [{"targets": [f"127.0.0.1:{exporter_port}"]}],
            }
        ],
    }
    prometheus = None
    try:
        prometheus, prometheus_url = start_prometheus(config, workdir)
        yield exporter.url, Prometheus(prometheus_url), workdir
    finally:
        if prometheus is not None:
            stop_process(prometheus)
        exporter.stop()


def test_every_dashboard_and_alert_expression_returns_data(
    stack: tuple[str, Prometheus, Path],
) -> None:
    exporter_url, prometheus, workdir = stack
    demo = subprocess.Popen(
        [
            *(sys.executable, "-m", "ampscope.cli", "demo", "--exporter-url", exporter_url),
            *("--steps", str(STEPS), "--run-prefix", PREFIX, "--step-delay", "0.1"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert demo.stdout is not None
    lines, live = [], 0.0
    for line in demo.stdout:
        lines.append(line)
        if line.startswith(f"step {STEPS:>4}/{STEPS}"):
            # Every rank took its last step and has not closed its scaler yet: what
            # Prometheus scraped until now shows the runs running.
            live = time.time()
    output = "".join(lines)
    assert demo.wait(240) == 0, output
    assert live, output

    # Then the ranks, done training, closed their scalers: every rank finished.
    deadline = time.monotonic() + DEADLOCK_GUARD_S
    while not (
        scraped := prometheus.query(
            'timestamp(count(ampscope_rank_state{state="finished"} == 1)'
            " == count(ampscope_rank_up))",
            time.time(),
        )
    ):
        assert time.monotonic() < deadline, "not every rank finished"
        time.sleep(0.5)
    # The rules evaluated after the scrape that saw them finished.
    while not rules_evaluated_after(prometheus.url, float(scraped[0]["value"][1])):
        assert time.monotonic() < deadline, "the rules were not evaluated since"
        time.sleep(0.5)
    finished = time.time()

    def evaluate(expr: str) -> list[dict[str, Any]]:
        # Rank-level state is checked while the ranks ran, lifecycle once they finished.
        return prometheus.query(expr, live) or prometheus.query(expr, finished)

    # The PromQL the demo suggests at its end works as printed.
    suggested = output.split("PromQL", 1)[1].splitlines()[1:]
    suggested = [line.split("#")[0].strip() for line in suggested if line.startswith("    ")]
    assert len(suggested) >= 3, output
    unanswered = [expr for expr in suggested if not evaluate(expr)]
    assert not unanswered, f"suggested PromQL without data: {unanswered}"

    (dashboard,) = dashboards().values()
    # The demo's scalers report their loss and gradient norms (stats are on by default), so
    # the loss and gradient-norm panels have data like every other panel.
    assert evaluate("ampscope_loss"), "the demo's ranks reported no loss"
    empty = [
        (title, expr)
        for title, expr in dashboard_expressions(dashboard)
        if not evaluate(substitute(expr))
    ]
    # These panels are empty by design here, and must be: the demo's ranks all end normally
    # (a "Failed ranks" row would be a rank that failed) and never pause, no DCGM-exporter
    # runs beside it, the demo's models hold no FP8 (torchao Float8Linear) layers, so no rank
    # exports the FP8 row's series (tests/exporter/fp8 and tests/rank/fp8 cover those).
    expected_empty = {
        "Failed ranks",
        # No demo rank pauses (paused("checkpoint")); tests/exporter/api/routes/
        # test_heartbeat.py proves the series it reads.
        "Paused ranks",
        "DCGM errors of offending devices",
        "FP8 amax per layer, log10 (rank $fp8_rank)",
        "FP8 underflow ratio per layer (rank $fp8_rank)",
        "FP8 scale per layer (rank $fp8_rank)",
        "FP8 non-finite amax observations (rank $fp8_rank)",
        # The demo's runs check no replicas (attach(model, replica_check_every=N)).
        "Replica checks that diverged",
    }
    assert {title for title, _ in empty} == expected_empty, (
        f"dashboard queries without data: {empty}"
    )
    # The DCGM join needs DCGM-exporter's series, which this test has none of.
    unrecorded = [
        name
        for name, rule in recording_rules().items()
        if name != "ampscope_device:dcgm_errors:offenders" and not evaluate(rule["expr"])
    ]
    assert not unrecorded, f"recording rules without data: {unrecorded}"

    # The demo is built so that every alert's condition holds, each on the run meant to.
    alerts = alert_rules()
    hits = {name: evaluate(rule["expr"]) for name, rule in alerts.items()}

    def runs(name: str) -> set[str]:
        return {sample["metric"]["run"] for sample in hits[name]}

    assert runs("AmpscopeScaleCollapse") == {f"{PREFIX}-collapse"}
    assert f"{PREFIX}-collapse" in runs("AmpscopeSkipStorm")
    assert runs("AmpscopeScaleDesync") == {f"{PREFIX}-desync"}
    assert runs("AmpscopeRankLost") == runs("AmpscopeRankStalled") == set()
    # Its exporter answers every scrape: no rank is gone with it.
    assert runs("AmpscopeNodeLost") == set()
    # The rerun run: rank 0's one-time fault pages, rank 1's NaN sample warns, no one else's.
    assert [s["metric"]["rank"] for s in hits["AmpscopeTransientFault"]] == ["0"]
    assert [s["metric"]["rank"] for s in hits["AmpscopeReproducibleFault"]] == ["1"]
    assert (
        runs("AmpscopeTransientFault") == runs("AmpscopeReproducibleFault") == {f"{PREFIX}-rerun"}
    )
    # The hotspot run names its outlier rank alone. Other runs are not asserted quiet:
    # increase() cannot count what a counter already held at its first scrape, so when the
    # overflow run's first overflows (on both ranks) land before Prometheus' first scrape of
    # it, which depends on the machine's speed, its later overflows (mostly rank 1's) can
    # reach the 80% share. The rule's exact arithmetic is proved by the promtool tests.
    hotspot = [s["metric"] for s in hits["AmpscopeInfHotspot"]]
    assert [m["rank"] for m in hotspot if m["run"] == f"{PREFIX}-hotspot"] == ["1"]

    # The spike run's one bad batch on rank 1, as Prometheus holds it once every rank
    # finished: a loss spike and an origin outlier on rank 1, the shared norm's spike on both.
    spiked = prometheus.query(f'ampscope_spikes_total{{run="{PREFIX}-spike"}} > 0', finished)
    assert sorted((s["metric"]["kind"], s["metric"]["rank"], s["value"][1]) for s in spiked) == [
        ("grad_norm", "0", "1"),
        ("grad_norm", "1", "1"),
        ("loss", "1", "1"),
        ("origin_outlier", "1", "1"),
    ]

    # Prometheus itself loaded the rules and started the collapse alert's `for:` clock.
    groups = get_json(f"{prometheus.url}/api/v1/rules")["data"]["groups"]
    loaded = {rule["name"] for group in groups for rule in group["rules"]}
    assert set(alerts) | set(recording_rules()) <= loaded
    # (ALERTS holds Prometheus' pending and firing alerts over time.)
    active = {sample["metric"]["alertname"] for sample in prometheus.query("ALERTS", live)}
    assert "AmpscopeScaleCollapse" in active, (workdir / "prometheus.log").read_text()[-2000:]
    # Once the runs finished, no alert's condition holds for any of them. The repeat-offender
    # alert is about a device across runs, finished ones included (tests/devices).
    per_run = {n: rule for n, rule in alerts.items() if n != "AmpscopeRepeatOffenderDevice"}
    still = {
        name: sorted({s["metric"]["run"] for s in prometheus.query(rule["expr"], finished)})
        for name, rule in per_run.items()
    }
    assert still == {name: [] for name in per_run}, still
