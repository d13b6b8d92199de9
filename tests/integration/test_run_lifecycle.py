"""Run lifecycle with real processes: an exporter (``--stale-after 1.5 --stall-after 3``),
ranks as separate Python processes with the default reporter, and a real Prometheus
scraping every second with the shipped rules.

The rules are loaded as shipped except that every ``for:`` becomes 1 s, so that an alert
fires within seconds; the promtool unit tests in deploy/prometheus/tests check the real
durations. The exporter-restart tests run their own exporter (no Prometheus), killed and
started again on its port. About 60 s on 2 cores, most of it the ranks importing torch.
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
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import (
    DEADLOCK_GUARD_S,
    free_port,
    need_tool,
    rules_evaluated_after,
    start_prometheus,
    stop_process,
)

from ampscope.demo.exporter import ExporterProcess

pytestmark = [pytest.mark.prometheus, pytest.mark.distributed]

STALE_AFTER = 1.5
STALL_AFTER = 3.0
RULES_FILE = Path(__file__).parents[2] / "deploy" / "prometheus" / "rules" / "ampscope-alerts.yml"
SCRIPT = Path(__file__).parent / "lifecycle_rank.py"


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=DEADLOCK_GUARD_S) as response:
        return json.load(response)


def _until(check: Callable[[], Any], what: str, timeout: float = DEADLOCK_GUARD_S) -> Any:
    """``check()``'s first true value, polled every 0.2 s; fails after ``timeout`` (a
    deadlock guard: conditions are waited for, never given a window)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout:.0f}s")
        time.sleep(0.2)


class Stack:
    def __init__(self, exporter: str, prometheus: str) -> None:
        self.exporter = exporter
        self.prometheus = prometheus

    def rank(
        self, run: str, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        variables = {k: v for k, v in os.environ.items() if not k.startswith("AMPSCOPE_")}
        variables.update(AMPSCOPE_URL=self.exporter, AMPSCOPE_RUN_ID=run, **(env or {}))
        return subprocess.Popen(
            [sys.executable, str(SCRIPT), *args],
            env=variables,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def view(self, run: str, rank: int = 0) -> dict[str, Any] | None:
        """The rank as ``GET /api/v1/runs/{run}/ranks/{rank}`` shows it; ``None`` if unknown."""
        try:
            view: dict[str, Any] = _get(f"{self.exporter}/api/v1/runs/{run}/ranks/{rank}")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        return view

    def state(self, run: str, rank: int = 0) -> str | None:
        view = self.view(run, rank)
        return None if view is None else str(view["state"])

    def health(self, run: str) -> dict[str, Any]:
        report: dict[str, Any] = _get(f"{self.exporter}/api/v1/runs/{run}/health")
        return report

    def alerts(self, run: str) -> list[tuple[str, str, str]]:
        """(alert name, rank, state) of every pending or firing alert of ``run``."""
        answer = _get(f"{self.prometheus}/api/v1/alerts")["data"]["alerts"]
        return sorted(
            (a["labels"]["alertname"], a["labels"].get("rank", ""), a["state"])
            for a in answer
            if a["labels"].get("run") == run
        )

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"{self.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        result: list[dict[str, Any]] = _get(url)["data"]["result"]
        return result


def _ready(process: subprocess.Popen[str]) -> None:
    assert process.stdout is not None
    lines = []
    for line in process.stdout:  # torch may warn first
        if line.strip() == "ready":
            return
        lines.append(line)
    pytest.fail("the rank exited before it was ready:\n" + "".join(lines))


def _own_totals(process: subprocess.Popen[str]) -> dict[str, Any]:
    """The totals an ``idle`` rank printed, read up to its ``ready``."""
    assert process.stdout is not None
    lines, totals = [], None
    for line in process.stdout:
        if line.startswith("totals "):
            totals = json.loads(line[len("totals ") :])
        elif line.strip() == "ready" and totals is not None:
            return totals
        lines.append(line)
    pytest.fail("the rank exited before it was ready:\n" + "".join(lines))


def _stop(*processes: subprocess.Popen[Any]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(10)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    need_tool("prometheus")
    workdir = Path(tempfile.mkdtemp(prefix="ampscope-lifecycle-"))
    rules = yaml.safe_load(RULES_FILE.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                rule["for"] = "1s"
    (workdir / "rules.yml").write_text(yaml.safe_dump(rules))
    exporter = ExporterProcess(free_port(), stale_after=STALE_AFTER, stall_after=STALL_AFTER)
    exporter.start()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(workdir / "rules.yml")],
        "scrape_configs": [
            {"job_name": "ampscope", "static_configs": [{"targets": [exporter.url[7:]]}]}
        ],
    }
    prometheus = None
    try:
        prometheus, url = start_prometheus(config, workdir)
        yield Stack(exporter.url, url)
    finally:
        if prometheus is not None:
            stop_process(prometheus)
        exporter.stop()


def test_finished_runs_are_finished_ok_and_fire_nothing(stack: Stack) -> None:
    clean = stack.rank("lc-clean", "finish")
    collapsed = stack.rank("lc-collapse", "collapse")
    seen_for_clean: set[tuple[str, str, str]] = set()
    outputs = []
    try:
        for process in (clean, collapsed):
            while process.poll() is None:
                seen_for_clean.update(stack.alerts("lc-clean"))
                time.sleep(0.2)
            outputs.append(process.stdout.read() if process.stdout else "")
            assert process.returncode == 0, outputs[-1]
    finally:
        _stop(clean, collapsed)
    # Normal interpreter exit, no close(): the final record marks both finished.
    for run in ("lc-clean", "lc-collapse"):
        _until(
            lambda run=run: stack.state(run) == "finished",
            f"{run} not finished: {_get(f'{stack.exporter}/api/v1/runs/{run}/ranks')} {outputs}",
        )
    report = stack.health("lc-clean")
    assert (report["status"], report["state"]) == ("ok", "finished")
    assert report["states"] == {
        "running": 0,
        "stalled": 0,
        "lost": 0,
        "finished": 1,
        "failed": 0,
        "stopped": 0,
    }
    # The collapsed run says how it ended, but pages nobody.
    report = stack.health("lc-collapse")
    assert report["state"] == "finished"
    assert {v["rule"]: v["status"] for v in report["verdicts"]}["scale_collapse"] == "critical"
    (scraped,) = _until(
        lambda: stack.query(
            'timestamp(ampscope_rank_state{run="lc-collapse", state="finished"} == 1)'
        ),
        "prometheus did not scrape the finished state",
    )
    assert stack.query('ampscope_loss_scale{run="lc-collapse"} < 1'), "the scale collapsed"
    # Every rule group evaluated after the scrape that saw the run finished: an alert left
    # pending from the run's last steps is resolved by then.
    _until(
        lambda: rules_evaluated_after(stack.prometheus, float(scraped["value"][1])),
        "the rules were not evaluated after the finished scrape",
    )
    # Through several stale-after periods and rule evaluations: no alert, not even pending.
    end = time.monotonic() + 3 * STALE_AFTER + 2
    while time.monotonic() < end:
        assert stack.alerts("lc-collapse") == []
        seen_for_clean.update(stack.alerts("lc-clean"))
        time.sleep(0.3)
    assert seen_for_clean == set()
    assert stack.state("lc-clean") == "finished"


def test_a_rank_pausing_for_several_stale_periods_is_never_lost(stack: Stack) -> None:
    pause = 3.5 * STALE_AFTER
    process = stack.rank("lc-pause", "pause", str(pause))
    seen: list[str] = []
    try:
        _ready(process)
        while process.poll() is None:
            state = stack.state("lc-pause")
            if state is not None and (not seen or seen[-1] != state):
                seen.append(state)
            time.sleep(0.1)
        assert process.returncode == 0
    finally:
        _stop(process)
    _until(lambda: stack.state("lc-pause") == "finished", "not finished")
    assert "lost" not in seen, seen
    # Paused past --stall-after: stalled (then running for its last steps, often too briefly
    # for a poll to see), never lost.
    assert seen[:2] == ["running", "stalled"], seen


def _paused_for(stack: Stack, run: str, seconds: float) -> dict[str, Any] | None:
    """The rank's view once the exporter says it paused more than ``seconds`` ago."""
    view = stack.view(run)
    pause = None if view is None else view.get("pause")
    return view if pause and pause["seconds"] > seconds else None


def test_a_rank_paused_on_purpose_past_the_stall_limit_runs_and_pages_nobody(
    stack: Stack,
) -> None:
    # The same rank without its pause stalls past --stall-after (the test above), and its
    # alert fires: only what the rank said tells a checkpoint save from a hang.
    process = stack.rank("lc-ckpt", "checkpoint")
    try:
        _ready(process)
        view = _until(
            lambda: _paused_for(stack, "lc-ckpt", 2 * STALL_AFTER),
            "the exporter did not hold the rank paused past the stall limit",
        )
        assert (view["state"], view["pause"]["reason"]) == ("running", "checkpoint")
        verdicts = {v["rule"]: v for v in stack.health("lc-ckpt")["verdicts"]}
        assert verdicts["stalled_rank"]["status"] == "ok"
        assert "rank 0 (node " in verdicts["stalled_rank"]["summary"]
        assert ") paused (checkpoint) for " in verdicts["stalled_rank"]["summary"]
        # A scrape after that and the rules evaluated over it: nothing pending or firing.
        seen_at = time.time()

        def scraped_after() -> float | None:
            query = 'timestamp(ampscope_rank_state{run="lc-ckpt", state="running"} == 1)'
            times = [float(sample["value"][1]) for sample in stack.query(query)]
            return next((t for t in times if t > seen_at), None)

        scraped = _until(scraped_after, "prometheus did not scrape the paused rank running")
        _until(
            lambda: rules_evaluated_after(stack.prometheus, scraped),
            "the rules were not evaluated after the scrape",
        )
        assert stack.alerts("lc-ckpt") == []
        # ampscope status over Prometheus says it as the exporter does: the rank, running,
        # and what it pauses for (ampscope_rank_pause_start_timestamp_seconds).
        result = _status("lc-ckpt", "--prometheus", stack.prometheus, "--json")
        assert result.returncode == 0, result.stdout + result.stderr
        answer = json.loads(result.stdout)
        (rank,) = answer["ranks"]
        assert (rank["state"], rank["pause"]["reason"]) == ("running", "checkpoint")
        assert rank["pause"]["seconds"] > 2 * STALL_AFTER
        assert process.stdin is not None
        process.stdin.write("\n")
        process.stdin.close()
        assert process.wait(DEADLOCK_GUARD_S) == 0
    finally:
        _stop(process)
    _until(lambda: stack.state("lc-ckpt") == "finished", "not finished")
    view = stack.view("lc-ckpt")
    assert view is not None
    assert view["pause"] is None


def test_a_pause_past_pause_limit_s_stalls_the_rank() -> None:
    """A pause left open (a hang inside a save) is only a longer limit."""
    exporter = ExporterProcess(
        free_port(),
        stale_after=STALE_AFTER,
        stall_after=STALL_AFTER,
        env={"AMPSCOPE_PAUSE_LIMIT_S": str(2 * STALL_AFTER)},
    )
    exporter.start()
    stack = Stack(exporter.url, prometheus="")
    process = stack.rank("lc-ckpt-hang", "checkpoint")
    try:
        _ready(process)
        view = _until(
            lambda: (v := stack.view("lc-ckpt-hang")) is not None and v["state"] == "stalled" and v,
            "the paused rank did not stall past pause_limit_s",
        )
        assert view["pause"]["reason"] == "checkpoint"
        verdict = {v["rule"]: v for v in stack.health("lc-ckpt-hang")["verdicts"]}["stalled_rank"]
        assert verdict["status"] == "warning"
        assert "paused past pause_limit_s 6 s: rank 0 paused (checkpoint) for" in verdict["summary"]
        assert verdict["thresholds"] == {"stall_after_s": STALL_AFTER, "pause_limit_s": 6.0}
    finally:
        _stop(process)
        exporter.stop()


def test_a_sigkilled_rank_is_lost_and_the_alert_fires(stack: Stack) -> None:
    process = stack.rank("lc-killed", "hang")
    try:
        _ready(process)
        _until(lambda: stack.state("lc-killed") == "running", "not running")
        os.kill(process.pid, signal.SIGKILL)
        started = time.monotonic()
        _until(lambda: stack.state("lc-killed") == "lost", "not lost")
        assert time.monotonic() - started >= STALE_AFTER - 0.6  # not before --stale-after
    finally:
        _stop(process)
    report = stack.health("lc-killed")
    lost = {v["rule"]: v for v in report["verdicts"]}["lost_rank"]
    assert lost["status"] == "critical"  # 1 of 1 rank lost
    firing = _until(
        lambda: ("AmpscopeRankLost", "0", "firing") in stack.alerts("lc-killed"),
        "AmpscopeRankLost did not fire",
    )
    assert firing
    assert not [a for a in stack.alerts("lc-killed") if a[0] != "AmpscopeRankLost"]


def test_a_sigtermed_rank_is_stopped_and_no_alert_fires(stack: Stack) -> None:
    """What torchrun's elastic restart, a Slurm preemption or a Kubernetes eviction does to a
    rank: SIGTERM. The rank says so and ends by the signal; nobody is paged."""
    process = stack.rank("lc-stopped-by-launcher", "hang")
    try:
        _ready(process)
        _until(lambda: stack.state("lc-stopped-by-launcher") == "running", "not running")
        process.send_signal(signal.SIGTERM)
        assert process.wait(DEADLOCK_GUARD_S) == -signal.SIGTERM
    finally:
        _stop(process)
    _until(lambda: stack.state("lc-stopped-by-launcher") == "stopped", "not stopped")
    (scraped,) = _until(
        lambda: stack.query(
            'timestamp(ampscope_rank_state{run="lc-stopped-by-launcher", state="stopped"} == 1)'
        ),
        "prometheus did not scrape the stopped state",
    )
    _until(
        lambda: rules_evaluated_after(stack.prometheus, float(scraped["value"][1])),
        "the rules were not evaluated after the stopped scrape",
    )
    # Through several stale-after periods and rule evaluations: no alert, not even pending.
    end = time.monotonic() + 3 * STALE_AFTER + 2
    while time.monotonic() < end:
        assert stack.alerts("lc-stopped-by-launcher") == []
        time.sleep(0.3)
    assert stack.state("lc-stopped-by-launcher") == "stopped"
    verdicts = {v["rule"]: v for v in stack.health("lc-stopped-by-launcher")["verdicts"]}
    assert verdicts["lost_rank"]["status"] == "ok"


def test_a_hang_before_a_collective_stalls_both_ranks_and_names_the_culprit(
    stack: Stack,
) -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    waiting = stack.rank("lc-hang", "gloo", "0", "0", env=env)
    culprit = stack.rank("lc-hang", "gloo", "1", "8", env=env)
    try:
        _ready(waiting)
        _ready(culprit)

        def stalled() -> dict[str, Any] | None:
            if stack.state("lc-hang", 1) is None:
                return None  # the ranks' first records are still on their way
            verdicts = {v["rule"]: v for v in stack.health("lc-hang")["verdicts"]}
            verdict: dict[str, Any] = verdicts["stalled_rank"]
            return verdict if verdict["evidence"].get("culprit") else None

        verdict = _until(stalled, "both ranks did not stall")
        assert [stack.state("lc-hang", r) for r in (0, 1)] == ["stalled", "stalled"]
        assert verdict["evidence"]["stalled"] == 2
        assert verdict["evidence"]["culprit"]["rank"] == 1
        assert verdict["evidence"]["culprit"]["last_step"] == 7
        assert [r["last_step"] for r in verdict["evidence"]["ranks"]] == [7, 10]
        assert "rank 1 (node" in verdict["summary"]
        assert "the likely culprit" in verdict["summary"]
    finally:
        _stop(waiting, culprit)


def test_an_idle_rank_reappears_after_an_exporter_restart_and_is_never_lost() -> None:
    """An exporter restart (a DaemonSet rolling update, a crash) while a rank is idle: its
    next heartbeat is not applied, so its reporter sends the newest record again."""
    exporter = ExporterProcess(free_port(), stale_after=STALE_AFTER, stall_after=STALL_AFTER)
    exporter.start()
    stack = Stack(exporter.url, prometheus="")
    process = stack.rank("lc-restart", "idle")
    try:
        totals = _own_totals(process)
        _until(lambda: stack.state("lc-restart") == "running", "not running")
        exporter.kill()  # its memory is lost
        exporter.start()
        view = _until(lambda: stack.view("lc-restart"), "the rank did not reappear")
        assert view["state"] in ("running", "stalled")
        assert (view["step"], view["totals"], view["restarts"]) == (6, totals, 0)
        # Idle for longer than --stall-after and several --stale-after: stalled, never lost.
        seen: list[str | None] = [view["state"]]
        end = time.monotonic() + STALL_AFTER + 2 * STALE_AFTER
        while time.monotonic() < end:
            state = stack.state("lc-restart")
            if state != seen[-1]:
                seen.append(state)
            time.sleep(0.1)
        assert seen[-1] == "stalled"
        assert set(seen) <= {"running", "stalled"}, seen  # never lost, never gone
        assert process.poll() is None
    finally:
        _stop(process)
        exporter.stop()


def test_a_rank_closing_after_an_exporter_restart_ends_finished() -> None:
    # Default --stale-after: the reporter beats every 10 s, so the rank's first contact with
    # the restarted exporter is (usually) its final heartbeat, which is not applied.
    exporter = ExporterProcess(free_port())
    exporter.start()
    stack = Stack(exporter.url, prometheus="")
    process = stack.rank("lc-restart-close", "idle")
    try:
        totals = _own_totals(process)
        _until(lambda: stack.state("lc-restart-close") == "running", "not running")
        exporter.kill()
        exporter.start()
        assert process.stdin is not None
        process.stdin.close()  # the rank exits normally: the final heartbeat at exit
        assert process.wait(30) == 0
        view = _until(lambda: stack.view("lc-restart-close"), "the rank did not reappear")
        assert (view["state"], view["step"], view["totals"]) == ("finished", 6, totals)
    finally:
        _stop(process)
        exporter.stop()


def _exits(process: subprocess.Popen[str]) -> tuple[int, str]:
    """(exit status, output) once ``process`` ended by itself (a deadlock guard only)."""
    try:
        output, _ = process.communicate(timeout=DEADLOCK_GUARD_S * 4)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        pytest.fail("the rank did not end:\n" + output)
    return process.returncode, output


def _status(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPSCOPE_")}
    return subprocess.run(
        [sys.executable, "-m", "ampscope.cli", "status", *args],
        capture_output=True,
        text=True,
        timeout=DEADLOCK_GUARD_S * 2,
        check=False,
        env=env,
    )


def _metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=DEADLOCK_GUARD_S) as response:
        return response.read().decode()


def test_a_bf16_run_a_watch_stopped_is_failed_everywhere(stack: Stack) -> None:
    """Two gloo ranks, a bf16 DDP model, GradWatch(policy="raise"), a NaN in rank 1's batch
    at step 5: both ranks raise NonFiniteGradientsError there, uncaught, and exit 1."""
    nan_step = 5
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [
        stack.rank("lc-stopped", "bf16_raise", str(rank), "1", str(nan_step), env=env)
        for rank in (0, 1)
    ]
    try:
        outputs = [_exits(process) for process in ranks]
    finally:
        _stop(*ranks)
    for code, output in outputs:
        assert code == 1, output
        assert f"NonFiniteGradientsError: ampscope: non-finite gradients at step {nan_step}" in (
            output
        )
        assert "Origin rank(s): 1." in output
    _until(
        lambda: [stack.state("lc-stopped", r) for r in (0, 1)] == ["failed", "failed"],
        f"the ranks did not end failed: {_get(f'{stack.exporter}/api/v1/runs/lc-stopped/ranks')}",
    )
    # The exporter's health: critical, the run failed, the step, the exception, the origin.
    report = stack.health("lc-stopped")
    assert (report["status"], report["state"]) == ("critical", "failed")
    assert report["states"] == {
        "running": 0,
        "stalled": 0,
        "lost": 0,
        "finished": 0,
        "failed": 2,
        "stopped": 0,
    }
    verdict = {v["rule"]: v for v in report["verdicts"]}["rank_failed"]
    assert verdict["status"] == "critical"
    evidence = verdict["evidence"]
    assert (evidence["step"], evidence["exception"], evidence["kind"]) == (
        nan_step,
        "NonFiniteGradientsError",
        "nonfinite_gradients",
    )
    assert (evidence["origin_tracked"], evidence["origin_ranks"]) == (True, [1])
    assert [r["rank"] for r in evidence["ranks"]] == [0, 1]
    assert verdict["summary"] == (
        f"2 of 2 rank(s) failed (rank(s) 0, 1): training stopped on inf/NaN gradients at step "
        f"{nan_step} (NonFiniteGradientsError); origin rank(s) 1"
    )
    for rank in (0, 1):
        view = stack.view("lc-stopped", rank)
        assert view is not None
        assert view["step"] == nan_step  # the raise delivered its own step's record first
        assert view["failure"]["origin_ranks"] == [1]
        assert view["failure"]["seen_by"] in ("watch", "uncaught")
    # /metrics: the failed state, and what it failed on, rank 1 the origin.
    text = _metrics(stack.exporter)
    for rank, origin in ((0, "no"), (1, "yes")):
        assert _samples(text, "ampscope_rank_state", rank, "lc-stopped") == {
            ("running",): 0.0,
            ("stalled",): 0.0,
            ("lost",): 0.0,
            ("finished",): 0.0,
            ("failed",): 1.0,
            ("stopped",): 0.0,
        }
        assert _sample_line(text, "ampscope_rank_failure_info", rank, "lc-stopped") == (
            {
                "exception": "NonFiniteGradientsError",
                "kind": "nonfinite_gradients",
                "origin": origin,
            },
            1.0,
        )
    # ampscope status: exit status 2 (critical), the failed ranks named.
    result = _status("lc-stopped", "--url", stack.exporter)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "(2 failed)" in result.stdout.splitlines()[0]
    assert f"  rank 1 (node {view['node']}): NonFiniteGradientsError at step {nan_step}" in (
        result.stdout
    )
    # The alert fires for both ranks, naming the exception; nothing else fires.
    _until(
        lambda: (
            [a for a in stack.alerts("lc-stopped") if a[2] == "firing"]
            == [("AmpscopeRankFailed", "0", "firing"), ("AmpscopeRankFailed", "1", "firing")]
        ),
        f"AmpscopeRankFailed did not fire for both ranks: {stack.alerts('lc-stopped')}",
    )


def _samples(text: str, name: str, rank: int, run: str) -> dict[tuple[str, ...], float]:
    """{values of the labels beyond the rank's: value} of ``name``'s samples for ``rank``."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {}
    for family in text_string_to_metric_families(text):
        if family.name == name:
            for sample in family.samples:
                if sample.labels.get("run") == run and sample.labels.get("rank") == str(rank):
                    extra = tuple(
                        v
                        for k, v in sample.labels.items()
                        if k not in ("run", "node", "rank", "local_rank")
                    )
                    found[extra] = sample.value
    return found


def _sample_line(text: str, name: str, rank: int, run: str) -> tuple[dict[str, str], float]:
    """The labels beyond the rank's and the value of ``name``'s sample for ``rank``."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        if family.name == name:
            for sample in family.samples:
                if sample.labels.get("run") == run and sample.labels.get("rank") == str(rank):
                    extra = {
                        k: v
                        for k, v in sample.labels.items()
                        if k not in ("run", "node", "rank", "local_rank")
                    }
                    return extra, sample.value
    raise AssertionError(f"no {name} sample of rank {rank} of run {run}")


def test_an_uncaught_error_fails_the_rank_and_a_normal_end_finishes_it(stack: Stack) -> None:
    crashed = stack.rank("lc-crash", "crash", "4")
    fine = stack.rank("lc-watch-ok", "watch_finish")
    try:
        (code, output), (fine_code, fine_output) = _exits(crashed), _exits(fine)
    finally:
        _stop(crashed, fine)
    assert code == 1
    assert "RuntimeError: data loader died after step 4" in output  # the traceback, as ever
    assert fine_code == 0, fine_output
    _until(lambda: stack.state("lc-crash") == "failed", "the crashed rank is not failed")
    _until(lambda: stack.state("lc-watch-ok") == "finished", "the clean rank is not finished")
    view = stack.view("lc-crash")
    assert view is not None
    assert view["failure"] == {
        "kind": "exception",
        "exception": "RuntimeError",
        "message": "data loader died after step 4",
        "step": 4,
        "origin_ranks": None,
        "seen_by": "uncaught",
    }
    report = stack.health("lc-crash")
    assert (report["status"], report["state"]) == ("critical", "failed")
    verdict = {v["rule"]: v for v in report["verdicts"]}["rank_failed"]
    assert verdict["summary"].endswith(
        "rank 0 (node " + view["node"] + ") ended on RuntimeError after step 4: data loader "
        "died after step 4"
    )
    assert _status("lc-crash", "--url", stack.exporter).returncode == 2
    clean = stack.health("lc-watch-ok")
    assert (clean["status"], clean["state"]) == ("ok", "finished")
    assert stack.view("lc-watch-ok")["failure"] is None  # type: ignore[index]
    assert _status("lc-watch-ok", "--url", stack.exporter).returncode == 0
    _until(
        lambda: ("AmpscopeRankFailed", "0", "firing") in stack.alerts("lc-crash"),
        "AmpscopeRankFailed did not fire for the crashed rank",
    )
    assert stack.alerts("lc-watch-ok") == []
