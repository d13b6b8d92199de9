"""A scaler's end: garbage collection without close() stops every thread it started after
delivering its records and its final record; close() never waits long on a dead exporter;
snapshots are plain data."""

from __future__ import annotations

import dataclasses
import gc
import json
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from helpers import ListSink, Net, run
from support import DEADLOCK_GUARD_S, free_port

import ampscope
from ampscope.reporter.http import HttpReporter

sys.path.insert(0, str(Path(__file__).parents[2] / "reporter"))
from loopback_server import LoopbackExporter

SCALERS = 50


def _train(scaler: ampscope.GradScaler, steps: int = 2) -> None:
    model = Net()
    run(scaler, model, [torch.optim.SGD(model.parameters(), lr=0.1)], steps)


def _ampscope_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ampscope-")]


def _wait_for_no_ampscope_threads(timeout: float) -> list[threading.Thread]:
    deadline = time.monotonic() + timeout
    while _ampscope_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    return _ampscope_threads()


def test_dropped_scalers_deliver_say_goodbye_and_leave_no_threads() -> None:
    assert _wait_for_no_ampscope_threads(DEADLOCK_GUARD_S) == [], "threads left by a test"
    with LoopbackExporter() as exporter:
        before = threading.active_count()
        for i in range(SCALERS):
            # A dropped reporter has exit_timeout to deliver: a deadlock guard here, so
            # that a loaded machine cannot turn a late delivery into a lost one.
            reporter = HttpReporter(
                exporter.url, flush_interval=0.05, timeout=2.0, exit_timeout=DEADLOCK_GUARD_S
            )
            scaler = ampscope.GradScaler("cpu", reporter=reporter, run_id=f"gc-{i}")
            _train(scaler)
            del scaler, reporter  # a notebook re-running its cell
        gc.collect()
        left = _wait_for_no_ampscope_threads(DEADLOCK_GUARD_S)
        assert left == [], [t.name for t in left]
        assert threading.active_count() <= before
        # Every dropped scaler delivered its records and then its final record.
        finals = {b.identity.run for b in exporter.heartbeats if b.final}
        assert finals == {f"gc-{i}" for i in range(SCALERS)}
        assert len(exporter.steps()) == 2 * SCALERS


def test_torch_scalers_leave_no_threads_either() -> None:
    # The baseline the test above holds ampscope to.
    before = threading.active_count()
    for _ in range(SCALERS):
        _train(torch.amp.GradScaler("cpu"))
    gc.collect()
    assert threading.active_count() <= before


def test_close_with_the_exporter_down_returns_and_stops_its_threads(monkeypatch) -> None:
    monkeypatch.setenv("AMPSCOPE_URL", f"http://127.0.0.1:{free_port()}")
    scaler = ampscope.GradScaler("cpu")  # reporter="auto": to AMPSCOPE_URL
    _train(scaler, 5)
    started = time.monotonic()
    scaler.close()  # retries for ever without its deadline: the guard would tell
    assert time.monotonic() - started < DEADLOCK_GUARD_S
    assert _wait_for_no_ampscope_threads(DEADLOCK_GUARD_S) == []


def test_snapshot_pickles_converts_to_dict_and_json() -> None:
    scaler = ampscope.GradScaler("cpu", reporter=None, sinks=[ListSink()])
    _train(scaler, 3)
    snap = scaler.telemetry.snapshot()
    scaler.close()
    again = pickle.loads(pickle.dumps(snap))
    assert again == snap
    as_dict = dataclasses.asdict(snap)
    assert as_dict["steps"] == 3
    assert as_dict["found_inf_local"] == {"cpu": 0}
    data = json.loads(json.dumps(snap.to_dict()))
    assert data["steps"] == 3
    assert data["scale"] == snap.scale
    assert data["last"]["step"] == 3
    assert data["last"]["identity"]["run"] == snap.last.identity.run


_EXIT_SCRIPT = """
import sys
sys.path.insert(0, {helpers!r})
import torch
import ampscope
from ampscope.reporter.http import HttpReporter
from helpers import Net, run

def main():
    # The scaler is collected when main() returns, just before interpreter exit.
    scaler = ampscope.GradScaler(
        "cpu", reporter=HttpReporter({url!r}, flush_interval=60.0), run_id="exit-run"
    )
    model = Net()
    run(scaler, model, [torch.optim.SGD(model.parameters(), lr=0.1)], 5)

main()
"""


def test_a_scaler_collected_just_before_exit_still_delivers_and_says_goodbye() -> None:
    # The collected scaler closes on a background thread; exit must wait for it.
    with LoopbackExporter() as exporter:
        script = _EXIT_SCRIPT.format(helpers=str(Path(__file__).parents[1]), url=exporter.url)
        subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
        assert exporter.steps() == [1, 2, 3, 4, 5]
        assert [b.final for b in exporter.heartbeats] == [True]
        assert exporter.events[-1] == "final"
