"""Ranks their launcher stops read ``stopped``, never ``lost``; ranks that die silently still
read ``lost``. Real processes: an exporter (``--stale-after 1.5``), ranks with the default
reporter, and a real ``torchrun --max-restarts=1`` on gloo whose rank 1 fails once, so that
torchrun's agent stops the survivor with SIGTERM and starts a second generation.

About 40 s on 2 cores, most of it the ranks importing torch. The Prometheus side (no
AmpscopeRankLost for a stopped rank) is in test_run_lifecycle.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support import DEADLOCK_GUARD_S, free_port

from ampscope.demo.exporter import ExporterProcess

pytestmark = pytest.mark.distributed

STALE_AFTER = 1.5
LIFECYCLE_RANK = Path(__file__).parent / "lifecycle_rank.py"
ELASTIC_RANK = Path(__file__).parent / "elastic_rank.py"


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=DEADLOCK_GUARD_S) as response:
        return json.load(response)


def _until(check: Callable[[], Any], what: str, timeout: float = DEADLOCK_GUARD_S) -> Any:
    """``check()``'s first true value, polled every 0.1 s; fails after ``timeout`` (a
    deadlock guard)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout:.0f}s")
        time.sleep(0.1)


class Exporter:
    def __init__(self, url: str) -> None:
        self.url = url

    def state(self, run: str, rank: int = 0) -> str | None:
        view = self.view(run, rank)
        return None if view is None else str(view["state"])

    def view(self, run: str, rank: int = 0) -> dict[str, Any] | None:
        try:
            view: dict[str, Any] = _get(f"{self.url}/api/v1/runs/{run}/ranks/{rank}")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        return view

    def verdicts(self, run: str) -> dict[str, dict[str, Any]]:
        report = _get(f"{self.url}/api/v1/runs/{run}/health")
        return {v["rule"]: v for v in report["verdicts"]}

    def health(self, run: str) -> dict[str, Any]:
        report: dict[str, Any] = _get(f"{self.url}/api/v1/runs/{run}/health")
        return report


@pytest.fixture(scope="module")
def exporter() -> Iterator[Exporter]:
    process = ExporterProcess(free_port(), stale_after=STALE_AFTER, stall_after=30.0)
    process.start()
    try:
        yield Exporter(process.url)
    finally:
        process.stop()


def _env(exporter: Exporter, run: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPSCOPE_")}
    return {**env, "AMPSCOPE_URL": exporter.url, "AMPSCOPE_RUN_ID": run}


def _hanging_rank(exporter: Exporter, run: str) -> subprocess.Popen[str]:
    """A rank that took 6 steps and sleeps in its loop, once the exporter holds it."""
    process = subprocess.Popen(
        [sys.executable, str(LIFECYCLE_RANK), "hang"],
        env=_env(exporter, run),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    for line in process.stdout:
        if line.strip() == "ready":
            break
    else:
        process.wait(DEADLOCK_GUARD_S)
        pytest.fail("the rank exited before it was ready")
    _until(lambda: exporter.state(run) == "running", "the rank was not running")
    return process


def _ended(exporter: Exporter, run: str, rank: int = 0) -> str:
    """The rank's state once it left running (and stalled)."""
    state: str = _until(
        lambda: (s := exporter.state(run, rank)) not in (None, "running", "stalled") and s,
        f"rank {rank} of {run} still running",
    )
    return state


def test_a_rank_sent_sigterm_reads_stopped_and_pages_nobody(exporter: Exporter) -> None:
    process = _hanging_rank(exporter, "st-term")
    try:
        process.send_signal(signal.SIGTERM)
        assert process.wait(DEADLOCK_GUARD_S) == -signal.SIGTERM  # as the launcher expects
        assert _ended(exporter, "st-term") == "stopped"
        assert exporter.view("st-term")["stop_signal"] == signal.SIGTERM  # type: ignore[index]
        # Several stale TTLs later: still stopped, nothing lost.
        time.sleep(2 * STALE_AFTER)  # checks that something does not happen
        assert exporter.state("st-term") == "stopped"
        report = exporter.health("st-term")
        assert (report["status"], report["state"]) == ("ok", "stopped")
        assert exporter.verdicts("st-term")["lost_rank"]["status"] == "ok"
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(DEADLOCK_GUARD_S)


def test_a_rank_sent_sigkill_reads_lost_and_lost_rank_fires(exporter: Exporter) -> None:
    process = _hanging_rank(exporter, "st-kill")
    try:
        process.kill()
        assert process.wait(DEADLOCK_GUARD_S) == -signal.SIGKILL
        assert _ended(exporter, "st-kill") == "lost"
        lost = exporter.verdicts("st-kill")["lost_rank"]
        assert (lost["status"], lost["evidence"]["lost"]) == ("critical", 1)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(DEADLOCK_GUARD_S)


def test_torchruns_restart_stops_the_survivors_and_the_next_generation_runs(
    exporter: Exporter,
) -> None:
    run = f"st-elastic-{os.getpid()}"
    workdir = Path(tempfile.mkdtemp(prefix="ampscope-elastic-"))
    go = workdir / "go"
    log = workdir / "torchrun.log"
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
        *("--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.2"),
        str(ELASTIC_RANK),
    ]
    env = {**_env(exporter, run), "ELASTIC_GO": str(go), "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as out:
        agent = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        # The first generation: rank 1 failed, and the agent stopped rank 0 with SIGTERM.
        guard = DEADLOCK_GUARD_S * 3  # four processes import torch on a loaded machine
        assert _ended(exporter, run, 1) == "failed"
        state = _until(
            lambda: (s := exporter.state(run, 0)) not in ("running", "stalled") and s,
            f"the survivor still running:\n{log.read_text()[-3000:]}",
            timeout=guard,
        )
        assert state == "stopped", log.read_text()[-3000:]
        assert exporter.view(run, 0)["stop_signal"] == signal.SIGTERM  # type: ignore[index]
        verdicts = exporter.verdicts(run)
        assert verdicts["lost_rank"]["status"] == "ok"
        assert verdicts["rank_failed"]["evidence"]["ranks"][0]["rank"] == 1  # the real fault
        # The second generation reports under the same rank ids: running, then finished.
        go.touch()
        assert agent.wait(guard) == 0, log.read_text()[-3000:]
        for rank in (0, 1):
            assert _ended(exporter, run, rank) == "finished"
            assert exporter.view(run, rank)["restarts"] == 1  # type: ignore[index]
        report = exporter.health(run)
        assert (report["status"], report["state"]) == ("ok", "finished")
    finally:
        if agent.poll() is None:
            agent.terminate()  # the agent stops its workers; a kill would orphan them
            try:
                agent.wait(DEADLOCK_GUARD_S)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait(DEADLOCK_GUARD_S)
