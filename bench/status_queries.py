"""``python -m bench.status_queries``: the queries of ``ampscope status --prometheus`` at
1,024 nodes x 8 ranks, as sent by one or more source trees, on the same data.

Loads :class:`~bench.simulated_job.SimulatedJob` into VictoriaMetrics, or into Prometheus
with ``--store prometheus`` (backfilled with ``promtool``: ``bench.prometheus_tsdb``), or
reuses a data directory a previous call loaded (``--data``), then, at the job's newest
scrape, for each tree in turn, ``--rounds`` times:

* sends the tree's first round of queries (``ampscope.status.prometheus.queries``) all at
  once, in parallel, as the command does; prints the round's wall time, the series and bytes
  returned, and the three slowest queries (the store's side and the transfer);
* builds the tree's whole answer (``ampscope.status.prometheus.fetch``: both rounds of
  queries and the command's own Python work, in a process of its own, its imports not
  timed); prints its wall time, the CPU seconds it used and those VictoriaMetrics used
  meanwhile (``/proc``): CPU seconds say what the answer costs where other work on the host
  stretches every wall time.

With ``--each``, then, for each tree: every first-round query alone (the median of
``--rounds``: wall time, VictoriaMetrics' CPU seconds, series and bytes returned), most
costly first, and the first round without the query of every rank's gauges (``now``), in
parallel: what an answer that does not read every rank's every gauge still costs the store
(#39 item 6); then the same round with ``summary_reads`` (each timed alone too) in place of
``now``, ``state`` and ``peak``: the cheapest reads a summary of the run and the ranks that
stand out would need. The load average is printed at the start and the end.

Not the command's start-up (that is ``bench.at_scale``'s whole-command figure). Compare
trees within one call: other work on the host shows in every wall time.

    python -m bench.status_queries --tree /path/to/main --tree . --data /tmp/vm [--each]
    python -m bench.status_queries --store prometheus --data /tmp/prom --each
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from bench.prometheus_tsdb import BLOCKS, backfill, newest_scrape
from bench.servers import PROMETHEUS, VICTORIA_METRICS, ServerProcess, prometheus, victoria_metrics
from bench.simulated_job import SimulatedJob
from bench.victoria import VictoriaClient, load_job

RUN = "pretrain-70b"


def tree_queries(tree: Path) -> dict[str, str]:
    """The PromQL ``tree``'s ``ampscope status --prometheus RUN`` sends first, by name."""
    code = (
        f"import json, sys; sys.path.insert(0, {str(tree)!r})\n"
        "from ampscope.status import prometheus\n"
        "from ampscope.verdicts.thresholds import Thresholds\n"
        f"print(json.dumps(prometheus.queries({RUN!r}, Thresholds())))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/"
    )
    queries: dict[str, str] = json.loads(done.stdout)
    return queries


def tree_answer(tree: Path, url: str, at: float) -> tuple[float, float]:
    """(wall, CPU seconds) of ``tree``'s whole answer for ``RUN`` from ``url`` at ``at`` (the
    clock it reads set to ``at``), in a new process."""
    code = (
        f"import json, sys, time; sys.path.insert(0, {str(tree)!r})\n"
        "from ampscope.status.prometheus import health\n"
        "from ampscope.status.prometheus.api import PrometheusClient\n"
        f"health.time = type('Clock', (), {{'time': staticmethod(lambda: {at!r})}})\n"
        f"client = PrometheusClient({url!r}, timeout=600)\n"
        "wall, cpu = time.perf_counter(), time.process_time()\n"
        f"health.fetch(client, {RUN!r})\n"
        "print(json.dumps([time.perf_counter() - wall, time.process_time() - cpu]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/"
    )
    wall, cpu = json.loads(done.stdout)
    return float(wall), float(cpu)


def _labelled(expr: str, of: str) -> str:
    # `or` matches on labels: two aggregations by (run) need a label apart to both come back.
    return f'label_replace({expr}, "of", "{of}", "", "")'


def summary_reads(run: str) -> dict[str, str]:
    """The cheapest form of each read a summarised answer needs instead of every rank's
    every gauge (``now``), state (``state``) and window peak (``peak``): the rank ids and
    setup (one family), the newest rank (its world size is the run's), the ranks not running
    or not up, the failed ranks, the step and scale ranges, the aligned scales' distinct
    values and their counts (``scale_desync`` from them, the odd ranks named in a second
    round), and the ranks whose scale is below the floor or fell from the window's peak by
    nearly ``collapse_factor`` (a superset of ``scale_collapse``'s: the margin covers the
    rounding of PromQL's division against the rule's). Measured only: no tree sends them,
    and they are this tree's (the default thresholds), whichever ``--tree`` is timed."""
    from ampscope.status.prometheus.health import peak_query
    from ampscope.verdicts.thresholds import Thresholds

    t = Thresholds()
    sel = f"run={json.dumps(run)}"
    ranks = "run, node, rank, local_rank"
    step, scale = f"ampscope_last_step{{{sel}}}", f"ampscope_loss_scale{{{sel}}}"
    return {
        "ranks": f"ampscope_rank_info{{{sel}}}",
        "newest": f"topk by (run) (1, ampscope_last_report_timestamp_seconds{{{sel}}})",
        "not_running": f'ampscope_rank_state{{state="running",{sel}}} != 1',
        "not_up": f"ampscope_rank_up{{{sel}}} != 1",
        "failed": f"ampscope_rank_failure_info{{{sel}}} == 1",
        "step_range": _labelled(f"max by (run) ({step})", "max")
        + " or "
        + _labelled(f"min by (run) ({step})", "min"),
        "scale_range": _labelled(f"max by (run) ({scale})", "max")
        + " or "
        + _labelled(f"min by (run) ({scale})", "min"),
        "aligned_values": 'count_values by (run) ("packed", '
        f"ampscope_loss_scale_aligned_packed{{{sel}}})",
        "collapse_candidates": f"(({peak_query(sel, t.collapse_window_s)}) / on ({ranks}) "
        f"{scale} >= {t.collapse_factor * 0.999:g}) or {scale} < {t.scale_floor:g}",
    }


def _cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _query(url: str, promql: str, at: float) -> tuple[float, int, int]:
    params = urllib.parse.urlencode({"query": promql, "time": f"{at:.3f}", "nocache": "1"})
    started = time.perf_counter()
    with urllib.request.urlopen(f"{url}/api/v1/query?{params}", timeout=600) as response:
        body = response.read()
    return time.perf_counter() - started, len(json.loads(body)["data"]["result"]), len(body)


def _parallel(url: str, queries: dict[str, str], at: float) -> dict[str, tuple[float, int, int]]:
    """Every query of ``queries`` sent at once, as the command sends its first round."""
    with ThreadPoolExecutor(max_workers=len(queries)) as pool:
        answers = pool.map(lambda q: _query(url, q, at), queries.values())
        return dict(zip(queries, answers, strict=True))


def _median_round(
    url: str, pid: int, queries: dict[str, str], at: float, rounds: int
) -> tuple[float, float, list[float]]:
    """(median wall, median store CPU, every wall) of ``queries`` sent at once."""
    runs = []
    for _ in range(rounds):
        store, started = _cpu_seconds(pid), time.perf_counter()
        _parallel(url, queries, at)
        runs.append((time.perf_counter() - started, _cpu_seconds(pid) - store))
    wall, cpu = (statistics.median(column) for column in zip(*runs, strict=True))
    return wall, cpu, [round(r[0], 2) for r in runs]


def each_query(
    url: str, pid: int, tree: str, queries: dict[str, str], at: float, rounds: int
) -> None:
    """Print each query of ``queries`` and of ``summary_reads`` alone, the round without
    ``now``, and the round with the summary reads in its place (``--each``)."""
    summary = summary_reads(RUN)
    costs = []
    for name, promql in {**queries, **{f"summary {n}": q for n, q in summary.items()}}.items():
        runs = []
        for _ in range(rounds):
            store = _cpu_seconds(pid)
            wall, series, size = _query(url, promql, at)
            runs.append((wall, _cpu_seconds(pid) - store, series, size))
        wall, cpu = (statistics.median(column) for column in list(zip(*runs, strict=True))[:2])
        costs.append((cpu, wall, name, runs[0][2], runs[0][3]))
    for cpu, wall, name, series, size in sorted(costs, reverse=True):
        print(
            f"each {tree} {name}: {wall:.3f} s, store CPU {cpu:.2f} s, "
            f"{series:,} series, {size:,} bytes"
        )
    rest = {name: promql for name, promql in queries.items() if name != "now"}
    wall, cpu, walls = _median_round(url, pid, rest, at, rounds)
    print(
        f"without now {tree}: first round without every rank's gauges {wall:.2f} s "
        f"(of {walls}), store CPU {cpu:.2f} s"
    )
    for replaced in ("state", "peak"):  # read by "not_running" and "collapse_candidates"
        rest.pop(replaced, None)
    wall, cpu, walls = _median_round(url, pid, {**rest, **summary}, at, rounds)
    print(
        f"summary round {tree}: the summary reads in place of now, state and peak {wall:.2f} s "
        f"(of {walls}), store CPU {cpu:.2f} s"
    )


@contextmanager
def _store(kind: str, path: str, data: Path, nodes: int) -> Iterator[tuple[ServerProcess, float]]:
    """(the store serving ``data``, the newest scrape's time), the job loaded into ``data``
    first where it is new: imported into VictoriaMetrics, or backfilled for Prometheus
    (``promtool``, which must be installed too)."""
    fresh = not data.exists()
    job = SimulatedJob(run=RUN, nodes=nodes)
    if kind == PROMETHEUS:
        if fresh:
            promtool = shutil.which("promtool")
            if promtool is None:
                raise SystemExit("promtool is not installed (it comes with prometheus)")
            loaded = backfill(job, data, promtool)
            print(f"loaded {loaded['samples']:,} samples in {loaded['seconds']:.0f} s")
        with prometheus(path, data / BLOCKS) as server:
            yield server, newest_scrape(data)
        return
    with victoria_metrics(path, data) as server:
        if fresh:
            client = VictoriaClient(server.host, server.port)
            loaded = load_job(job, client)
            client.close()
            print(f"loaded {loaded['samples']:,} samples in {loaded['seconds']:.0f} s")
        # The newest scrape: every query is sent at it, however long ago it was loaded.
        probe = "max(tlast_over_time(ampscope_last_step[30d]))"
        params = urllib.parse.urlencode({"query": probe, "time": f"{time.time():.3f}"})
        url = f"http://{server.host}:{server.port}"
        with urllib.request.urlopen(f"{url}/api/v1/query?{params}", timeout=600) as response:
            yield server, float(json.load(response)["data"]["result"][0]["value"][1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.status_queries", description=__doc__)
    parser.add_argument("--nodes", type=int, default=1024, help="nodes of 8 ranks")
    parser.add_argument("--tree", type=Path, action="append", help="source trees (default .)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data", type=Path, help="VictoriaMetrics data; loaded when new")
    parser.add_argument(
        "--each", action="store_true", help="also time each first-round query alone"
    )
    parser.add_argument(
        "--store",
        choices=(VICTORIA_METRICS, PROMETHEUS),
        default=VICTORIA_METRICS,
        help="the store the job is loaded into and read from",
    )
    args = parser.parse_args(argv)
    path = shutil.which(args.store)
    if path is None:
        raise SystemExit(f"{args.store} is not installed (scripts/setup.sh test installs it)")
    trees = {str(t): tree_queries(t.resolve()) for t in args.tree or [Path(".")]}
    data = args.data or Path(f"/tmp/ampscope-status-queries-{args.store}-{args.nodes}")
    with _store(args.store, path, data, args.nodes) as (server, at):
        url = f"http://{server.host}:{server.port}"
        print(f"load average {os.getloadavg()[0]:.1f} at the start")
        walls: dict[str, list[float]] = {}
        answers_at: dict[str, list[tuple[float, float, float]]] = {}
        for round_ in range(args.rounds):
            for tree, queries in trees.items():
                started = time.perf_counter()
                answers = _parallel(url, queries, at)
                wall = time.perf_counter() - started
                walls.setdefault(tree, []).append(wall)
                slowest = sorted(((a[0], name, a[1]) for name, a in answers.items()), reverse=True)
                print(
                    f"round {round_} {tree}: {wall:.2f} s, "
                    f"{sum(a[1] for a in answers.values()):,} series, "
                    f"{sum(a[2] for a in answers.values()):,} bytes; slowest "
                    + ", ".join(f"{name} {s:.2f} s ({n:,})" for s, name, n in slowest[:3])
                )
                store = _cpu_seconds(server.pid)
                wall, cpu = tree_answer(Path(tree).resolve(), url, at)
                store = _cpu_seconds(server.pid) - store
                answers_at.setdefault(tree, []).append((wall, cpu, store))
                print(
                    f"round {round_} {tree} answer: {wall:.2f} s, "
                    f"command CPU {cpu:.2f} s, store CPU {store:.2f} s"
                )
        for tree, values in walls.items():
            print(f"{tree}: first round median {statistics.median(values):.2f} s of {values}")
            wall, cpu, store = (
                statistics.median(column) for column in zip(*answers_at[tree], strict=True)
            )
            print(
                f"{tree}: answer median {wall:.2f} s, command CPU {cpu:.2f} s, "
                f"store CPU {store:.2f} s"
            )
        if args.each:
            for tree, queries in trees.items():
                each_query(url, server.pid, tree, queries, at, args.rounds)
        print(f"load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
