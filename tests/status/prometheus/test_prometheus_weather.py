"""The counts without the loss scaler's weather, as every shipped reader writes them, on
Prometheus' engine (promtool) and on VictoriaMetrics: ``ampscope status --prometheus``'s
``counted_query`` (``skipped``, ``inf_local``, ``inf_origin``), the recording rules behind
AmpscopeSkipStorm and AmpscopeInfHotspot, and the dashboard's skipped step ratio.

Each reads a counter's window once: ``clamp_min(c - (w or (X * 0 unless on (ranks) MARK)),
0)``. The form before it read the window twice, ``clamp_min(c - w, 0) or (c unless on (ranks)
MARK)`` (``TWO_READS``); both must give the values below, rank by rank and device by device,
on either engine. The ranks are the cases where the two could part: an old reporter (no
mark: every count), weather grown more than the count (0, not negative), the mark with
weather that did not grow, two devices each with its own weather, a restart within the
window, a gap in the scrapes (the count grown during it is not counted), the mark with a
device that has no weather series (nothing to subtract from: absent, in both forms), and a
weather series without the mark (subtracted: ``or`` keeps its left side).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import need_tool, promtool_test_queries

from ampscope.status import prometheus
from ampscope.status.prometheus.health import WEATHER_MARK, counted_query
from ampscope.status.prometheus.ranks import grown_within
from ampscope.verdicts.thresholds import Thresholds
from bench.servers import victoria_metrics
from bench.victoria import VictoriaClient

ROOT = Path(__file__).parents[3]
RULES = ROOT / "deploy" / "prometheus" / "rules" / "ampscope-alerts.yml"
DASHBOARD = ROOT / "dashboards" / "ampscope.json"
SCRAPE_S = 15
SCRAPES = 60
AT_S = (SCRAPES - 1) * SCRAPE_S + 5
"""Asked 5 s after the last scrape: the 5 and 10 minute windows hold scrapes 40 to 59 and 20
to 59 whether an engine's range includes its start or not."""
RATIO_SCALE = 1710
"""The ratios times this are whole numbers: 190 steps (20 scrapes of 10) or 90 (a restart,
a gap) in 5 minutes."""
RUNS = ("w", "wl")
"""Run ``w`` tracks origins (its local counts twice them, which the rules do not read); run
``wl`` does not (the rules read its local counts)."""

Counter = Callable[[int], float]


def _step(before: float, after: float, at: int = 45) -> Counter:
    return lambda index: before if index < at else after


def _const(value: float) -> Counter:
    return lambda index: value


def _restarted(before: float, first: float, later: float) -> Counter:
    # The process restarts at scrape 50 and counts from 0: ``first`` then ``later`` from 55.
    return lambda index: before if index < 50 else (first if index < 55 else later)


def _steps(index: int) -> float:
    return 10.0 * index


def _steps_restarted(index: int) -> float:
    return 10.0 * (index if index < 50 else index - 50)


GAP = set(range(10, 50))
"""The scrapes that failed for the ranks with a gap: no sample of any of their series."""

# rank -> its counters by scrape index: "skipped" and its weather (None: the reporter
# predates the weather count, no mark), "inf": device -> (count, its weather or None).
RANKS: dict[int, dict[str, Any]] = {
    # An old reporter: every skip and detection counts.
    0: {
        "skipped": (_step(2, 9), None),
        "inf": {"cuda:0": (_step(1, 4), None), "cuda:1": (_step(0, 2, 30), None)},
    },
    # Weather grown more than the count (a record accepted on its own): 0, not negative.
    1: {
        "skipped": (_step(3, 5), _step(0, 5)),
        "inf": {"cuda:0": (_step(0, 1), _step(0, 4)), "cuda:1": (_step(0, 3), _const(0))},
    },
    # The mark, weather that did not grow in the window: every new skip counts.
    2: {
        "skipped": (_step(4, 10), _const(4)),
        "inf": {"cuda:0": (_step(4, 9), _const(4))},
    },
    # Two devices, each less its own weather.
    3: {
        "skipped": (_step(4, 8), _step(0, 4)),
        "inf": {"cuda:0": (_step(0, 6), _step(0, 6)), "cuda:1": (_step(0, 6), _step(0, 1))},
    },
    # Restarted within the window (counters from 0): counted from the smallest sample.
    4: {
        "skipped": (_restarted(10, 0, 3), _restarted(6, 0, 1)),
        "inf": {"cuda:0": (_restarted(5, 0, 4), _restarted(2, 0, 1))},
        "steps": _steps_restarted,
    },
    # An old reporter restarted.
    5: {
        "skipped": (_restarted(8, 0, 2), None),
        "inf": {"cuda:0": (_restarted(8, 0, 2), None)},
        "steps": _steps_restarted,
    },
    # Scrapes failed for 10 minutes, and the counts grew meanwhile: only the window's growth.
    6: {
        "skipped": (lambda i: 5 if i < 10 else 7 if i < 55 else 9, _step(1, 2, 10)),
        "inf": {"cuda:0": (lambda i: 6 if i < 10 else 9 if i < 55 else 11, _step(2, 3, 10))},
        "gap": GAP,
    },
    # An old reporter with the same gap, nothing new since: its old counts read as none.
    7: {
        "skipped": (_const(5), None),
        "inf": {"cuda:0": (_const(3), None)},
        "gap": GAP,
    },
    # The mark, and a device without a weather series: that device has nothing to subtract
    # from and is absent (the exporter exports both or neither; a store may show one first).
    8: {
        "skipped": (_step(0, 2), _const(0)),
        "inf": {"cuda:0": (_step(0, 2), _const(0)), "cuda:1": (_step(0, 3), None)},
    },
    # A detection's weather series and no mark (a store that shows one family's new series
    # before another's): the weather is subtracted, as the two reads' first branch did.
    9: {
        "skipped": (_step(0, 3), None),
        "inf": {"cuda:0": (_step(0, 4), _step(0, 4))},
    },
}

SKIPPED = {0: 7, 1: 0, 2: 6, 3: 0, 4: 2, 5: 2, 6: 2, 7: 0, 8: 2, 9: 3}
"""Each rank's skips in the 5 minutes without the weather."""
STEPS = {rank: 90 if rank in (4, 5, 6, 7) else 190 for rank in RANKS}
"""Each rank's steps in the 5 minutes: 20 scrapes of 10, or 9 after a restart or a gap."""
INFS = {
    (0, "cuda:0"): 3,
    (0, "cuda:1"): 2,
    (1, "cuda:0"): 0,
    (1, "cuda:1"): 3,
    (2, "cuda:0"): 5,
    (3, "cuda:0"): 0,
    (3, "cuda:1"): 5,
    (4, "cuda:0"): 3,
    (5, "cuda:0"): 2,
    (6, "cuda:0"): 2,
    (7, "cuda:0"): 0,
    (8, "cuda:0"): 2,
    (9, "cuda:0"): 0,
}
"""Each rank's and device's detections in the 10 minutes without the weather (rank 8's
cuda:1 absent)."""

Key = tuple[str, int, str]
"""(run, rank, device or "")."""


def _labels(run: str, rank: int, device: str = "") -> dict[str, str]:
    labels = {"run": run, "node": f"n{rank}", "rank": str(rank), "local_rank": "0"}
    return {**labels, "device": device} if device else labels


def _text(labels: dict[str, str]) -> str:
    return ",".join(f'{k}="{v}"' for k, v in labels.items())


def _series() -> list[tuple[str, dict[str, str], list[float | None]]]:
    """(family, labels, value at each scrape or None where it failed) of every series."""
    out: list[tuple[str, dict[str, str], list[float | None]]] = []
    for run in RUNS:
        for rank, shape in RANKS.items():
            gap = shape.get("gap", set())

            def values(counter: Counter, times: float = 1) -> list[float | None]:
                return [None if i in gap else times * counter(i) for i in range(SCRAPES)]  # noqa: B023

            labels = _labels(run, rank)
            out.append(("ampscope_steps_total", labels, values(shape.get("steps", _steps))))
            skipped, weather = shape["skipped"]
            out.append(("ampscope_skipped_steps_total", labels, values(skipped)))
            if weather is not None:
                out.append((WEATHER_MARK, labels, values(weather)))
            for device, (count, weather) in shape["inf"].items():
                at = _labels(run, rank, device)
                # Run "w" counts its local detections twice its origins, weather alike.
                families = {"ampscope_found_inf_total": 2 if run == "w" else 1}
                if run == "w":
                    families["ampscope_found_inf_origin_total"] = 1
                for family, times in families.items():
                    out.append((family, at, values(count, times)))
                    if weather is not None:
                        weather_family = family.replace("ampscope_", "ampscope_weather_", 1)
                        out.append((weather_family, at, values(weather, times)))
    return out


def _two_reads(family: str, weather: str, window_s: float) -> str:
    """``counted_query`` before it read the window once: the window of ``family``
    read in both branches."""
    counted = grown_within(f"{family}{{}}", window_s)
    return (
        f"(clamp_min({counted} - {grown_within(f'{weather}{{}}', window_s)}, 0) or "
        f"({counted} unless on (run, node, rank, local_rank) {WEATHER_MARK}{{}}))"
    )


def _rule(name: str) -> str:
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    return next(r["expr"] for r in rules if r.get("record") == name)


def _dashboard_ratio() -> str:
    """The dashboard's skipped step ratio, its variables set to every run, node and rank and
    its interval to the rule's 5 minutes."""

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    dashboard = json.loads(DASHBOARD.read_text())
    panel = next(p for p in panels(dashboard["panels"]) if p.get("title") == "Skipped step ratio")
    expr: str = panel["targets"][0]["expr"]
    for variable in ("$run", "$node", "$rank"):
        expr = expr.replace(variable, ".*")
    return expr.replace("$__rate_interval", "5m")


def _skipped(runs: tuple[str, ...] = RUNS, above_zero: bool = False) -> dict[Key, float]:
    return {
        (run, rank, ""): n for run in runs for rank, n in SKIPPED.items() if n > 0 or not above_zero
    }


def _infs(runs: tuple[str, ...], times: float = 1) -> dict[Key, float]:
    return {(run, rank, device): times * n for run in runs for (rank, device), n in INFS.items()}


def _ratios() -> dict[Key, float]:
    return {
        (run, rank, ""): SKIPPED[rank] * RATIO_SCALE / STEPS[rank] for run in RUNS for rank in RANKS
    }


def _expected() -> dict[str, tuple[str, dict[Key, float]]]:
    """name -> (query, what it answers)."""
    t = Thresholds()
    assert (t.skip_storm_window_s, t.hotspot_window_s) == (300, 600)  # the fixture's windows
    asked = prometheus.queries(None, t)
    local = ("ampscope_found_inf_total", "ampscope_weather_found_inf_total")
    origin = ("ampscope_found_inf_origin_total", "ampscope_weather_found_inf_origin_total")
    skipped = ("ampscope_skipped_steps_total", WEATHER_MARK)
    # Run "w"'s local counts are twice its origins; the rule reads its origins.
    local_counts = {**_infs(("w",), 2), **_infs(("wl",))}
    return {
        "status skipped": (asked["skipped"], _skipped(above_zero=True)),
        "status inf_local": (asked["inf_local"], local_counts),
        "status inf_origin": (asked["inf_origin"], _infs(("w",))),
        "counted_query skipped": (counted_query(*skipped, "", 300), _skipped()),
        "two reads skipped": (_two_reads(*skipped, 300), _skipped()),
        "two reads inf_local": (_two_reads(*local, 600), local_counts),
        "two reads inf_origin": (_two_reads(*origin, 600), _infs(("w",))),
        "rule skipped ratio": (
            f"{_rule('ampscope_rank:skipped_steps:ratio_5m')} * {RATIO_SCALE}",
            _ratios(),
        ),
        "rule found_inf_source": (
            _rule("ampscope_rank_device:found_inf_source:increase_10m"),
            _infs(RUNS),
        ),
        "dashboard skipped ratio": (f"({_dashboard_ratio()}) * {RATIO_SCALE}", _ratios()),
    }


def test_every_form_reads_each_counters_window_once() -> None:
    """The status queries, the rules and the dashboard name each counter's window once (the
    two reads named the count's twice: VictoriaMetrics read it twice)."""
    for name, (query, _) in _expected().items():
        windows = re.findall(r"min_over_time\((\w+)\{[^}]*\}\[(\w+)\]\)", query)
        windows += re.findall(r"min_over_time\((\w+)\[(\w+)\]\)", query)
        assert windows, name
        once = len(windows) == len(set(windows))
        assert once != name.startswith("two reads"), (name, windows)


def _key(labels: dict[str, str]) -> Key:
    return labels["run"], int(labels["rank"]), labels.get("device", "")


def test_counts_without_the_weather_on_promtool(tmp_path: Path) -> None:
    """Prometheus' engine gives every case's count, in every reader's form."""
    series = [
        {
            "series": f"{family}{{{_text(labels)}}}",
            "values": " ".join("_" if v is None else f"{v:g}" for v in values),
        }
        for family, labels, values in _series()
    ]
    exprs = [
        {
            "expr": f"round({query})",
            "eval_time": f"{AT_S}s",
            "exp_samples": [
                {"labels": f"{{{_text(_labels(*key))}}}", "value": value}
                for key, value in expected.items()
            ],
        }
        for query, expected in _expected().values()
    ]
    promtool_test_queries(tmp_path / "weather-forms-test.yml", series, exprs)


@pytest.fixture(scope="module")
def victoria(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VictoriaClient, float]]:
    """(a client of VictoriaMetrics holding the scrapes, the first scrape's time)."""
    path = need_tool("victoria-metrics")
    with victoria_metrics(path, tmp_path_factory.mktemp("victoria")) as server:
        client = VictoriaClient(server.host, server.port)
        try:
            # Ten minutes in the past: no query is near now.
            start = float(int(time.time()) // SCRAPE_S * SCRAPE_S) - (SCRAPES + 40) * SCRAPE_S
            lines = [
                f"{family}{{{_text(labels)}}} {v:g} {int((start + i * SCRAPE_S) * 1000)}"
                for family, labels, values in _series()
                for i, v in enumerate(values)
                if v is not None
            ]
            client.import_prometheus(("\n".join(lines) + "\n").encode(), {})
            client.flush()
            yield client, start
        finally:
            client.close()


def test_counts_without_the_weather_on_victoria_metrics(
    victoria: tuple[VictoriaClient, float],
) -> None:
    """VictoriaMetrics (its own ``or``, ``unless`` and lookback) gives the same counts."""
    client, start = victoria
    for name, (query, expected) in _expected().items():
        _, result = client.query(query, start + AT_S)
        answered = {_key(s["metric"]): round(float(s["value"][1]), 6) for s in result}
        assert answered == {key: round(v, 6) for key, v in expected.items()}, name
