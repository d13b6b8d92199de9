"""A run whose ranks failed, as ``ampscope status`` tells it over one exporter, several
(fan-out) and Prometheus: two real exporters standing in for two nodes, a real Prometheus
scraping them, and real GradWatches reporting through the real reporter.

The four ranks run in this one process, one after the other: two end normally; one stops on
inf/NaN gradients (``NonFiniteGradientsError``, caught, then closed), the other leaves a
``with`` block on a ``RuntimeError``. A failure is noted per process, so it is forgotten
between the ranks, as separate processes would keep their own.
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
from status_cli import run_status
from support import DEADLOCK_GUARD_S, free_port, need_tool, start_prometheus, stop_process

from ampscope.demo.exporter import ExporterProcess
from ampscope.reporter import failure

RUN = "job-failed"
LAYOUT = {"n0": (0, 1), "n1": (2, 3)}
NAN_STEP = 5
CRASH_STEP = 7


def _query(prometheus: str, promql: str) -> list[dict[str, Any]]:
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=DEADLOCK_GUARD_S) as response:
        return json.load(response)["data"]["result"]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """(Prometheus URL, node -> exporter URL) once every rank ended and was scraped."""
    need_tool("prometheus")
    import torch

    import ampscope
    from ampscope.reporter.http import HttpReporter

    workdir = tmp_path_factory.mktemp("prometheus")
    exporters = {node: ExporterProcess(free_port()) for node in LAYOUT}
    prometheus = None
    try:
        for process in exporters.values():
            process.start()
        targets = [process.url.removeprefix("http://") for process in exporters.values()]
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "ampscope", "static_configs": [{"targets": targets}]}],
        }
        prometheus, prometheus_url = start_prometheus(config, workdir)

        def rank_env(node: str, rank: int) -> dict[str, str]:
            return {"AMPSCOPE_NODE": node, "RANK": str(rank), "LOCAL_RANK": str(rank % 2),
                    "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}  # fmt: skip

        def train(node: str, rank: int, watch: ampscope.GradWatch, steps: int) -> None:
            torch.manual_seed(rank)
            model = torch.nn.Linear(4, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
            with pytest.MonkeyPatch.context() as patch:
                for name, value in rank_env(node, rank).items():
                    patch.setenv(name, value)
                for step in range(1, steps + 1):
                    batch = torch.ones(2, 4)
                    if rank == 1 and step == NAN_STEP:
                        batch[0, 0] = float("nan")
                    watch.scale(model(batch).pow(2).mean()).backward()
                    watch.step(optimizer)
                    watch.update()
                    optimizer.zero_grad()

        def watch(node: str, policy: str = "observe") -> ampscope.GradWatch:
            reporter = HttpReporter(exporters[node].url, flush_interval=0.05)
            return ampscope.GradWatch(policy, reporter=reporter, run_id=RUN)  # type: ignore[arg-type]

        for node, rank in (("n0", 0), ("n1", 2)):  # they end normally
            normal = watch(node)
            train(node, rank, normal, 6)
            normal.close()
        stopped = watch("n0", "raise")
        with pytest.raises(ampscope.NonFiniteGradientsError):
            train("n0", 1, stopped, 8)
        stopped.close()  # the loop caught the error and ends: rank 1 failed all the same
        failure.forget()  # rank 3 is another process

        def crash() -> None:
            with watch("n1") as crashing:
                train("n1", 3, crashing, CRASH_STEP)
                raise RuntimeError("data loader died")

        with pytest.raises(RuntimeError, match="data loader died"):
            crash()
        deadline = time.monotonic() + DEADLOCK_GUARD_S * 2
        while True:
            failed = _query(prometheus_url, 'ampscope_rank_state{state="failed"} == 1')
            ended = _query(prometheus_url, 'ampscope_rank_state{state="finished"} == 1')
            if sorted(s["metric"]["rank"] for s in failed) == ["1", "3"] and len(ended) == 2:
                break
            assert time.monotonic() < deadline, (failed, ended)
            time.sleep(0.2)
        yield prometheus_url, {node: process.url for node, process in exporters.items()}
    finally:
        if prometheus is not None:
            stop_process(prometheus)
        for process in exporters.values():
            process.stop()


def _verdicts(answer: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["rule"]: v for v in answer["health"]["verdicts"]}


def test_one_exporter_names_its_failed_rank_and_exits_critical(
    job: tuple[str, dict[str, str]],
) -> None:
    _, nodes = job
    result = run_status(RUN, "--url", nodes["n0"])
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"run {RUN}: CRITICAL, ")
    assert " rank(s) up (1 finished, 1 failed); " in lines[0]
    rows = {line.split()[0]: line.split() for line in lines[3:5]}
    assert (rows["0"][2], rows["1"][2]) == ("finished", "failed")
    at = lines.index("failed ranks:")
    assert lines[at + 1].startswith(
        f"  rank 1 (node n0): NonFiniteGradientsError at step {NAN_STEP}: ampscope: "
        f"non-finite gradients at step {NAN_STEP}"
    )
    verdict = next(line for line in lines if " rank_failed " in line)
    assert verdict.split()[0] == "CRIT"
    assert (
        f"1 of 2 rank(s) failed (rank(s) 1): training stopped on inf/NaN gradients at step "
        f"{NAN_STEP} (NonFiniteGradientsError); origin not tracked"
    ) in verdict
    answer = json.loads(run_status(RUN, "--json", "--url", nodes["n0"]).stdout)
    assert answer["health"]["state"] == "failed"
    assert answer["ranks"][1]["failure"]["seen_by"] == "watch"


def test_fan_out_and_prometheus_tell_the_same_failures(job: tuple[str, dict[str, str]]) -> None:
    prometheus_url, nodes = job
    urls = [arg for url in nodes.values() for arg in ("--url", url)]
    via_exporters = run_status(RUN, "--json", *urls)
    via_prometheus = run_status(RUN, "--json", "--prometheus", prometheus_url)
    assert via_exporters.returncode == via_prometheus.returncode == 2, via_prometheus.stderr
    answers = [json.loads(via_exporters.stdout), json.loads(via_prometheus.stdout)]
    for answer in answers:
        health = answer["health"]
        assert (health["status"], health["state"]) == ("critical", "failed")
        assert health["states"] == {
            "running": 0,
            "stalled": 0,
            "lost": 0,
            "finished": 2,
            "failed": 2,
            "stopped": 0,
        }
        failed = _verdicts(answer)["rank_failed"]
        assert failed["status"] == "critical"
        evidence = failed["evidence"]
        assert [(r["rank"], r["node"], r["exception"], r["step"]) for r in evidence["ranks"]] == [
            (1, "n0", "NonFiniteGradientsError", NAN_STEP),
            (3, "n1", "RuntimeError", CRASH_STEP),
        ]
        assert (evidence["step"], evidence["exception"]) == (NAN_STEP, "NonFiniteGradientsError")
        assert (evidence["origin_tracked"], evidence["origin_ranks"]) == (False, [])
        assert failed["summary"].startswith(
            f"2 of 4 rank(s) failed (rank(s) 1, 3): training stopped on inf/NaN gradients at "
            f"step {NAN_STEP}"
        )
        states = {r["rank"]: r["state"] for r in answer["ranks"]}
        assert states == {0: "finished", 1: "failed", 2: "finished", 3: "failed"}
    from_exporters, from_prometheus = answers
    # The exporters hold the message; Prometheus the class, kind and origin only.
    crash = from_exporters["ranks"][3]["failure"]
    assert (crash["exception"], crash["message"], crash["seen_by"]) == (
        "RuntimeError",
        "data loader died",
        "with",
    )
    assert from_prometheus["ranks"][3]["failure"] == {
        "kind": "exception",
        "exception": "RuntimeError",
        "message": None,
        "step": CRASH_STEP,
        "origin_ranks": None,
        "seen_by": None,
    }
    assert from_prometheus["ranks"][1]["failure"]["origin_ranks"] is None  # not tracked


def test_the_tables_list_the_failed_ranks(job: tuple[str, dict[str, str]]) -> None:
    prometheus_url, nodes = job
    urls = [arg for url in nodes.values() for arg in ("--url", url)]
    for args in (urls, ["--prometheus", prometheus_url]):
        result = run_status(RUN, *args)
        assert result.returncode == 2, result.stderr
        lines = result.stdout.splitlines()
        assert lines[0].startswith(f"run {RUN}: CRITICAL, ")
        assert " rank(s) up (2 finished, 2 failed) of world size 4 on 2 node(s)" in lines[0]
        at = lines.index("failed ranks:")
        assert lines[at + 1].startswith(
            f"  rank 1 (node n0): NonFiniteGradientsError at step {NAN_STEP}"
        )
        assert lines[at + 2].startswith(f"  rank 3 (node n1): RuntimeError after step {CRASH_STEP}")
        outliers = lines.index("outlier ranks:")
        assert [line.split()[:3] for line in lines[outliers + 2 : outliers + 4]] == [
            ["1", "n0", "failed"],
            ["3", "n1", "failed"],
        ]
    listing = run_status("--prometheus", prometheus_url)
    assert listing.returncode == 2
    row = next(line.split() for line in listing.stdout.splitlines() if line.startswith(RUN))
    assert row[1] == "CRITICAL"
    assert "rank_failed" in row[-1]


def test_a_failed_verdict_reads_the_same_from_the_exporters_json(tmp_path: Path) -> None:
    """The merge recomputes ``rank_failed`` over every node's ranks, from the views alone."""
    from ampscope.status import merge
    from ampscope.verdicts.rollup import run_state

    views = [
        {"rank": 0, "node": "n0", "step": 9, "state": "finished", "failure": None},
        {
            "rank": 1,
            "node": "n0",
            "step": 5,
            "state": "failed",
            "failure": {
                "kind": "nonfinite_gradients",
                "exception": "NonFiniteGradientsError",
                "message": "m",
                "step": 5,
                "origin_ranks": [],
                "seen_by": "uncaught",
            },
        },
        {
            "rank": 2,
            "node": "n1",
            "step": 5,
            "state": "failed",
            "failure": {
                "kind": "nonfinite_gradients",
                "exception": "NonFiniteGradientsError",
                "message": "m",
                "step": 5,
                "origin_ranks": [2],
                "seen_by": "uncaught",
            },
        },
        # A failure held for a rank that runs again (a restart) does not count.
        {"rank": 3, "node": "n1", "step": 2, "state": "running", "failure": {"step": 1}},
    ]
    facts = merge.failed_of(views)
    assert [(f.rank, f.origin_ranks) for f in facts] == [(1, ()), (2, (2,))]
    assert run_state(["finished", "failed", "failed"]) == "failed"
    assert run_state(["finished"] * 3) == "finished"
    assert run_state(["finished", "failed", "running"]) == "active"
