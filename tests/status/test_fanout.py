"""``ampscope status --url A --url B …`` and ``--targets FILE`` as a user runs them, against
three real exporter processes standing in for three nodes, fed by real scalers whose
identities say node, rank and world size as torchrun's environment would."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from status_cli import run_status, train_scaler
from support import DEADLOCK_GUARD_S, free_port, interruptible

from ampscope.demo.exporter import ExporterProcess

RUN = "job-7"
STEPS = 12
STORMY = {3, 6, 9, 12}
"""Overflow steps of both ranks of node n1: 4 skipped of 12 is a skip storm (a warning).
Without a process group, the other nodes' scalers never see these overflows: n1's scale
falls to 2^6 while theirs stays 2^10, a desync that n1's exporter cannot see (its two ranks
agree) and only the merged view, comparing every node's aligned scales, shows."""
LAYOUT = {"n0": (0, 1), "n1": (2, 3), "n2": (4,)}
"""Node -> ranks that report. World size 6: rank 5 (n2's second) never reports."""


def _train(url: str, node: str, rank: int, overflow: set[int]) -> None:
    """A real ampscope GradScaler on CPU reporting ``RUN`` to ``url`` as ``rank`` of 6."""
    env = {
        "AMPSCOPE_NODE": node,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % 2),
        "WORLD_SIZE": "6",
        "LOCAL_WORLD_SIZE": "2",
        "SLURM_JOB_ID": "4242",
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        patch.delenv("AMPSCOPE_JOB_ID", raising=False)
        train_scaler(url, RUN, STEPS, overflow)


@pytest.fixture(scope="module")
def nodes() -> Iterator[dict[str, str]]:
    """Node -> its exporter's URL, once every rank's 12 steps are held."""
    processes = {node: ExporterProcess(free_port()) for node in LAYOUT}
    try:
        for process in processes.values():
            process.start()
        for node, ranks in LAYOUT.items():
            for rank in ranks:
                _train(processes[node].url, node, rank, STORMY if node == "n1" else set())
        deadline = time.monotonic() + DEADLOCK_GUARD_S
        for node, process in processes.items():
            while True:
                url = f"{process.url}/api/v1/runs/{RUN}/ranks"
                try:
                    with urllib.request.urlopen(url, timeout=DEADLOCK_GUARD_S) as response:
                        held = json.load(response)
                except urllib.error.HTTPError:
                    held = []
                if sorted((r["rank"], r["state"]) for r in held) == [
                    (rank, "finished") for rank in LAYOUT[node]
                ]:
                    break
                assert time.monotonic() < deadline, held
                time.sleep(0.1)
        yield {node: process.url for node, process in processes.items()}
    finally:
        for process in processes.values():
            process.stop()


def _urls(nodes: dict[str, str]) -> list[str]:
    return [arg for url in nodes.values() for arg in ("--url", url)]


def test_each_exporter_alone_sees_one_node_and_cannot_judge_missing_ranks(
    nodes: dict[str, str],
) -> None:
    answer = json.loads(run_status(RUN, "--json", "--url", nodes["n2"]).stdout)
    assert [r["rank"] for r in answer["ranks"]] == [4]
    assert answer["missing_ranks"] == []
    (verdict,) = [v for v in answer["health"]["verdicts"] if v["rule"] == "missing_rank"]
    assert (verdict["status"], verdict["evidence"]["judged"]) == ("ok", False)
    assert answer["ranks"][0]["job_id"] == "4242"


def test_the_merged_run_names_the_missing_rank_and_the_warning_node(
    nodes: dict[str, str],
) -> None:
    result = run_status(RUN, *_urls(nodes))
    assert result.returncode == 2, result.stderr  # the desync between nodes
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"run {RUN}: CRITICAL, 5/5 rank(s) up (5 finished) of world size 6")
    assert "3/3 exporter(s) answered" in lines[0]
    assert lines[1] == "missing ranks (1): 5"
    rows = {line.split()[0]: line.split() for line in lines[4:7]}
    assert rows["n0"] == ["n0", "2", "2", "finished", "12", "OK"]
    assert rows["n1"] == ["n1", "2", "2", "finished", "12", "CRITICAL"]
    assert rows["n2"] == ["n2", "1", "1", "finished", "12", "OK"]
    outliers = lines[lines.index("outlier ranks:") + 1 :]
    assert [line.split()[0] for line in outliers[1:3]] == ["2", "3"]
    assert outliers[1].split()[-1] == "skip_storm,scale_desync"
    verdicts = {line.split()[1]: line.split(maxsplit=2) for line in lines if line.startswith("  ")}
    assert verdicts["missing_rank"][0] == "WARN"
    assert verdicts["skip_storm"][0] == "WARN"
    assert verdicts["lost_rank"][0] == "ok"
    assert verdicts["scale_desync"] == [
        "CRIT",
        "scale_desync",
        "ranks disagree on the loss scale at aligned step 10: 2 of 5 rank(s) differ from the "
        "majority's 1024, on node(s) n1",
    ]
    # Each node's exporter alone sees no desync: its ranks agree with each other.
    for url in nodes.values():
        alone = json.loads(run_status(RUN, "--json", "--url", url).stdout)
        assert {v["rule"]: v["status"] for v in alone["health"]["verdicts"]}["scale_desync"] == "ok"


def test_merged_json_has_the_single_exporter_keys_and_missing_ranks(
    nodes: dict[str, str],
) -> None:
    single = json.loads(run_status(RUN, "--json", "--url", nodes["n0"]).stdout)
    result = run_status(RUN, "--json", *_urls(nodes))
    merged = json.loads(result.stdout)
    assert result.returncode == 2
    assert set(single) <= set(merged)
    assert set(single["health"]) == set(merged["health"])
    assert set(single["ranks"][0]) == set(merged["ranks"][0])
    assert [(r["rank"], r["node"]) for r in merged["ranks"]] == [
        (0, "n0"),
        (1, "n0"),
        (2, "n1"),
        (3, "n1"),
        (4, "n2"),
    ]
    assert merged["missing_ranks"] == [5]
    assert [v["rule"] for v in merged["health"]["verdicts"]] == [
        v["rule"] for v in single["health"]["verdicts"]
    ]
    storm = {v["rule"]: v for v in merged["health"]["verdicts"]}["skip_storm"]
    assert [e["url"] for e in storm["evidence"]["exporters"]] == [nodes["n1"]]
    assert [t["status"] for t in merged["targets"]] == ["ok", "ok", "ok"]
    # Without RUN: the run listed once, its ranks counted over every node.
    listing = json.loads(run_status("--json", *_urls(nodes)).stdout)
    (summary,) = listing["runs"]
    assert (summary["run"], summary["ranks"], summary["world_size"]) == (RUN, 5, 6)
    assert listing["missing_ranks"] == {RUN: [5]}


def test_a_dead_target_is_named_and_hides_nothing(nodes: dict[str, str], tmp_path: Path) -> None:
    dead = f"127.0.0.1:{free_port()}"
    hosts = [url.removeprefix("http://") for url in nodes.values()]
    # The file the Slurm recipe writes (YAML flow form), and its JSON twin.
    yaml_file = tmp_path / "ampscope-4242.yml"
    yaml_file.write_text("- targets: [" + ", ".join(f'"{h}"' for h in [*hosts, dead]) + "]\n")
    json_file = tmp_path / "ampscope-4242.json"
    json_file.write_text(json.dumps([{"targets": hosts[:2]}, {"targets": [hosts[2], dead]}]))
    for targets in (yaml_file, json_file):
        result = run_status(RUN, "--targets", str(targets))
        assert result.returncode == 2, result.stderr
        assert "3/4 exporter(s) answered" in result.stdout
        assert "missing ranks (1): 5" in result.stdout
        failed = result.stdout.splitlines()[-1].split()
        assert failed[:2] == ["unreachable", f"http://{dead}:"]
    # No target answers: 3, each named.
    other = f"127.0.0.1:{free_port()}"
    result = run_status(RUN, "--url", f"http://{dead}", "--url", f"http://{other}")
    assert result.returncode == 3
    assert f"http://{dead}:" in result.stderr
    assert f"http://{other}:" in result.stderr
    # Every answering target lacks the run: 4.
    result = run_status("no-such-run", *_urls(nodes))
    assert result.returncode == 4
    assert "none of the 3 exporter(s) holds run 'no-such-run'" in result.stderr
    # A malformed targets file is an error of its own.
    bad = tmp_path / "bad.yml"
    bad.write_text("targets: 7\n")
    result = run_status(RUN, "--targets", str(bad))
    assert result.returncode == 3
    assert "--targets" in result.stderr


def test_watch_redraws_the_whole_job_until_interrupted(nodes: dict[str, str]) -> None:
    process = interruptible(
        [sys.executable, "-m", "ampscope.cli", "status", RUN, "--watch", "--interval", "0.2",
         *_urls(nodes)],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    assert process.stdout is not None
    frames = 0
    for line in process.stdout:  # each frame is flushed: read until the second one
        frames += line.startswith(f"run {RUN}: CRITICAL") and "3/3 exporter(s)" in line
        if frames == 2:
            break
    process.send_signal(signal.SIGINT)  # as Ctrl-C
    out, _ = process.communicate(timeout=DEADLOCK_GUARD_S)
    assert process.returncode == 2  # the last frame's worst verdict
    assert frames == 2, out
