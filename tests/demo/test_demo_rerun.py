"""The demo's rerun run for real: ``ampscope demo --scenario rerun`` trains two spawned FSDP2
ranks that pass ``scaler.step(optimizer, rerun=closure)`` and note their sample ids, into a
real exporter; ``ampscope status`` then tells the bad sample from the one-time fault.

The last rank's batch holds a NaN sample at step 10 (30 % of 30 steps): every rank reruns,
the last rank's result comes back, the step is skipped: ``reproducible_fault``, and the
sample's id among the step's suspect batch ids. Rank 0's own gradients turn inf on the first
pass of step 19 only (a backward hook that fires once): the rerun is clean and the step goes
on: ``transient_fault``, an offence of rank 0's device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import DEADLOCK_GUARD_S, free_port

from ampscope.demo.exporter import ExporterProcess
from ampscope.demo.report import ampscope_command
from ampscope.demo.trainer import NAN_SAMPLE, sample_ids

pytestmark = pytest.mark.distributed

STEPS = 30
RUN = "tr-rerun"
NAN_STEP, FAULT_STEP = 10, 19


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=DEADLOCK_GUARD_S) as response:
        return json.load(response)


def _ampscope(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ampscope.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "AMPSCOPE_URL"},
    )


@pytest.fixture(scope="module")
def trained() -> Iterator[tuple[str, str]]:
    """(exporter URL, the demo's output) once the demo's rerun run has finished."""
    exporter = ExporterProcess(free_port())
    exporter.start()
    try:
        demo = _ampscope(
            "demo", "--scenario", "rerun", "--steps", str(STEPS),
            "--exporter-url", exporter.url, "--run-prefix", "tr",
        )  # fmt: skip
        output = demo.stdout + demo.stderr
        assert demo.returncode == 0, output
        yield exporter.url, output
    finally:
        exporter.stop()


def test_the_demo_says_which_fault_was_the_data_and_which_the_device(
    trained: tuple[str, str],
) -> None:
    url, output = trained
    assert "Every scenario drew the verdicts it was built to provoke." in output
    # The command as a shell runs this installation's ampscope (the venv's path if need be).
    command = ampscope_command()
    assert f"suspects      {command} status --url {url} {RUN} --suspect-batches" in output
    health = _get(f"{url}/api/v1/runs/{RUN}/health")
    verdicts = {v["rule"]: v for v in health["verdicts"]}
    assert health["status"] == "critical"
    assert {rule for rule, v in verdicts.items() if v["status"] != "ok"} == {
        "transient_fault",
        "reproducible_fault",
    }

    transient = verdicts["transient_fault"]
    assert transient["status"] == "critical"
    [device] = transient["evidence"]["ranks"]
    assert (device["rank"], device["step"], device["reruns"]) == (0, FAULT_STEP, 1)
    assert device["device"].endswith(":0")  # a CPU rank: <node>:<local_rank>
    assert device["first"]["norm"] is None  # the inf of the first pass
    assert device["second"]["norm"] is not None  # the rerun's clean gradients
    assert device["batch_ids"] == sample_ids(FAULT_STEP, 0, 2)

    data = verdicts["reproducible_fault"]
    assert data["status"] == "warning"
    [bad] = data["evidence"]["ranks"]
    assert (bad["rank"], bad["step"], bad["reruns"]) == (1, NAN_STEP, 1)
    assert sample_ids(NAN_STEP, 1, 2)[NAN_SAMPLE] in bad["batch_ids"]

    # Only the NaN step was skipped, on both ranks; the transient step went on.
    ranks = _get(f"{url}/api/v1/runs/{RUN}/ranks")
    assert [r["totals"]["skipped_steps"] for r in ranks] == [1, 1]
    assert [r["step"] for r in ranks] == [STEPS, STEPS]


def test_status_and_suspect_batches_name_the_ranks_steps_and_ids(
    trained: tuple[str, str],
) -> None:
    url, _ = trained
    table = _ampscope("status", "--url", url, RUN)
    assert table.returncode == 2, table.stdout + table.stderr  # critical
    lines = table.stdout.splitlines()
    assert any(
        line.split()[:2] == ["CRIT", "transient_fault"]
        and "rank 0 (node " in line
        and f"at step {FAULT_STEP} was not reproduced" in line
        for line in lines
    ), table.stdout
    assert any(
        line.split()[:2] == ["WARN", "reproducible_fault"]
        and f"reproduced rank 1's flagged result at step {NAN_STEP}" in line
        for line in lines
    ), table.stdout

    suspects = _ampscope("status", "--url", url, RUN, "--suspect-batches")
    assert suspects.returncode == 0, suspects.stderr
    listed = [json.loads(line) for line in suspects.stdout.splitlines()]
    assert [(s["step"], s["rank"], s["reasons"]) for s in listed] == [
        # A rerun's fault is flagged by the rerun's verdict alone (the fault rule).
        (NAN_STEP, 1, ["reproducible_fault"]),
        (FAULT_STEP, 0, ["transient_fault"]),
    ]
    assert listed[0]["batch_ids"] == sample_ids(NAN_STEP, 1, 2)
    assert listed[1]["batch_ids"] == sample_ids(FAULT_STEP, 0, 2)


def test_only_the_transient_fault_is_an_offence_of_a_device(trained: tuple[str, str]) -> None:
    url, _ = trained
    with urllib.request.urlopen(f"{url}/metrics", timeout=DEADLOCK_GUARD_S) as answer:
        families = list(text_string_to_metric_families(answer.read().decode()))
    samples = [
        (sample.name, sample.labels, sample.value)
        for family in families
        for sample in family.samples
        if sample.labels.get("run") == RUN
    ]
    reruns = {
        (labels["rank"], labels["result"]): value
        for name, labels, value in samples
        if name == "ampscope_reruns_total"
    }
    assert reruns == {("0", "transient"): 1, ("1", "reproducible"): 1}
    devices = {
        labels["rank"]: labels["device"]
        for name, labels, _ in samples
        if name == "ampscope_rank_info"
    }
    assert devices["0"] != devices["1"]  # each rank its own local rank, its own device
    offences = {
        (labels["device"], labels["kind"]): value
        for name, labels, value in samples
        if name == "ampscope_device_offences_total"
    }
    # Rank 0's device, once; the NaN sample on rank 1 is the data's: no offence of its device.
    assert offences == {(devices["0"], "transient_fault"): 1}
