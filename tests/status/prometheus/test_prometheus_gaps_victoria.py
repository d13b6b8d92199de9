"""Counters counted within a window across gaps in the scrapes, on VictoriaMetrics, as
VictoriaMetrics and vmalert evaluate them: those exposed once non-zero within the verdicts' 10
minutes (``ampscope status --prometheus``'s ``counted_within`` and AmpscopeTransientFault,
AmpscopeReproducibleFault, AmpscopeFp8NonfiniteAmax), and those exposed from a rank's start
(``grown_within``: the skip storm, the hotspot and the spike alerts, their recording rules and
status's queries).

Samples are imported with timestamps, a gap as scrapes with no sample (the import carries
no staleness markers; promtool's tests cover those). VictoriaMetrics' ``increase()`` counts
a series' first sample where none lies within its lookback before the window: after a gap
longer than that, an old count would read as new: a healthy rank's lifetime skips, found-inf
detections or spikes paged the skip storm, the hotspot or a spike for 10 minutes after its
exporter was unreachable for more than 5 minutes.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import need_tool

from ampscope.status import prometheus
from ampscope.verdicts.thresholds import Thresholds
from bench.servers import victoria_metrics
from bench.victoria import VictoriaClient

RUN = "vm-gaps"
SCRAPE_S = 15
SCRAPES = 190
RULES = Path(__file__).parents[3] / "deploy" / "prometheus" / "rules" / "ampscope-alerts.yml"
ALERTS = ("AmpscopeTransientFault", "AmpscopeReproducibleFault", "AmpscopeFp8NonfiniteAmax")
COUNTERS = (
    ("ampscope_reruns_total", 'result="transient"'),
    ("ampscope_reruns_total", 'result="reproducible"'),
    ("ampscope_fp8_nonfinite_amax_total", 'layer="layers.0",tensor="input"'),
)


def _gap(first: int, last: int) -> set[int]:
    return set(range(first, last + 1))


# Per rank, each on its own exporter (scrape index: 15 s each): the scrapes that failed (up 0,
# no sample of the exporter's series), the scrapes at which its exporter counted zero after
# its restart (the counter absent while scrapes succeed), and the counter's value from each
# index on.
RANKS: dict[int, dict[str, Any]] = {
    # A fault at 45s; a minute of failed scrapes from 29m45s; nothing since.
    0: {"failed": _gap(119, 122), "zero": set(), "counts": {3: 1}},
    # A fault at 45s; scrapes fail from 25m to 33m, and a fault happened meanwhile.
    1: {"failed": _gap(100, 131), "zero": set(), "counts": {3: 1, 132: 2}},
    # A fault at 45s; the exporter restarts at 25m and counts from zero until a fault at 33m.
    2: {"failed": _gap(100, 103), "zero": _gap(104, 131), "counts": {3: 1, 132: 1}},
    # Its first fault at 35m.
    3: {"failed": set(), "zero": set(), "counts": {140: 1}},
    # A fault at 45s; scrapes fail from 25m to 33m; nothing since.
    6: {"failed": _gap(100, 131), "zero": set(), "counts": {3: 1}},
}
HEALTHY_AFTER_GAPS = {0, 6}
COUNTED = {  # scrape index -> the ranks counted then, each once
    133: {1},
    140: {1, 3},
    159: {1, 2, 3},
    165: {1, 2, 3},
    175: {3},
}


def _value(counts: dict[int, int], index: int) -> int:
    return max((value for at, value in counts.items() if at <= index), default=0)


def _exposition(start: float) -> str:
    lines = []
    for rank, shape in RANKS.items():
        target = f'instance="n{rank}:9478"'
        labels = f'run="{RUN}",node="n{rank}",rank="{rank}",local_rank="0",{target}'
        for index in range(SCRAPES):
            ms = int((start + index * SCRAPE_S) * 1000)
            if index in shape["failed"]:
                lines.append(f"up{{{target}}} 0 {ms}")
                continue
            lines.append(f"up{{{target}}} 1 {ms}")
            lines.append(f'ampscope_rank_info{{{labels},mode="scaler"}} 1 {ms}')
            value = 0 if index in shape["zero"] else _value(shape["counts"], index)
            if value:  # exposed once non-zero
                lines.extend(
                    f"{family}{{{labels},{more}}} {value} {ms}" for family, more in COUNTERS
                )
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def victoria(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VictoriaClient, float]]:
    """(a client of VictoriaMetrics holding the scrapes, the first scrape's time)."""
    path = need_tool("victoria-metrics")
    with victoria_metrics(path, tmp_path_factory.mktemp("victoria")) as server:
        client = VictoriaClient(server.host, server.port)
        try:
            start = float(int(time.time()) // SCRAPE_S * SCRAPE_S) - SCRAPES * SCRAPE_S
            client.import_prometheus(_exposition(start).encode(), {"job": "ampscope"})
            client.import_prometheus(_grown_exposition(start).encode(), {"job": "ampscope"})
            client.flush()
            yield client, start
        finally:
            client.close()


def _expressions() -> dict[str, str]:
    t = Thresholds()
    queries = prometheus.queries(RUN, t)
    rules = yaml.safe_load(RULES.read_text())["groups"]
    alerts = {r["alert"]: r["expr"] for g in rules for r in g["rules"] if r.get("alert")}
    return {
        "status reruns": queries["reruns"],
        "status fp8_nonfinite": queries["fp8_nonfinite"],
        **{name: alerts[name] for name in ALERTS},
    }


def test_old_faults_are_not_counted_again_after_gaps_new_ones_once(
    victoria: tuple[VictoriaClient, float],
) -> None:
    client, start = victoria
    for name, expr in _expressions().items():
        for index in range(100, SCRAPES):
            _, result = client.query(expr, start + index * SCRAPE_S)
            counted = {int(s["metric"]["rank"]): float(s["value"][1]) for s in result}
            # By rank: the status query of reruns answers a series per result, both alike.
            assert not counted.keys() & HEALTHY_AFTER_GAPS, (name, index, counted)
            if index in COUNTED:
                assert counted == dict.fromkeys(COUNTED[index], 1.0), (name, index, counted)


# Counters exposed from a rank's start (0 included), one exporter per rank, which keep counting
# while its scrapes fail. VictoriaMetrics counts a first sample from zero where it is under 10
# (and the next sample the same): a few old faults. A gap of 25 minutes:
# scrapes fail from index 40 to 139 and succeed again from 140 (35m).
GROWN_GAP = _gap(40, 139)
GROWN_SCRAPES = range(140, SCRAPES)
KINDS = ("loss", "grad_norm", "origin_outlier")


def _grown(first: int, last: int, at: int) -> int:
    """Detections counted one a scrape from ``first`` to ``last``, as of scrape ``at``."""
    return max(0, min(at, last) - first + 1)


def _healthy(index: int) -> dict[str, float]:
    # Old faults in its first minutes (9 skips, 6 detections on cuda:0, 2 spikes of each
    # kind), none since.
    old = index >= 10
    return {
        "skipped": 9 * old,
        "inf:cuda:0": 6 * old,
        **{f"spikes:{kind}": 2 * old for kind in KINDS},
    }


def _after_gap(index: int) -> dict[str, float]:
    # Old faults (2 skips, 2 detections on cuda:0, 2 loss spikes), then after the gap 5 skips
    # a scrape from 145 to 160, a detection a scrape on cuda:1 from 145 to 152, and a loss
    # spike at 150.
    old = index >= 10
    return {
        "skipped": 2 * old + 5 * _grown(145, 160, index),
        "inf:cuda:0": 2 * old,
        "inf:cuda:1": _grown(145, 152, index),
        "spikes:loss": 2 * old + (index >= 150),
        "spikes:grad_norm": 0,
        "spikes:origin_outlier": 0,
    }


def _no_gap(index: int) -> dict[str, float]:
    # Old detections on cuda:0, then new ones there from 145 to 152, scraped throughout.
    return {"skipped": 0, "inf:cuda:0": 2 * (index >= 10) + _grown(145, 152, index)}


def _new(index: int) -> dict[str, float]:
    # A rank that starts at 142 (its first scrape: nothing yet) and finds infs from 145 to 152.
    return {"skipped": 0, "inf:cuda:0": _grown(145, 152, index)}


def _quiet(index: int) -> dict[str, float]:
    return {"skipped": 0, "inf:cuda:0": 0}


# (run, rank) -> its counters by scrape index, the scrapes that failed, its first scrape, its
# steps a scrape, and whether its reporter counts the loss scaler's weather (all of it 0 here).
GROWN: dict[tuple[str, int], dict[str, Any]] = {
    ("vm-healthy", 0): {"counts": _healthy, "failed": GROWN_GAP, "first": 0, "steps": 2},
    ("vm-healthy", 1): {"counts": _quiet, "failed": GROWN_GAP, "first": 0, "weather": False},
    ("vm-healthy", 2): {"counts": _quiet, "failed": set(), "first": 0},
    ("vm-after-gap", 0): {"counts": _after_gap, "failed": GROWN_GAP, "first": 0},
    ("vm-after-gap", 1): {"counts": _quiet, "failed": set(), "first": 0},
    ("vm-no-gap", 0): {"counts": _no_gap, "failed": set(), "first": 0},
    ("vm-new", 0): {"counts": _new, "failed": set(), "first": 142},
}


def _grown_exposition(start: float) -> str:
    lines = []
    for (run, rank), shape in GROWN.items():
        target = f'instance="{run}-{rank}:9478"'
        labels = f'run="{run}",node="{run}-{rank}",rank="{rank}",local_rank="0",{target}'
        for index in range(shape["first"], SCRAPES):
            ms = int((start + index * SCRAPE_S) * 1000)
            if index in shape["failed"]:
                lines.append(f"up{{{target}}} 0 {ms}")
                continue
            lines.append(f"up{{{target}}} 1 {ms}")
            counts = shape["counts"](index)
            steps = shape.get("steps", 10) * (index - shape["first"])
            weather = shape.get("weather", True)
            lines.append(f"ampscope_steps_total{{{labels}}} {steps} {ms}")
            lines.append(f"ampscope_skipped_steps_total{{{labels}}} {counts['skipped']} {ms}")
            if weather:
                lines.append(f"ampscope_weather_skipped_steps_total{{{labels}}} 0 {ms}")
            for key, value in counts.items():
                what, _, which = key.partition(":")
                if what == "inf":
                    at = f'{labels},device="{which}"'
                    for family in ("found_inf", "found_inf_origin"):
                        lines.append(f"ampscope_{family}_total{{{at}}} {value} {ms}")
                        if weather:
                            lines.append(f"ampscope_weather_{family}_total{{{at}}} 0 {ms}")
                elif what == "spikes":
                    lines.append(f'ampscope_spikes_total{{{labels},kind="{which}"}} {value} {ms}')
    return "\n".join(lines) + "\n"


def _inlined(expr: str, recorded: dict[str, str]) -> str:
    """``expr`` with each recording rule's name replaced by its expression: VictoriaMetrics
    alone, without vmalert, holds no recorded series."""
    for name, definition in recorded.items():
        expr = re.sub(rf"\b{re.escape(name)}\b(?!:)", f"({definition})", expr)
    return expr


def _grown_alerts() -> dict[str, str]:
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    recorded = {r["record"]: r["expr"] for r in rules if r.get("record")}
    names = (
        "AmpscopeSkipStorm",
        "AmpscopeInfHotspot",
        "AmpscopeLossSpike",
        "AmpscopeGradNormSpike",
        "AmpscopeOriginOutlier",
    )
    alerts = {r["alert"]: r["expr"] for r in rules if r.get("alert")}
    return {name: _inlined(alerts[name], recorded) for name in names}


# Alert -> scrape index -> what its expression answers then (run, rank, device or "").
FIRING: dict[str, dict[int, set[tuple[str, str, str]]]] = {
    "AmpscopeSkipStorm": {
        150: {("vm-after-gap", "0", "")},
        155: {("vm-after-gap", "0", "")},
        165: {("vm-after-gap", "0", "")},
        185: set(),
    },
    "AmpscopeInfHotspot": {
        index: {
            ("vm-after-gap", "0", "cuda:1"),
            ("vm-no-gap", "0", "cuda:0"),
            ("vm-new", "0", "cuda:0"),
        }
        for index in (156, 165, 175, 183, 185)
    },
    # The spike at 150 counts while the window holds a sample from before it.
    "AmpscopeLossSpike": {index: {("vm-after-gap", "0", "")} for index in (152, 170, 188)},
    "AmpscopeGradNormSpike": {index: set() for index in (145, 160, 189)},
    "AmpscopeOriginOutlier": {index: set() for index in (145, 160, 189)},
}


def test_old_counts_of_counters_exposed_from_the_start_are_not_counted_again_after_a_gap(
    victoria: tuple[VictoriaClient, float],
) -> None:
    """A healthy rank whose exporter was unreachable for 25 minutes pages nothing when its
    scrapes resume; a skip storm, a hotspot or a spike after the gap, without a gap and on a
    new rank still does."""
    client, start = victoria
    for name, expr in _grown_alerts().items():
        for index in range(100, SCRAPES):
            _, result = client.query(expr, start + index * SCRAPE_S)
            answered = {
                (s["metric"]["run"], s["metric"].get("rank", ""), s["metric"].get("device", ""))
                for s in result
            }
            assert not {run for run, _, _ in answered} & {"vm-healthy"}, (name, index, result)
            if index in FIRING[name]:
                assert answered == FIRING[name][index], (name, index, result)


# Status query -> scrape index -> run -> what it counts (rank, device or kind -> count).
NEW_INFS = {
    "vm-after-gap": {(0, "cuda:1"): 8.0},
    "vm-no-gap": {(0, "cuda:0"): 8.0},
    "vm-new": {(0, "cuda:0"): 8.0},
}
STATUS_COUNTS: dict[str, dict[int, dict[str, dict[tuple[int, str], float]]]] = {
    "inf_origin": {156: NEW_INFS, 175: NEW_INFS},
    "inf_local": {156: NEW_INFS, 183: NEW_INFS},
    # At 165 the window's samples are 146 to 165: 82 - 12 (the growth from 145 to 146 is
    # the previous windows').
    "skipped": {155: {"vm-after-gap": {(0, ""): 55.0}}, 165: {"vm-after-gap": {(0, ""): 70.0}}},
    "skipped_nonfinite": {155: {"vm-after-gap": {(0, ""): 55.0}}},
    "spikes": {160: {"vm-after-gap": {(0, "loss"): 1.0}}},
}


def _by_rank(result: list[dict[str, Any]]) -> dict[tuple[int, str], float]:
    """(rank, device or kind) -> the count of each series that counted any."""
    counted = {}
    for sample in result:
        labels, value = sample["metric"], float(sample["value"][1])
        if value:
            what = labels.get("device") or labels.get("kind", "")
            counted[int(labels["rank"]), what] = round(value, 6)
    return counted


def test_status_counts_no_old_detection_skip_or_spike_after_a_gap(
    victoria: tuple[VictoriaClient, float],
) -> None:
    """``status --prometheus``'s windowed queries of counters exposed from a rank's start
    count what they counted within their window only, after a 25-minute gap too."""
    client, start = victoria
    for run in sorted({run for run, _ in GROWN}):
        queries = prometheus.queries(run, Thresholds())
        for name, expected in STATUS_COUNTS.items():
            for index in GROWN_SCRAPES:
                _, result = client.query(queries[name], start + index * SCRAPE_S)
                counted = _by_rank(result)
                if run == "vm-healthy":
                    assert not counted, (name, index, result)
                if index in expected:
                    assert counted == expected[index].get(run, {}), (run, name, index, result)


DASHBOARD = Path(__file__).parents[3] / "dashboards" / "ampscope.json"
COUNT_PANELS = {5, 8, 10, 11, 18, 31}
"""The dashboard's panels that count counters exposed from a rank's start per interval:
scale changes, the skip ratio, found-inf (local, origin), dropped records, spikes."""
GRAFANA = {"$__rate_interval": "1m", "$run": ".*", "$node": ".*", "$rank": ".*"}
"""Grafana's variables as the panels' queries get them (1m: four 15 s scrapes)."""


def _count_panel_queries() -> dict[str, str]:
    """(panel title and refId) -> its query, Grafana's variables replaced."""
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [
        nested
        for panel in dashboard["panels"]
        for nested in (panel.get("panels", []) if panel["type"] == "row" else [panel])
    ]
    queries = {}
    for panel in panels:
        if panel["id"] in COUNT_PANELS:
            for target in panel["targets"]:
                expr = target["expr"]
                for name in sorted(GRAFANA, key=len, reverse=True):
                    expr = expr.replace(name, GRAFANA[name])
                queries[f"{panel['title']} {target['refId']}"] = expr
    assert len({title.rsplit(" ", 1)[0] for title in queries}) == len(COUNT_PANELS)
    return queries


def test_dashboard_draws_no_old_count_after_a_gap(victoria: tuple[VictoriaClient, float]) -> None:
    """The count panels draw nothing for the healthy rank when its scrapes resume after 25
    minutes (VictoriaMetrics' increase() drew its old detections, skips and spikes again),
    and draw the new detections of the rank that found infs after the gap."""
    client, start = victoria
    queries = _count_panel_queries()
    for title, expr in queries.items():
        for index in range(140, 150):
            _, result = client.query(expr, start + index * SCRAPE_S)
            drawn = [s for s in result if s["metric"].get("run") == "vm-healthy"]
            assert not [s for s in drawn if float(s["value"][1]) != 0], (title, index, drawn)
    origin = queries["Origin found-inf by rank and device A"]
    _, result = client.query(origin, start + 147 * SCRAPE_S)
    drawn = {
        (s["metric"]["run"], s["metric"]["device"]): float(s["value"][1])
        for s in result
        if float(s["value"][1])
    }
    # Detections at 145, 146, 147 (the last minute); the rank that starts at 142 likewise.
    assert drawn == {
        ("vm-after-gap", "cuda:1"): 3.0,
        ("vm-no-gap", "cuda:0"): 3.0,
        ("vm-new", "cuda:0"): 3.0,
    }
