"""The web view of a run whose replicas stopped agreeing, in a real browser against a live
exporter: the ``replica_divergence`` verdict names the outvoted rank, and the ranks table
says since which step each rank's group diverged (or how many checks agreed).

Three ranks post schema-valid records as their reporters would: a replica check every
``EVERY`` steps, all agreeing until rank 2's parameter ``head.weight`` differs at
``FIRST_SEEN`` (a majority of two against one), and every rank recording that outcome.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from support import free_port

from ampscope.demo.exporter import ExporterProcess
from ampscope.reporter.schema import ReplicaCheckResult, StepRecord
from exporter.factory import record
from exporter.web.browser import chromium, console_errors
from exporter.web.conftest import get_json
from exporter.web.test_watch_run import _wait, post

RUN = "replica-run"
HEALTHY = "replica-ok"
STEPS, EVERY, FIRST_SEEN, BAD = 20, 4, 12, 2


def _ranks(run: str, now: float, diverge: bool) -> list[list[StepRecord]]:
    ranks = []
    for rank in range(3):
        records = []
        for step in range(1, STEPS + 1):
            made = record(step, run=run, rank=rank, world_size=3, time=now - (STEPS - step))
            if step % EVERY == 0:
                agree = not diverge or step < FIRST_SEEN
                check = ReplicaCheckResult(
                    agree=agree,
                    replicas=3,
                    ranks=[] if agree else [BAD],
                    parameters=[] if agree else ["head.weight"],
                    parameters_differing=0 if agree else 1,
                )
                made = made.model_copy(update={"replicas": check})
            records.append(made)
        ranks.append(records)
    return ranks


@pytest.fixture(scope="module")
def exporter() -> Iterator[str]:
    process = ExporterProcess(free_port())
    process.start()
    try:
        now = time.time()
        for run, diverge in ((RUN, True), (HEALTHY, False)):
            for records in _ranks(run, now, diverge):
                post(process.url, records)
        yield process.url
    finally:
        process.stop()


def _table(driver: Any) -> list[dict[str, str]]:
    header = driver.execute_script(
        "return [...document.querySelectorAll('#ranks thead th')].map(th => th.textContent)"
    )
    rows = driver.execute_script(
        "return [...document.querySelectorAll('#ranks tbody tr')].map(tr => "
        "[...tr.querySelectorAll('td')].map(td => td.textContent))"
    )
    return [dict(zip(header, row, strict=True)) for row in rows]


def test_diverged_replicas_show_the_verdict_and_the_step_per_rank(exporter: str, tmp_path) -> None:
    health = get_json(f"{exporter}/api/v1/runs/{RUN}/health")
    verdict = {v["rule"]: v for v in health["verdicts"]}["replica_divergence"]
    assert verdict["status"] == "critical"
    assert [e["rank"] for e in verdict["evidence"]["ranks"]] == [BAD]
    assert (verdict["evidence"]["step"], verdict["evidence"]["parameters"]) == (
        FIRST_SEEN,
        ["head.weight"],
    )
    with chromium(tmp_path) as driver:
        driver.get(f"{exporter}/run?id={RUN}")
        _wait(driver, "document.querySelectorAll('#ranks tbody tr').length === 3")
        _wait(driver, "document.querySelector('#verdicts li[data-rule=replica_divergence]')")
        shown = driver.execute_script(
            "const li = document.querySelector('#verdicts li[data-rule=replica_divergence]');"
            "return [li.dataset.status, li.querySelector('.summary').textContent];"
        )
        assert shown == ["critical", verdict["summary"]]
        assert f"rank {BAD}" in shown[1]
        # Every rank's group diverged at FIRST_SEEN: each row says so.
        cells = [row["replicas"] for row in _table(driver)]
        assert cells == [f"diverged since step {FIRST_SEEN}"] * 3
        assert console_errors(driver) == []

        driver.get(f"{exporter}/run?id={HEALTHY}")
        _wait(driver, "document.querySelectorAll('#ranks tbody tr').length === 3")
        cells = [row["replicas"] for row in _table(driver)]
        assert cells == [f"{STEPS // EVERY} agree"] * 3
        assert console_errors(driver) == []
    healthy = get_json(f"{exporter}/api/v1/runs/{HEALTHY}/health")
    assert {v["rule"]: v for v in healthy["verdicts"]}["replica_divergence"]["status"] == "ok"
