"""``ampscope status --prometheus`` when a node dies: a real Prometheus scrapes two real
exporters, one is killed, and the ranks it held are ``lost`` (not "never reported"), named
by a critical ``lost_rank`` with the exporter whose scrape fails, judged with the thresholds
the exporters publish rather than the defaults.

Node n0's exporter holds ranks 0-2, node n1's rank 3, of a world of 4; both run with
``--stale-after 1800`` and ``lost_critical_share`` 0.2. One rank of four lost is a share of
0.25: a warning under the default share (0.25, "more than"), critical under the exporters'.
"""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from exporter.factory import body, record
from status_cli import run_status
from support import DEADLOCK_GUARD_S, free_port, start_prometheus, stop_process

from ampscope.demo.exporter import ExporterProcess

RUN = "job-lost"
NODES = {"n0": (0, 1, 2), "n1": (3,)}
STEPS = 12
SETTINGS = {"AMPSCOPE_LOST_CRITICAL_SHARE": "0.2"}
RULES = Path(__file__).parents[3] / "deploy" / "prometheus" / "rules" / "ampscope-alerts.yml"
STALE_AFTER = 1800.0
"""Long enough that the surviving node's ranks stay running however slow the machine."""


def _query(prometheus: str, promql: str) -> list[dict[str, Any]]:
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=DEADLOCK_GUARD_S) as response:
        return json.load(response)["data"]["result"]


def _until(prometheus: str, promql: str, expected: set[tuple[str, float]], label: str) -> None:
    """Wait until ``promql`` gives (``label``, value) ``expected``: Prometheus scraped it."""
    deadline = time.monotonic() + DEADLOCK_GUARD_S * 2
    while True:
        got = {(s["metric"][label], float(s["value"][1])) for s in _query(prometheus, promql)}
        if got == expected:
            return
        assert time.monotonic() < deadline, (promql, got)
        time.sleep(0.2)


def _post(url: str, rank: int, node: str) -> None:
    now = time.time()
    records = [
        record(s, run=RUN, rank=rank, node=node, world_size=4, time=now - STEPS + s)
        for s in range(1, STEPS + 1)
    ]
    request = urllib.request.Request(
        f"{url}/api/v1/ingest",
        data=body(*records),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=DEADLOCK_GUARD_S) as response:
        assert response.status == 200


@pytest.fixture(scope="module")
def dead_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(Prometheus URL, the killed exporter's host:port) once Prometheus saw it fail."""
    workdir: Path = tmp_path_factory.mktemp("prometheus-lost")
    exporters = {
        node: ExporterProcess(free_port(), stale_after=STALE_AFTER, env=SETTINGS) for node in NODES
    }
    prometheus = None
    try:
        for process in exporters.values():
            process.start()
        for node, ranks in NODES.items():
            for rank in ranks:
                _post(exporters[node].url, rank, node)
        targets = {node: p.url.removeprefix("http://") for node, p in exporters.items()}
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                {"job_name": "ampscope", "static_configs": [{"targets": list(targets.values())}]}
            ],
        }
        prometheus, url = start_prometheus(config, workdir)
        every = {(str(r), float(STEPS)) for ranks in NODES.values() for r in ranks}
        _until(url, f'ampscope_last_step{{run="{RUN}"}}', every, "rank")
        exporters["n1"].kill()
        _until(url, 'up{job="ampscope"}', {(targets["n0"], 1.0), (targets["n1"], 0.0)}, "instance")
        yield url, targets["n1"]
    finally:
        if prometheus is not None:
            stop_process(prometheus)
        for process in exporters.values():
            process.stop()


def test_the_dead_nodes_rank_is_lost_and_named_critical(dead_node: tuple[str, str]) -> None:
    url, dead = dead_node
    result = run_status(RUN, "--json", "--prometheus", url)
    assert result.returncode == 2, result.stderr  # critical
    answer = json.loads(result.stdout)
    states = {view["rank"]: (view["node"], view["state"], view["up"]) for view in answer["ranks"]}
    assert states == {
        0: ("n0", "running", True),
        1: ("n0", "running", True),
        2: ("n0", "running", True),
        3: ("n1", "lost", False),
    }
    assert answer["missing_ranks"] == []  # reported, then lost: not "never reported"
    lost_view = next(view for view in answer["ranks"] if view["rank"] == 3)
    assert lost_view["step"] == STEPS  # its last step, as Prometheus last held it
    verdicts = {v["rule"]: v for v in answer["health"]["verdicts"]}
    assert verdicts["missing_rank"]["status"] == "ok"
    lost = verdicts["lost_rank"]
    assert lost["status"] == "critical"
    assert [(r["rank"], r["node"], r["last_step"]) for r in lost["evidence"]["ranks"]] == [
        (3, "n1", STEPS)
    ]
    assert (lost["evidence"]["lost"], lost["evidence"]["share"]) == (1, 0.25)
    assert lost["evidence"]["exporters_down"] == [dead]
    assert lost["summary"].startswith("1 of 4 rank(s) went silent without finishing")
    assert lost["summary"].endswith(f"; scrape failing (up == 0): {dead}")
    # The exporters' thresholds, not the defaults (under which 1 of 4 is only a warning).
    assert lost["thresholds"] == {"stale_after_s": STALE_AFTER, "critical_share": 0.2}
    thresholds = answer["thresholds"]
    assert (thresholds["source"], thresholds["lost_critical_share"]) == ("exporters", 0.2)
    assert thresholds["stale_after_s"] == STALE_AFTER
    assert answer["health"]["states"] == {
        "running": 3,
        "stalled": 0,
        "lost": 1,
        "finished": 0,
        "failed": 0,
        "stopped": 0,
    }


def test_the_node_lost_alert_names_the_ranks_status_calls_lost(dead_node: tuple[str, str]) -> None:
    """The shipped alert (its expression, on the same Prometheus) and ``status --prometheus``
    judge a dead node alike: the ranks status calls lost, by run, node and exporter. Its
    ``for:`` aside, it would page now; the live node's ranks are not in it."""
    url, dead = dead_node
    groups = yaml.safe_load(RULES.read_text())["groups"]
    (rule,) = [r for g in groups for r in g["rules"] if r.get("alert") == "AmpscopeNodeLost"]
    got = [
        ({k: s["metric"][k] for k in ("run", "node", "instance")}, float(s["value"][1]))
        for s in _query(url, rule["expr"])
    ]
    assert got == [({"run": RUN, "node": "n1", "instance": dead}, 1.0)]
    answer = json.loads(run_status(RUN, "--json", "--prometheus", url).stdout)
    lost = [v for v in answer["ranks"] if v["state"] == "lost"]
    assert [(v["run"], v["node"]) for v in lost] == [(RUN, "n1")] * int(got[0][1])


def test_the_table_shows_the_lost_rank_on_its_node(dead_node: tuple[str, str]) -> None:
    url, _ = dead_node
    result = run_status(RUN, "--prometheus", url)
    assert result.returncode == 2, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"run {RUN}: CRITICAL, 3/4 rank(s) up (3 running, 1 lost)")
    rows = {line.split()[0]: line.split()[-1] for line in lines if line.startswith("n")}
    assert rows == {"n0": "OK", "n1": "CRITICAL"}
    (outlier,) = [line for line in lines if line.split()[:3] == ["3", "n1", "lost"]]
    assert outlier.endswith("lost_rank")
    assert any(line.split()[:2] == ["CRIT", "lost_rank"] for line in lines)
