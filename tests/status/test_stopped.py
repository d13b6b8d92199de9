"""A rank its launcher stopped while the rest of its world goes on (``stopped_rank``), through
two live exporter processes standing in for two nodes of four ranks and ``ampscope status``
over them: a node's exporter holds too little to judge it (a restart may have numbered the
ranks anew), the merged view judges. The exporters' grace is 1 s
(``AMPSCOPE_STOPPED_GRACE_S``), so the tests wait for a condition, never for a time."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from exporter.factory import record
from status_cli import run_status
from support import DEADLOCK_GUARD_S, free_port

from ampscope.demo.exporter import ExporterProcess
from ampscope.reporter.schema import Heartbeat, IngestBatch, StepRecord

WORLD, PER_NODE = 8, 4


def _node(rank: int, renumbered: bool = False) -> str:
    return f"n{(rank // PER_NODE + renumbered) % 2}"


def _step(run: str, rank: int, step: int, node: str) -> StepRecord:
    made = record(step, rank=rank, node=node, world_size=WORLD, local_world_size=PER_NODE,
                  run=run, time=time.time())  # fmt: skip
    local = made.identity.model_copy(update={"local_rank": rank % PER_NODE})
    return made.model_copy(update={"identity": local})


def _post(url: str, path: str, payload: bytes) -> None:
    request = urllib.request.Request(url + path, data=payload, method="POST",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=DEADLOCK_GUARD_S) as response:
        assert response.status == 200


def _report(urls: dict[str, str], run: str, rank: int, step: int, node: str) -> None:
    records = [_step(run, rank, s, node) for s in range(1, step + 1)]
    body = IngestBatch(schema_version=1, records=records, dropped_records=0)
    _post(urls[node], "/api/v1/ingest", body.model_dump_json().encode())


def _goodbye(urls: dict[str, str], run: str, rank: int, step: int, node: str) -> None:
    """The final heartbeat the reporter's SIGTERM handler sends."""
    identity = _step(run, rank, step, node).identity
    beat = Heartbeat(schema_version=1, identity=identity, time=time.time(), step=step,
                     final=True, dropped_records=0, stop_signal=int(signal.SIGTERM))  # fmt: skip
    _post(urls[node], "/api/v1/heartbeat", beat.model_dump_json().encode())


@pytest.fixture(scope="module")
def exporters() -> Iterator[dict[str, str]]:
    grace = {"AMPSCOPE_STOPPED_GRACE_S": "1"}
    processes = {node: ExporterProcess(free_port(), env=grace) for node in ("n0", "n1")}
    try:
        for process in processes.values():
            process.start()
        yield {node: process.url for node, process in processes.items()}
    finally:
        for process in processes.values():
            process.stop()


def _stopped_verdict(run: str, *urls: str) -> tuple[int, dict[str, Any]]:
    result = run_status(run, "--json", *(arg for url in urls for arg in ("--url", url)))
    verdicts = {v["rule"]: v for v in json.loads(result.stdout)["health"]["verdicts"]}
    return result.returncode, verdicts["stopped_rank"]


def _until(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLOCK_GUARD_S
    while not check():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.2)


def test_a_node_evicted_from_a_running_job_is_critical_over_every_exporter(
    exporters: dict[str, str],
) -> None:
    run = "evicted"
    for rank in range(WORLD):
        _report(exporters, run, rank, 3, _node(rank))
    for rank in range(PER_NODE, WORLD):  # node n1's pod is evicted
        _goodbye(exporters, run, rank, 3, _node(rank))
    both = (exporters["n0"], exporters["n1"])
    merged: dict[str, Any] = {}

    def fired() -> bool:
        nonlocal merged
        code, merged = _stopped_verdict(run, *both)
        return merged["status"] != "ok" and code == 2

    _until(fired)
    assert merged["status"] == "critical"  # 4 of 8: more than a quarter
    assert merged["evidence"]["alone"] == 4
    assert [r["rank"] for r in merged["evidence"]["ranks"]] == [4, 5, 6, 7]
    # Neither node's exporter sees it: n0 has no stopped rank, n1 no live one.
    assert _stopped_verdict(run, exporters["n0"])[1]["summary"] == "no rank stopped"
    alone = _stopped_verdict(run, exporters["n1"])[1]
    assert (alone["status"], alone["evidence"]["alone"]) == ("ok", 0)


def test_a_restart_that_numbers_the_ranks_anew_is_judged_only_over_every_exporter(
    exporters: dict[str, str],
) -> None:
    run = "renumbered"
    for rank in range(WORLD):
        _report(exporters, run, rank, 3, _node(rank))
    for rank in range(WORLD):  # torchrun's agent stops every worker
        _goodbye(exporters, run, rank, 3, _node(rank))
    for rank in range(WORLD):  # the new generation: ranks 0-3 on n1, 4-7 on n0
        _report(exporters, run, rank, 1, _node(rank, renumbered=True))
    node: dict[str, Any] = {}

    def past_grace() -> bool:
        nonlocal node
        node = _stopped_verdict(run, exporters["n0"])[1]
        return node["evidence"].get("alone") == 4

    # n0 holds old ranks 0-3 stopped and new ranks 4-7 running: it cannot tell.
    _until(past_grace)
    assert (node["status"], node["evidence"]["judged"]) == ("ok", False)
    code, merged = _stopped_verdict(run, exporters["n0"], exporters["n1"])
    assert (merged["status"], merged["summary"], code) == ("ok", "no rank stopped", 0)
