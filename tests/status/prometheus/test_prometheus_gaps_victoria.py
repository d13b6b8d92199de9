"""Counters exposed once non-zero, counted within the verdicts' 10 minutes across gaps in the
scrapes, on VictoriaMetrics: ``ampscope status --prometheus``'s queries (``counted_within``)
and the alerts that count alike (AmpscopeTransientFault, AmpscopeReproducibleFault,
AmpscopeFp8NonfiniteAmax), as VictoriaMetrics and vmalert evaluate them.

Samples are imported with timestamps, a gap as scrapes with no sample (the import carries
no staleness markers; promtool's tests cover those). VictoriaMetrics' ``increase()`` counts
a series' first sample where none lies within its lookback before the window: after a gap
longer than that, an old count would read as new.
"""

from __future__ import annotations

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
