"""``ampscope status`` as a user runs it (a subprocess) against a live exporter process fed
by real scalers: the tables, ``--json``, ``--watch`` and every exit status."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from status_cli import run_status, train_scaler
from support import DEADLOCK_GUARD_S, free_port, interruptible

from ampscope.demo.exporter import ExporterProcess

RUNS = {"calm": 0, "stormy": 1, "collapsed": 2}
"""Run id -> the exit status its health must give: ok, warning (skip storm), critical."""


@pytest.fixture(scope="module")
def exporter() -> Iterator[str]:
    process = ExporterProcess(free_port())
    process.start()
    try:
        # 12 steps each: 4 skipped of 12 is a skip storm (scale 2^10 -> 2^6, no collapse);
        # 3 clean steps make 2^10 the clean scale, then 9 backoffs in a row take it to 2^1,
        # a fall of 2^9 from the scale the run trained cleanly at: a collapse.
        train_scaler(process.url, "calm", 12, set())
        train_scaler(process.url, "stormy", 12, {3, 6, 9, 12})
        train_scaler(process.url, "collapsed", 12, set(range(4, 13)))
        deadline = time.monotonic() + DEADLOCK_GUARD_S
        while True:
            runs_url = process.url + "/api/v1/runs"
            with urllib.request.urlopen(runs_url, timeout=DEADLOCK_GUARD_S) as response:
                runs = json.load(response)
            if sorted((r["run"], r["newest_step"]) for r in runs) == sorted(
                (run, 12) for run in RUNS
            ):
                break
            assert time.monotonic() < deadline, runs
            time.sleep(0.1)
        yield process.url
    finally:
        process.stop()


def test_runs_table_and_worst_status(exporter: str) -> None:
    result = run_status(url=exporter)  # AMPSCOPE_URL, as the ranks use it
    assert result.returncode == 2, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == [
        "RUN", "HEALTH", "UP", "STATES", "STEP", "MODE", "SCALE", "SKIPPED", "INF", "L/O",
        "FLAGGED",
    ]  # fmt: skip
    rows = {line.split()[0]: line.split() for line in lines[1:4]}
    assert rows["calm"][1:3] == ["OK", "1/1"]
    assert rows["calm"][-5:] == ["scaler", "2^10", "0", "0/0", "-"]
    assert rows["stormy"][1] == "WARNING"
    assert rows["stormy"][-4:] == ["2^6", "4", "4/0", "skip_storm"]
    assert rows["collapsed"][1] == "CRITICAL"
    assert rows["collapsed"][-4:-1] == ["2^1", "9", "9/0"]
    assert "scale_collapse" in rows["collapsed"][-1]
    # The flagged verdicts follow, with the API's summaries.
    assert any("skip_storm" in line and "4 of rank 0's last 12 steps" in line for line in lines)


@pytest.mark.parametrize(("run", "code"), RUNS.items())
def test_one_run_exits_with_its_health(exporter: str, run: str, code: int) -> None:
    result = run_status(run, "--url", exporter)
    assert result.returncode == code, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    status = ["OK", "WARNING", "CRITICAL"][code]
    assert lines[0].startswith(f"run {run}: {status}, 1/1 rank(s) up")
    assert lines[0].endswith("; loss scaler, float32 gradients")  # what the ranks run
    header = lines[2].split()
    assert header[:6] == ["RANK", "NODE", "STATE", "STEP", "MODE", "SCALE"]
    rank = lines[3].split()
    assert rank[0] == "0"
    assert rank[3] == "12"


def test_a_run_whose_ranks_all_finished_says_so(exporter: str) -> None:
    # The scalers were closed: their final records marked every rank finished.
    result = run_status("calm", "--url", exporter)
    verdicts = [line.split(maxsplit=2) for line in result.stdout.splitlines()]
    assert ["ok", "stalled_rank", "no live ranks: 1 finished"] in verdicts


def test_json_is_the_apis_answers(exporter: str) -> None:
    result = run_status("stormy", "--json", "--url", exporter)
    assert result.returncode == 1
    answer = json.loads(result.stdout)
    with urllib.request.urlopen(
        exporter + "/api/v1/runs/stormy/health", timeout=DEADLOCK_GUARD_S
    ) as response:
        health = json.load(response)
    assert answer["health"]["verdicts"] == health["verdicts"]
    assert [r["totals"]["skipped_steps"] for r in answer["ranks"]] == [4]
    listing = json.loads(run_status("--json", "--url", exporter).stdout)
    assert sorted(r["run"] for r in listing["runs"]) == sorted(RUNS)
    assert {run: h["status"] for run, h in listing["health"].items()} == {
        "calm": "ok",
        "stormy": "warning",
        "collapsed": "critical",
    }


def test_unknown_run_and_unreachable_exporter(exporter: str) -> None:
    result = run_status("nope", "--url", exporter)
    assert result.returncode == 4
    assert "holds no run 'nope'" in result.stderr
    dead = f"http://127.0.0.1:{free_port()}"
    result = run_status("--url", dead)
    assert result.returncode == 3
    assert f"no exporter answers at {dead}" in result.stderr
    assert "ampscope serve" in result.stderr
    # Without --url, AMPSCOPE_URL (where the ranks report) is the exporter asked.
    result = run_status(url=dead)
    assert result.returncode == 3
    assert dead in result.stderr


def test_a_run_dropped_after_the_list_is_left_out(
    exporter: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention can drop a run between `GET /runs` and that run's own requests: the table
    leaves it out instead of failing with "holds no run". Simulated by asking the live
    exporter for a run it never held whenever the "calm" run is asked for."""
    from ampscope.status import access
    from ampscope.status import main as status_main

    real_get = access.get_json

    def dropping(target: status_main.Exporter, path: str, shape: Any) -> Any:
        return real_get(target, path.replace("/runs/calm/", "/runs/dropped/"), shape)

    monkeypatch.setattr(access, "get_json", dropping)
    answer = status_main.fetch(exporter, None)
    assert [summary["run"] for summary in answer["runs"]] == ["collapsed", "stormy"]
    assert set(answer["ranks"]) == set(answer["health"]) == {"collapsed", "stormy"}
    assert status_main.exit_status(answer) == 2


def test_watch_redraws_until_interrupted(exporter: str) -> None:
    process = interruptible(
        [sys.executable, "-m", "ampscope.cli", "status", "calm", "--watch", "--interval", "0.2",
         "--url", exporter],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    assert process.stdout is not None
    frames = 0
    for line in process.stdout:  # each frame is flushed: read until the second one
        frames += line.startswith("run calm: OK")
        if frames == 2:
            break
    process.send_signal(signal.SIGINT)  # as Ctrl-C
    out, _ = process.communicate(timeout=DEADLOCK_GUARD_S)
    assert process.returncode == 0
    assert frames == 2, out


def test_default_url(monkeypatch: pytest.MonkeyPatch) -> None:
    from ampscope.reporter.schema import DEFAULT_URL
    from ampscope.status.access import base_url

    monkeypatch.delenv("AMPSCOPE_URL", raising=False)
    assert base_url(None) == DEFAULT_URL
    monkeypatch.setenv("AMPSCOPE_URL", "http://node7:9500/")
    assert base_url(None) == "http://node7:9500"
    assert base_url("http://other:1") == "http://other:1"
