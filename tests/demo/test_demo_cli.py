"""`ampscope demo` run for real: exporter subprocess, spawned FSDP2 ranks, verdicts."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from support import DEADLOCK_GUARD_S, free_port

from ampscope.demo.report import ampscope_command

STEPS = 30
PREFIX = "t"
BAD_BATCH_STEP = 23  # the spike run's bad batch: the first step past 3/4 of 30


def _demo(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ampscope.cli", "demo", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=DEADLOCK_GUARD_S) as response:
        return json.load(response)


def _lines_until(process: subprocess.Popen[str], marker: str, timeout: float) -> list[str]:
    """stdout lines up to and including the first holding ``marker``."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        if line is None:
            break
        seen.append(line)
        if marker in line:
            return seen
    process.kill()
    pytest.fail(f"no {marker!r} in the demo's output:\n" + "\n".join(seen))


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} {labels} on /metrics")


@pytest.mark.distributed
def test_demo_trains_into_every_expected_verdict_and_keeps_serving() -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    process = _demo(
        "--steps", str(STEPS), "--port", str(port), "--run-prefix", PREFIX, "--keep-serving"
    )
    try:
        output = _lines_until(process, "Ctrl-C stops it", timeout=240)
        text = "\n".join(output)
        assert f"step   {STEPS}/{STEPS}" in text
        assert "<- ranks disagree" in text  # the desync run, live
        assert "Every scenario drew the verdicts it was built to provoke." in text
        assert f"web view      {base}/   (run page: {base}/run?id={PREFIX}-hotspot)" in text
        with urllib.request.urlopen(f"{base}/", timeout=DEADLOCK_GUARD_S) as page:
            assert "ampscope" in page.read().decode()
        for rule in (
            "inf_hotspot",
            "scale_collapse",
            "skip_storm",
            "scale_desync",
            "loss_spike",
            "grad_norm_spike",
            "origin_outlier",
            "reproducible_fault",
            "transient_fault",
        ):
            assert re.search(rf"(CRIT|WARN|hist) {rule} .*\(expected\)", text), rule
        # The spike run's verdicts name the last rank and the bad batch's step: history, as
        # the run finished normally after it.
        history = "history, the run finished normally since: "
        assert re.search(
            rf"hist loss_spike +{history}loss spiked on rank 1 \(node [^)]+\) at step "
            rf"{BAD_BATCH_STEP}: ",
            text,
        )
        assert re.search(
            rf"hist origin_outlier +{history}rank 1's own gradients were x\S+ the median of "
            rf"the other ranks at step {BAD_BATCH_STEP} ",
            text,
        )

        # The exporter the demo started still serves everything it was told.
        runs = {run["run"]: run for run in _get(f"{base}/api/v1/runs")}
        names = ["overflow", "hotspot", "collapse", "desync", "spike", "rerun"]
        assert set(runs) == {f"{PREFIX}-{name}" for name in names}
        for run in runs.values():
            assert (run["ranks"], run["up"], run["newest_step"]) == (2, 2, STEPS)

        health = {name: _get(f"{base}/api/v1/runs/{PREFIX}-{name}/health") for name in names}
        verdicts = {
            name: {v["rule"]: v for v in report["verdicts"]} for name, report in health.items()
        }
        assert health["overflow"]["status"] == "ok"
        assert verdicts["hotspot"]["inf_hotspot"]["status"] == "warning"
        assert verdicts["hotspot"]["inf_hotspot"]["evidence"]["source"] == "origin"
        assert verdicts["collapse"]["scale_collapse"]["status"] == "critical"
        assert verdicts["collapse"]["skip_storm"]["status"] == "warning"
        assert verdicts["desync"]["scale_desync"]["status"] == "critical"
        assert verdicts["desync"]["scale_collapse"]["status"] == "ok"

        # The spike run: rank 1's one bad batch, finite in fp16, so nothing was skipped; its
        # loss and its own gradients stood out at that step, and only there. The run went on
        # and finished normally: its spikes are history, and it is ok.
        spike = verdicts["spike"]
        assert health["spike"]["status"] == "ok"
        assert {rule for rule, v in spike.items() if v["evidence"].get("history")} == {
            "loss_spike",
            "grad_norm_spike",
            "origin_outlier",
        }
        for rule in ("loss_spike", "origin_outlier"):
            assert spike[rule]["status"] == "ok"
            [hit] = spike[rule]["evidence"]["ranks"]
            assert (hit["rank"], hit["spikes"], hit["step"]) == (1, 1, BAD_BATCH_STEP), rule
        assert spike["origin_outlier"]["evidence"]["ranks"][0]["ratio"] >= 10
        assert [s["step"] for s in spike["grad_norm_spike"]["evidence"]["steps"]] == [
            BAD_BATCH_STEP
        ]
        spike_ranks = _get(f"{base}/api/v1/runs/{PREFIX}-spike/ranks")
        assert [r["totals"]["skipped_steps"] for r in spike_ranks] == [0, 0]

        ranks = _get(f"{base}/api/v1/runs/{PREFIX}-hotspot/ranks")
        origin = [sum(r["totals"]["found_inf_origin"].values()) for r in ranks]
        local = [sum(r["totals"]["found_inf_local"].values()) for r in ranks]
        skipped = [r["totals"]["skipped_steps"] for r in ranks]
        # Outliers every 5th step on rank 1 only: its own gradients overflow, and every
        # rank skips those steps (the found-inf all-reduce); rank 0's own gradients stay clean.
        assert origin == [0, STEPS // 5]
        assert skipped == [STEPS // 5, STEPS // 5]
        assert local[1] >= 1
        assert ranks[1]["totals"]["nonfinite_params"]

        with urllib.request.urlopen(f"{base}/metrics", timeout=DEADLOCK_GUARD_S) as answer:
            metrics = answer.read().decode()
        # Half the run's forward passes overflowed: 15 halvings from 2^16.
        assert _metric(metrics, "ampscope_loss_scale", run=f"{PREFIX}-collapse", rank="0") == 2.0
        desync = [
            _metric(metrics, "ampscope_loss_scale", run=f"{PREFIX}-desync", rank=str(rank))
            for rank in (0, 1)
        ]
        assert desync[0] != desync[1]
        assert (
            _metric(metrics, "ampscope_found_inf_origin_total", run=f"{PREFIX}-hotspot", rank="1")
            == STEPS // 5
        )
    finally:
        process.send_signal(signal.SIGINT)
        try:
            rest, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert process.returncode == 0, rest
    with pytest.raises(urllib.error.URLError):  # Ctrl-C stopped the exporter too
        urllib.request.urlopen(f"{base}/healthz", timeout=2)


@pytest.mark.distributed
def test_without_keep_serving_the_exporter_has_stopped_before_any_link() -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    process = _demo("--scenario", "overflow", "--steps", str(STEPS), "--port", str(port))
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    output: list[str] = []
    stopped_at = None
    try:
        while (line := lines.get(timeout=240)) is not None:
            output.append(line)
            if stopped_at is None and "The exporter has stopped with the demo" in line:
                stopped_at = len(output) - 1
                # Printed once the exporter has exited: nothing answers any more.
                with pytest.raises(urllib.error.URLError):
                    urllib.request.urlopen(f"{base}/healthz", timeout=2)
        assert process.wait(timeout=DEADLOCK_GUARD_S) == 0, "\n".join(output)
    finally:
        if process.poll() is None:
            process.kill()
    assert stopped_at is not None, "\n".join(output)
    trained = next(i for i, line in enumerate(output) if line.startswith("trained in"))
    # After training, no line names the stopped exporter: no link, no command to it.
    assert not [line for line in output[trained:] if base in line], "\n".join(output)
    assert "Where to look" not in output
    # Instead, how to keep it serving: the same options and --keep-serving, as a command
    # that runs as printed (this installation's ampscope, the venv's path if need be).
    again = output[-1].strip()
    assert again == (
        f"{ampscope_command()} demo --scenario overflow --steps {STEPS} --port {port} "
        "--keep-serving"
    ), "\n".join(output)


def test_taken_port_and_missing_exporter_are_explained() -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        taken = _demo("--port", str(port))
        out, _ = taken.communicate(timeout=60)
    assert taken.returncode == 2
    assert f"port {port} on 127.0.0.1 is taken (another program uses it)" in out
    assert "--exporter-url" in out

    nowhere = f"http://127.0.0.1:{free_port()}"
    missing = _demo("--exporter-url", nowhere)
    out, _ = missing.communicate(timeout=60)
    assert missing.returncode == 2
    assert f"no exporter answers {nowhere}/healthz" in out
