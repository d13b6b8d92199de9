"""``python -m bench.status_queries``: the queries of ``ampscope status --prometheus`` at
1,024 nodes x 8 ranks, as sent by one or more source trees, on the same data.

Loads :class:`~bench.simulated_job.SimulatedJob` into VictoriaMetrics (or reuses a data
directory a previous call loaded: ``--data``), then, at the job's newest scrape, for each
tree in turn, ``--rounds`` times:

* sends the tree's first round of queries (``ampscope.status.prometheus.queries``) all at
  once, in parallel, as the command does; prints the round's wall time, the series and bytes
  returned, and the three slowest queries (the store's side and the transfer);
* builds the tree's whole answer (``ampscope.status.prometheus.fetch``: both rounds of
  queries and the command's own Python work, in a process of its own, its imports not
  timed); prints its wall time, the CPU seconds it used and those VictoriaMetrics used
  meanwhile (``/proc``): CPU seconds say what the answer costs where other work on the host
  stretches every wall time.

Not the command's start-up (that is ``bench.at_scale``'s whole-command figure). Compare
trees within one call: other work on the host shows in every wall time.

    python -m bench.status_queries --tree /path/to/main --tree . --data /tmp/vm
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.servers import VICTORIA_METRICS, victoria_metrics
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.status_queries", description=__doc__)
    parser.add_argument("--nodes", type=int, default=1024, help="nodes of 8 ranks")
    parser.add_argument("--tree", type=Path, action="append", help="source trees (default .)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data", type=Path, help="VictoriaMetrics data; loaded when new")
    args = parser.parse_args(argv)
    path = shutil.which(VICTORIA_METRICS)
    if path is None:
        raise SystemExit("victoria-metrics is not installed (scripts/setup.sh test installs it)")
    trees = {str(t): tree_queries(t.resolve()) for t in args.tree or [Path(".")]}
    data = args.data or Path(f"/tmp/ampscope-status-queries-{args.nodes}")
    fresh = not data.exists()
    with victoria_metrics(path, data) as server:
        url = f"http://{server.host}:{server.port}"
        if fresh:
            client = VictoriaClient(server.host, server.port)
            loaded = load_job(SimulatedJob(run=RUN, nodes=args.nodes), client)
            client.close()
            print(f"loaded {loaded['samples']:,} samples in {loaded['seconds']:.0f} s")
        # The newest scrape: every query is sent at it, however long ago it was loaded.
        probe = "max(tlast_over_time(ampscope_last_step[30d]))"
        params = urllib.parse.urlencode({"query": probe, "time": f"{time.time():.3f}"})
        with urllib.request.urlopen(f"{url}/api/v1/query?{params}", timeout=600) as response:
            at = float(json.load(response)["data"]["result"][0]["value"][1])
        walls: dict[str, list[float]] = {}
        answers_at: dict[str, list[tuple[float, float, float]]] = {}
        for round_ in range(args.rounds):
            for tree, queries in trees.items():
                started = time.perf_counter()
                with ThreadPoolExecutor(max_workers=len(queries)) as pool:
                    answers = dict(
                        zip(
                            queries,
                            pool.map(lambda q: _query(url, q, at), queries.values()),
                            strict=True,
                        )
                    )
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
