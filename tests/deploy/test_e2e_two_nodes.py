"""One training job on two "nodes" of loopback, as a fleet runs it: an exporter per node with
its own node name, two torchrun agents joined by c10d rendezvous with two ranks each, every
rank reporting to its own node's exporter, and one Prometheus scraping both exporters with
the shipped rules. VictoriaMetrics scrapes the same exporters and vmalert evaluates the same
rules, so both engines are held to the same verdicts.

The faults (two_node_rank.py) sit on one node and are only visible across nodes: the alerts
must compare ranks of the whole job, not of one exporter. The ranks wait twice, alive and
heartbeating, so that no verdict depends on how fast the machine trains: at the first aligned
step until every engine holds every rank's series (a rule that reads a partial set of ranks
errs), and after their last step until both engines showed their verdicts (a rank that
closes sends its final record, turns finished and every alert on it resolves). Costs 35-70 s
of wall time on the 2-core development VM, idle or under load.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_files import RULES_FILE, alert_rules, recording_rules
from support import (
    IN_CI,
    free_port,
    get_json,
    need_tool,
    start_prometheus,
    stop_process,
    wait_for_http,
)
from two_node_rank import GATE_STEP, STEPS

from ampscope.demo.exporter import ExporterProcess

NODES = ("node-a", "node-b")
FAULTY = "node-b"
RANK_SCRIPT = Path(__file__).with_name("two_node_rank.py")
STALE_AFTER_S = 60.0
"""Ranks stay up on their exporters while the test reads the verdicts."""
GATE_WITHIN_S = 300.0
"""Deadlock guard of the wait for every engine to hold every rank's series at the gate step;
the wait ends as soon as they do."""
VERDICTS_WITHIN_S = 300.0
"""Deadlock guard of the lingering ranks' wait for both engines' verdicts: vmalert's chained
rules (rank -> run recording rules -> alert, each written back into VictoriaMetrics before
the next reads it) lag the job by many seconds on a loaded machine. Only a hang waits this
long; the wait ends as soon as the verdicts are shown."""
QUIET_WITHIN_S = 300.0
ACROSS_RUNS = {"AmpscopeRepeatOffenderDevice"}
"""Alerts about a device across runs, finished ones included: the job's end does not quiet
them (the same rank's device is the origin in several of its runs)."""
NEEDS_DCGM = {"ampscope_device:dcgm_errors:offenders"}
"""Recording rules that join DCGM-exporter's series, which this job has none of."""
"""Deadlock guard of the wait for every engine to resolve all of its alerts once the job
finished; the wait ends as soon as they are quiet."""

pytestmark = [pytest.mark.prometheus, pytest.mark.distributed, pytest.mark.timeout(1800)]
"""Above the sum of the deadlock guards below, so that each reports its own failure."""


def query(base_url: str, expr: str, at: float) -> list[dict[str, Any]]:
    """An instant PromQL query against Prometheus or VictoriaMetrics."""
    params = urllib.parse.urlencode({"query": expr, "time": f"{at:.3f}"})
    answer = get_json(f"{base_url}/api/v1/query?{params}")
    assert answer["status"] == "success", (expr, answer)
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


class _AlertSink(BaseHTTPRequestHandler):
    """Alertmanager stand-in for vmalert's notifier: accepts and forgets."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@dataclass
class Watched:
    """An engine's active alerts and recording-rule output, accumulated while the job ran.

    Read while the job ran (its ranks lingered at their last step for it): once the ranks
    finish, every alert on them resolves, by the rules' design.
    """

    alerts: dict[str, set[tuple[str, str, str]]] = field(default_factory=dict)
    """Alert name -> (run, node, rank) of every alert seen active (pending or firing)."""
    recorded: dict[str, int] = field(default_factory=dict)
    """Recording rule -> the most samples one of its evaluations produced (vmalert only)."""
    both_active_at: float | None = None
    """The last instant both the hotspot and the desync alert were active."""
    quiet_at: float | None = None
    """The first instant after the job finished that no alert about a run was active."""


class _Watcher(threading.Thread):
    """Polls each engine's alerts (and vmalert's rules) every half second until stopped."""

    def __init__(self, urls: dict[str, str]) -> None:
        super().__init__(daemon=True)
        self.urls = urls
        self.watched = {engine: Watched() for engine in urls}
        self.stopping = threading.Event()
        self.finished = threading.Event()
        """Set once the job finished: from then on the watcher waits for quiet."""
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stopping.wait(0.5):
                for engine, url in self.urls.items():
                    # A slow answer under load is skipped: the next poll comes soon.
                    with contextlib.suppress(OSError):
                        self._poll(engine, self.watched[engine], url, self.finished.is_set())
        except BaseException as error:  # reported by the fixture, not lost in the thread
            self.error = error

    @staticmethod
    def _poll(engine: str, watched: Watched, url: str, finished: bool) -> None:
        now = time.time()
        active: set[str] = set()
        # vmalert answers null, not [], while no alert is active.
        for alert in get_json(f"{url}/api/v1/alerts")["data"]["alerts"] or []:
            if alert["state"] not in ("pending", "firing"):
                continue
            labels = alert["labels"]
            if labels["alertname"] not in ACROSS_RUNS:
                active.add(labels["alertname"])
            key = (labels.get("run", ""), labels.get("node", ""), labels.get("rank", ""))
            watched.alerts.setdefault(labels["alertname"], set()).add(key)
        if {"AmpscopeInfHotspot", "AmpscopeScaleDesync"} <= active:
            watched.both_active_at = now
        if finished and not active and watched.quiet_at is None:
            watched.quiet_at = now
        if engine != "vmalert":
            return
        for group in get_json(f"{url}/api/v1/rules")["data"]["groups"] or []:
            for rule in group["rules"] or []:
                if rule["type"] == "recording":
                    most = max(watched.recorded.get(rule["name"], 0), rule["lastSamples"])
                    watched.recorded[rule["name"]] = most


@dataclass
class Job:
    run_id: str
    exporters: dict[str, str]
    """Node name -> exporter URL."""
    prometheus: str
    victoria: str | None
    vmalert: str | None
    released: float
    """When the ranks were let go: until then they lingered, alive, at their last step."""
    finished: float
    """When both agents had exited."""
    workdir: Path
    watched: dict[str, Watched]
    """Engine ("prometheus", "vmalert") -> what its rule evaluation showed during the job."""

    def faulty_rank(self) -> str:
        """Global rank of local rank 0 on the faulty node (c10d decides node order)."""
        ranks = get_json(f"{self.exporters[FAULTY]}/api/v1/runs/{self.run_id}-hotspot/ranks")
        (rank,) = [r["rank"] for r in ranks if r["local_rank"] == 0]
        return str(rank)


def _at_step(exporters: dict[str, ExporterProcess], run_id: str, step: int) -> bool:
    """Whether all four ranks of both runs reported ``step`` (and now wait there)."""
    steps = [
        rank["step"]
        for exporter in exporters.values()
        for run in ("hotspot", "desync")
        for rank in get_json(f"{exporter.url}/api/v1/runs/{run_id}-{run}/ranks")
    ]
    return steps == [step] * 8


def _gate_series(run_id: str) -> dict[str, int]:
    """The series the hotspot and desync alerts read, and how many the job has of each."""
    runs = f'run=~"{run_id}-(hotspot|desync)"'
    return {
        # The raw origin counters too: the recording rule falls back to the local counters
        # while a run has no origin series, and would count 4 before a single one showed.
        f'ampscope_found_inf_origin_total{{run="{run_id}-hotspot"}}': 4,
        f'ampscope_rank_device:found_inf_source:increase_10m{{run="{run_id}-hotspot"}}': 4,
        f"ampscope_rank:loss_scale_aligned:newest_step{{{runs}}}": 8,
        f"ampscope_run:loss_scale:max_over_min{{{runs}}}": 2,
        f'ampscope_rank_state{{{runs}, state="finished"}}': 8,
    }


def _open_gate(
    exporters: dict[str, ExporterProcess],
    engines: dict[str, str],
    run_id: str,
    agents: list[subprocess.Popen[bytes]],
    gate: Path,
) -> None:
    """Lets the ranks go on from GATE_STEP once every engine (its query API: Prometheus, or
    the VictoriaMetrics that vmalert reads) holds every series in ``_gate_series``. A series
    once searchable stays so, so vmalert's later queries see them too.

    Fails the test, naming what each engine holds, when that does not happen within
    GATE_WITHIN_S (a deadlock guard) while the agents run; an agent that exited is reported
    by the caller. The ranks are let go either way, so that the job ends.
    """
    deadline = time.monotonic() + GATE_WITHIN_S
    at_gate = False
    try:
        while time.monotonic() < deadline and all(agent.poll() is None for agent in agents):
            # A run not reported yet answers 404; a slow answer under load is asked again.
            with contextlib.suppress(OSError):
                at_gate = at_gate or _at_step(exporters, run_id, GATE_STEP)
                if at_gate and all(
                    query(url, f"count({series}) == {count}", time.time())
                    for url in engines.values()
                    for series, count in _gate_series(run_id).items()
                ):
                    return
            time.sleep(0.5)  # a poll interval: the conditions above are what is waited for
        if all(agent.poll() is None for agent in agents):
            held: dict[str, dict[str, object]] = {}
            for engine, url in engines.items():
                for series in _gate_series(run_id):
                    try:
                        answer = query(url, f"count({series})", time.time())
                        held.setdefault(engine, {})[series] = [r["value"][1] for r in answer]
                    except OSError as exc:  # the report names what it could not read
                        held.setdefault(engine, {})[series] = repr(exc)
            pytest.fail(
                f"the engines did not hold every rank's series within {GATE_WITHIN_S:.0f}s "
                f"(ranks at step {GATE_STEP}: {at_gate}); expected {_gate_series(run_id)}, "
                f"held {held}"
            )
    finally:
        gate.touch()


def _newest_step(run_id: str) -> str:
    """The desync run's ranks at its newest aligned step, as Prometheus recorded them."""
    return f'ampscope_rank:loss_scale_aligned:newest_step{{run="{run_id}-desync"}}'


def _verdicts_shown(watched: dict[str, Watched]) -> bool:
    """Every engine showed both alerts active and, for vmalert, every recording rule
    produced samples: all the test reads of the engines' own evaluation."""
    if not all(w.both_active_at for w in watched.values()):
        return False
    vmalert = watched.get("vmalert")
    return vmalert is None or (
        set(vmalert.recorded) == set(recording_rules()) and all(vmalert.recorded.values())
    )


def _wait_for_verdicts(
    exporters: dict[str, ExporterProcess],
    prometheus: str,
    run_id: str,
    agents: list[subprocess.Popen[bytes]],
    watched: dict[str, Watched],
) -> None:
    """Returns once every rank lingers at its last step, every engine showed its verdicts
    (``_verdicts_shown``), and Prometheus records all four desync ranks at the same aligned
    step (which holds while they linger: the per-node comparison reads it); or when an agent
    exited (the caller reports it), or after VERDICTS_WITHIN_S, a deadlock guard (the
    assertions report what is missing). The ranks linger until then however slowly the
    engines evaluate, so no verdict depends on the machine's speed."""
    deadline = time.monotonic() + VERDICTS_WITHIN_S
    lingering = False
    while time.monotonic() < deadline and all(agent.poll() is None for agent in agents):
        # A run not reported yet answers 404; a slow answer under load is asked again.
        with contextlib.suppress(OSError):
            lingering = lingering or _at_step(exporters, run_id, STEPS)
            if (
                lingering
                and _verdicts_shown(watched)
                and query(prometheus, f"count({_newest_step(run_id)}) == 4", time.time())
            ):
                return
        time.sleep(0.5)  # a poll interval: the conditions above are what is waited for


def _start(command: list[str], log: Path, **kwargs: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, **kwargs)


@pytest.fixture(scope="module")
def job() -> Iterator[Job]:
    need_tool("prometheus")
    workdir = Path(tempfile.mkdtemp(prefix="ampscope-two-nodes-"))
    processes: list[subprocess.Popen[bytes]] = []
    exporters = {node: ExporterProcess(free_port(), stale_after=STALE_AFTER_S) for node in NODES}
    sink = ThreadingHTTPServer(("127.0.0.1", 0), _AlertSink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    try:
        for exporter in exporters.values():
            exporter.start()
        targets = [f"127.0.0.1:{e.port}" for e in exporters.values()]
        scrape = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "ampscope", "static_configs": [{"targets": targets}]}],
        }
        prometheus, prometheus_url = start_prometheus(
            {**scrape, "rule_files": [str(RULES_FILE)]}, workdir
        )
        processes.append(prometheus)

        victoria_url = vmalert_url = None
        if shutil.which("victoria-metrics") and shutil.which("vmalert"):
            victoria_url, vmalert_url = _start_victoria(workdir, scrape, sink, processes)
        elif IN_CI:
            pytest.fail("victoria-metrics is not installed (scripts/setup.sh test installs it)")

        run_id = f"two-nodes-{os.getpid()}"
        gate, release = workdir / "gate", workdir / "release"
        rendezvous = f"127.0.0.1:{free_port()}"
        agents = []
        for node in NODES:
            env = {
                **os.environ,
                "AMPSCOPE_NODE": node,
                "AMPSCOPE_URL": exporters[node].url,
                "TWO_NODE_FAULTY": "1" if node == FAULTY else "0",
                "TWO_NODE_GATE": str(gate),
                "TWO_NODE_RELEASE": str(release),
                "PYTHONUNBUFFERED": "1",
            }
            command = [
                *(sys.executable, "-m", "torch.distributed.run", "--nnodes=2"),
                *("--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint={rendezvous}"),
                *(f"--rdzv-id={run_id}", "--local-addr=127.0.0.1", "--monitor-interval=0.5"),
                str(RANK_SCRIPT),
            ]
            agents.append(_start(command, workdir / f"torchrun-{node}.log", env=env))
        processes.extend(agents)
        engines = {"prometheus": prometheus_url} | ({"vmalert": vmalert_url} if vmalert_url else {})
        watcher = _Watcher(engines)
        watcher.start()
        stores = {"prometheus": prometheus_url}
        if victoria_url:
            stores["victoria"] = victoria_url  # what vmalert reads
        _open_gate(exporters, stores, run_id, agents, gate)
        _wait_for_verdicts(exporters, prometheus_url, run_id, agents, watcher.watched)
        released = time.time()
        release.touch()
        for node, agent in zip(NODES, agents, strict=True):
            try:
                status = agent.wait(300)
            except subprocess.TimeoutExpired:
                status = None
            log = (workdir / f"torchrun-{node}.log").read_text()[-4000:]
            assert status == 0, f"torchrun on {node} exited with {status}:\n{log}"
        finished = time.time()
        watcher.finished.set()
        deadline = time.monotonic() + QUIET_WITHIN_S
        while time.monotonic() < deadline and not all(w.quiet_at for w in watcher.watched.values()):
            time.sleep(0.5)
        watcher.stopping.set()
        watcher.join()
        assert watcher.error is None, repr(watcher.error)
        yield Job(
            run_id=run_id,
            exporters={node: e.url for node, e in exporters.items()},
            prometheus=prometheus_url,
            victoria=victoria_url,
            vmalert=vmalert_url,
            released=released,
            finished=finished,
            workdir=workdir,
            watched=watcher.watched,
        )
    finally:
        for process in processes:
            stop_process(process)
        for exporter in exporters.values():
            exporter.stop()
        sink.shutdown()
        sink.server_close()
        shutil.rmtree(workdir, ignore_errors=True)


def _start_victoria(
    workdir: Path,
    scrape: dict[str, Any],
    sink: ThreadingHTTPServer,
    processes: list[subprocess.Popen[bytes]],
) -> tuple[str, str]:
    """VictoriaMetrics scraping the exporters, and vmalert evaluating the shipped rules on it
    (recording rules written back into it)."""
    vm_scrape = {"global": {"scrape_interval": "1s"}, "scrape_configs": scrape["scrape_configs"]}
    (workdir / "vm-scrape.yml").write_text(yaml.safe_dump(vm_scrape))
    victoria_url = f"http://127.0.0.1:{free_port()}"
    processes.append(
        _start(
            [
                "victoria-metrics",
                f"-storageDataPath={workdir / 'vm-data'}",
                f"-httpListenAddr={victoria_url.removeprefix('http://')}",
                f"-promscrape.config={workdir / 'vm-scrape.yml'}",
                "-promscrape.config.strictParse",
                # Serve what was just scraped: by default the newest 30 s are held back.
                "-search.latencyOffset=0s",
                "-search.disableCache",
            ],
            workdir / "victoria-metrics.log",
        )
    )
    wait_for_http(f"{victoria_url}/health", "victoria-metrics", processes[-1], 30)
    vmalert_url = f"http://127.0.0.1:{free_port()}"
    processes.append(
        _start(
            [
                "vmalert",
                f"-rule={RULES_FILE}",
                f"-datasource.url={victoria_url}",
                f"-remoteWrite.url={victoria_url}",
                f"-notifier.url=http://127.0.0.1:{sink.server_address[1]}",
                f"-httpListenAddr={vmalert_url.removeprefix('http://')}",
                "-evaluationInterval=1s",
                # Chained rules read what the rules before them wrote: write it at once.
                "-remoteWrite.flushInterval=200ms",
            ],
            workdir / "vmalert.log",
        )
    )
    wait_for_http(f"{vmalert_url}/health", "vmalert", processes[-1], 30)
    return victoria_url, vmalert_url


def _first_answer(
    evaluate: Callable[[str, float], list[dict[str, Any]]], expr: str, job: Job
) -> list[dict[str, Any]]:
    """The expression's result at the ranks' release or, where it has none there, at the
    first of a few seconds before it that has one: every rank was alive and unfinished then
    (a finished one pages nobody), lingering at its last step or still training."""
    for at in (job.released + d for d in (0, -1, -2, -4)):
        result = evaluate(expr, at)
        if result:
            return result
    return []


def test_each_exporter_sees_only_its_own_nodes_ranks(job: Job) -> None:
    seen: dict[str, set[int]] = {}
    for node, url in job.exporters.items():
        runs = {run["run"] for run in get_json(f"{url}/api/v1/runs")}
        assert runs == {f"{job.run_id}-hotspot", f"{job.run_id}-desync"}, node
        for run in runs:
            ranks = get_json(f"{url}/api/v1/runs/{run}/ranks")
            assert {r["node"] for r in ranks} == {node}, (node, run)
            assert sorted(r["local_rank"] for r in ranks) == [0, 1], (node, run)
            assert {r["world_size"] for r in ranks} == {4}, (node, run)
            seen.setdefault(node, {r["rank"] for r in ranks})
            assert {r["rank"] for r in ranks} == seen[node], (node, run)
    assert sorted(seen["node-a"] | seen["node-b"]) == [0, 1, 2, 3]
    assert not seen["node-a"] & seen["node-b"]


def test_prometheus_alerts_compare_ranks_across_nodes(job: Job) -> None:
    def evaluate(expr: str, at: float) -> list[dict[str, Any]]:
        return query(job.prometheus, expr, at)

    # Prometheus scraped both exporters, each series labelled with its rank's node.
    series = evaluate("ampscope_last_step", job.finished)
    assert {(s["metric"]["node"], s["metric"]["rank"]) for s in series} == {
        (node, rank)
        for node, url in job.exporters.items()
        for ranks in [get_json(f"{url}/api/v1/runs/{job.run_id}-desync/ranks")]
        for rank in (str(r["rank"]) for r in ranks)
    }
    assert len({s["metric"]["instance"] for s in series}) == 2
    _assert_verdicts(evaluate, job)

    # Prometheus' own rule evaluation started both alerts' `for:` clocks, on the same labels.
    _assert_alerted_on_the_faults_only(job.watched["prometheus"], job)


def _assert_alerted_on_the_faults_only(watched: Watched, job: Job) -> None:
    """While the job ran, the hotspot alert named the faulty rank alone (in the hotspot run)
    and the desync alert the desync run alone."""
    hotspot = {
        a for a in watched.alerts.get("AmpscopeInfHotspot", set()) if a[0].endswith("-hotspot")
    }
    assert hotspot == {(f"{job.run_id}-hotspot", FAULTY, job.faulty_rank())}, watched.alerts
    desync = {run for run, _, _ in watched.alerts.get("AmpscopeScaleDesync", set())}
    assert desync == {f"{job.run_id}-desync"}, watched.alerts
    assert watched.both_active_at is not None
    # A job that ends, faults and all, pages nobody: its ranks finished.
    assert watched.quiet_at is not None, f"alerts still active {QUIET_WITHIN_S:.0f}s after the job"


def _run(job: Job, scenario: str) -> str:
    """A selector that is non-empty for exactly one run of the job."""
    return f'ampscope_steps_total{{run="{job.run_id}-{scenario}"}}'


def _assert_verdicts(evaluate: Callable[[str, float], list[dict[str, Any]]], job: Job) -> None:
    """The hotspot and desync alert expressions name the faulty node's rank and run only,
    and neither fault shows inside one node."""
    alerts = alert_rules()
    # Only the hotspot run is judged: the desync run's real fp16 overflows at its high scales
    # may gather on one rank too, depending on which ranks c10d put on the faulty node.
    hotspot = _first_answer(
        evaluate,
        f"({alerts['AmpscopeInfHotspot']['expr']}) and on (run) {_run(job, 'hotspot')}",
        job,
    )
    assert [(s["metric"]["run"], s["metric"]["node"], s["metric"]["rank"]) for s in hotspot] == [
        (f"{job.run_id}-hotspot", FAULTY, job.faulty_rank())
    ]
    # Within the healthy node one rank holds every detection, the alert's 5: compared per
    # node, that rank would be a hotspot too. Read from the origin counters themselves, not
    # the rule's increase(): increase() cannot count what a counter held at its first scrape,
    # and how many of the 5 (steps 7, 19, ...) precede that scrape is the machine's speed.
    healthy = evaluate(
        'sum by (node, rank) (ampscope_found_inf_origin_total{run="'
        f'{job.run_id}-hotspot", node!="{FAULTY}"}}) > 0',
        job.released,
    )
    assert [float(s["value"][1]) for s in healthy] == [5.0], healthy

    desync = _first_answer(evaluate, alerts["AmpscopeScaleDesync"]["expr"], job)
    assert {s["metric"]["run"] for s in desync} == {f"{job.run_id}-desync"}
    # Each node's ranks agree among themselves at the same step: only across nodes do they not.
    # Read where all four ranks are at the run's newest aligned step, so both nodes answer.
    newest = _newest_step(job.run_id)
    per_node = _first_answer(
        evaluate,
        f"(max by (run, node) ({newest}) / min by (run, node) ({newest}))"
        f" and on (run) count by (run) ({newest}) == 4",
        job,
    )
    assert {s["metric"]["node"]: float(s["value"][1]) for s in per_node} == {
        node: 1.0 for node in NODES
    }


def test_victoria_metrics_loads_every_rule_and_agrees(job: Job) -> None:
    need_tool("victoria-metrics")
    need_tool("vmalert")
    assert job.victoria
    assert job.vmalert

    groups = get_json(f"{job.vmalert}/api/v1/rules")["data"]["groups"]
    loaded = {rule["name"]: rule for group in groups for rule in group["rules"]}
    assert set(loaded) == set(alert_rules()) | set(recording_rules())
    broken = {name: rule.get("lastError") for name, rule in loaded.items() if rule.get("lastError")}
    assert not broken, broken

    # vmalert's own evaluation over VictoriaMetrics' data reaches Prometheus' verdicts, and
    # every recording rule, written back into VictoriaMetrics, produced series. (Instant
    # queries at past instants answered recorded series empty on VictoriaMetrics 1.79, so the
    # verdicts are those vmalert showed while the job ran.)
    watched = job.watched["vmalert"]
    _assert_alerted_on_the_faults_only(watched, job)
    assert set(watched.recorded) == set(recording_rules())
    empty = [
        name for name, samples in watched.recorded.items() if not samples and name not in NEEDS_DCGM
    ]
    assert not empty, watched.recorded
