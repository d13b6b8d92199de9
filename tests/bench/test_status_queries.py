"""``python -m bench.status_queries`` at 4 nodes: a smoke test of the harness, not a timed
assertion. Both figures of each round come out (the first round's queries, and the whole
answer with the command's and the store's CPU seconds), for each tree given; with ``--each``,
each query alone (the summary reads too) and the rounds without every rank's gauges."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from support import need_tool

REPO = Path(__file__).resolve().parents[2]


def test_each_round_times_the_first_round_and_the_whole_answer(tmp_path: Path) -> None:
    need_tool("victoria-metrics")
    done = subprocess.run(
        [
            *(sys.executable, "-m", "bench.status_queries", "--nodes", "4", "--rounds", "1"),
            "--each",
            *("--tree", str(REPO), "--data", str(tmp_path / "vm")),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stdout
    assert re.search(rf"round 0 {re.escape(str(REPO))}: [\d.]+ s, [\d,]+ series", out), out
    answer = rf"round 0 {re.escape(str(REPO))} answer: [\d.]+ s, command CPU [\d.]+ s, store CPU"
    assert re.search(answer, out), out
    assert f"{REPO}: answer median" in out
    each = rf"each {re.escape(str(REPO))} (now|summary ranks): [\d.]+ s, store CPU [\d.]+ s, "
    assert len(re.findall(each + r"[\d,]+ series", out)) == 2, out
    # The summary reads answer: the info series of the 31 ranks that report (one never
    # does), the run's step range (its largest and smallest).
    assert re.search(each.replace("(now|summary ranks)", "summary ranks") + "31 series", out)
    assert re.search(each.replace("(now|summary ranks)", "summary step_range") + "2 series", out)
    assert f"without now {REPO}: first round without every rank's gauges" in out
    assert f"summary round {REPO}: the summary reads in place of now, state and peak" in out


def test_the_same_job_is_read_from_prometheus(tmp_path: Path) -> None:
    """``--store prometheus`` backfills the job with promtool and times the same queries and
    answer against Prometheus: the 31 ranks that report are there."""
    need_tool("prometheus")
    need_tool("promtool")
    done = subprocess.run(
        [
            *(sys.executable, "-m", "bench.status_queries", "--nodes", "4", "--rounds", "1"),
            *("--each", "--store", "prometheus", "--data", str(tmp_path / "prometheus")),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stdout
    assert re.search(r"loaded [\d,]+ samples", out), out
    assert re.search(r"round 0 \.: [\d.]+ s, [\d,]+ series", out), out
    assert re.search(r"round 0 \. answer: [\d.]+ s, command CPU [\d.]+ s, store CPU", out), out
    assert re.search(r"each \. summary ranks: [\d.]+ s, store CPU [\d.]+ s, 31 series", out), out
    assert "summary round .: the summary reads in place of now, state and peak" in out
