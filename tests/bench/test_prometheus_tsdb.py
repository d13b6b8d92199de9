"""``bench.prometheus_tsdb``: a simulated job's scrapes as OpenMetrics that promtool backfills,
and read back from Prometheus with the labels and times a scrape would have given them."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from pathlib import Path

from support import need_tool

from bench.prometheus_tsdb import BLOCKS, backfill, newest_scrape, openmetrics_lines
from bench.servers import prometheus
from bench.simulated_job import SimulatedJob


def test_each_sample_gets_the_scrape_labels_and_its_time_in_seconds() -> None:
    body = b'ampscope_last_step{run="r",rank="0"} 12.0 1700000000123\nup_like 1.0 1700000000000\n'
    assert list(openmetrics_lines(body, b'job="ampscope",instance="n:9400"')) == [
        b'ampscope_last_step{job="ampscope",instance="n:9400",run="r",rank="0"} 12.0 '
        b"1700000000.123\n",
        b'up_like{job="ampscope",instance="n:9400"} 1.0 1700000000.000\n',
    ]


def test_prometheus_serves_every_reporting_rank_at_the_newest_scrape(tmp_path: Path) -> None:
    need_tool("prometheus")
    promtool = need_tool("promtool")
    job = SimulatedJob(run="r", nodes=4)
    loaded = backfill(job, tmp_path, promtool)
    assert newest_scrape(tmp_path) == loaded["newest_scrape"]
    with prometheus(need_tool("prometheus"), tmp_path / BLOCKS) as server:
        query = "count by (job, instance) (ampscope_rank_info)"
        params = urllib.parse.urlencode({"query": query, "time": loaded["newest_scrape"]})
        url = f"http://{server.host}:{server.port}/api/v1/query?{params}"
        with urllib.request.urlopen(url, timeout=30) as response:
            result = json.load(response)["data"]["result"]
    counts = {s["metric"]["instance"]: int(s["value"][1]) for s in result}
    # Eight ranks a node; the simulated job's missing rank never reports (its lost one
    # still does at the newest scrape: its exporter exposes it as lost).
    assert sorted(counts) == [f"{job.node_name(i)}:9400" for i in range(4)]
    assert sum(counts.values()) == job.world_size - 1
    assert {s["metric"]["job"] for s in result} == {"ampscope"}
