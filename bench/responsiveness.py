"""Exporter responsiveness under large ingests: /healthz and /metrics latency while
ranks post batches of several MiB.

``python -m bench.responsiveness [--baseline DIR] [--seconds 15] [--batch-mib 7]``

Starts ``ampscope serve`` from this tree and, with ``--baseline``, from another source
tree (``git archive main | tar -x -C DIR``) in turn, under the same load: ``--posters``
threads each posting ``--batch-mib`` batches of one simulated rank in a loop, while one
thread probes /healthz and /metrics alternately every 20 ms over a kept-alive
connection. Prints one table, both trees side by side. Loopback only.

``--gil`` instead measures, in this process, how long another thread waits while a
worker thread validates and stores ``--batches`` such batches, with
``IngestBatch.model_validate_json`` (one call) and with ``parse_batch`` (per record):
the stall the event loop would see, without the network and the prober in the way.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.payloads import SimulatedRank
from bench.servers import ServerProcess
from bench.stats import quantile

PROBE_INTERVAL_S = 0.02
_QUIET = ("--log-level", "warning")


def _batch(rank: SimulatedRank, mib: float) -> bytes:
    """A 2048-record batch of ``rank``, its parameter names lengthened to reach ``mib``."""
    body = rank.ingest_batch(2048)
    names = body.count(b'"layers.')
    pad = max(0, int((mib * 2**20 - len(body)) / max(names, 1)))
    return body.replace(b'"layers.', b'"' + b"model.blocks." * (pad // 13) + b"layers.")


def _server(tree: Path, name: str) -> ServerProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPSCOPE_")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    # ``python -m`` would put the working directory first on sys.path, ahead of
    # PYTHONPATH, and so serve this tree's code under the baseline's name.
    start = (
        f"import sys; sys.path[0] = {str(tree)!r}; from ampscope.cli import main; sys.exit(main())"
    )
    return ServerProcess(
        name=name,
        argv=[sys.executable, "-c", start, "serve", "--port", "{port}", *_QUIET],
        ready_path="/healthz",
        env=env,
    )


def _probe(host: str, port: int, seconds: float, queue: Any) -> None:
    """GET /healthz and /metrics alternately for ``seconds``; put their latencies."""
    probes: dict[str, list[float]] = {"/healthz": [], "/metrics": []}
    conn = http.client.HTTPConnection(host, port, timeout=60)
    paths = list(probes)
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        path = paths[i % 2]
        i += 1
        started = time.perf_counter()
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        if response.status == 200:
            probes[path].append(time.perf_counter() - started)
        time.sleep(PROBE_INTERVAL_S)
    conn.close()
    queue.put(probes)


def _measure(server: ServerProcess, *, seconds: float, posters: int, mib: float) -> dict[str, Any]:
    stop = threading.Event()
    posted: list[float] = []
    sizes: list[int] = []
    statuses: dict[int, int] = {}
    lock = threading.Lock()

    def post(index: int) -> None:
        rank = SimulatedRank(run="resp", rank=index, world_size=posters, devices=16, top_k=32)
        conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
        while not stop.is_set():
            body = _batch(rank, mib)
            sizes.append(len(body))
            started = time.perf_counter()
            conn.request("POST", "/api/v1/ingest", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
            with lock:
                posted.append(time.perf_counter() - started)
                statuses[response.status] = statuses.get(response.status, 0) + 1
        conn.close()

    # The prober is its own process, so the posters' work in this one cannot delay it.
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    prober = ctx.Process(target=_probe, args=(server.host, server.port, seconds, queue))
    threads = [threading.Thread(target=post, args=(i,)) for i in range(posters)]
    for t in threads:
        t.start()
    prober.start()
    probes: dict[str, list[float]] = queue.get(timeout=seconds + 120)
    prober.join()
    stop.set()
    for t in threads:
        t.join()
    result: dict[str, Any] = {
        "batch_mib": sum(sizes) / len(sizes) / 2**20 if sizes else 0.0,
        "batches": len(posted),
        "statuses": statuses,
        "ingest_p50_ms": quantile(posted, 0.5) * 1e3 if posted else None,
    }
    for path, samples in probes.items():
        key = path.strip("/")
        result[f"{key}_n"] = len(samples)
        for q in (0.5, 0.99):
            result[f"{key}_p{round(q * 100)}_ms"] = quantile(samples, q) * 1e3
        result[f"{key}_max_ms"] = max(samples) * 1e3
    return result


def _stalls(parse: Callable[[bytes], Any], bodies: list[bytes]) -> dict[str, float]:
    """Validate and store ``bodies`` in a worker thread; how long a 1 ms ticker waited."""
    from ampscope.exporter.state.store import Store, StoreLimits

    store = Store(
        StoreLimits(
            max_runs=64,
            max_ranks_per_run=4096,
            max_series=500_000,
            history_length=1024,
            window_s=600.0,
        )
    )
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    def work() -> None:
        for body in bodies:
            store.ingest(parse(body), time.time())

    ticker = threading.Thread(target=tick)
    ticker.start()
    started = time.perf_counter()
    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    done.set()
    ticker.join()
    return {
        "seconds": time.perf_counter() - started,
        "stall_p99_ms": quantile(gaps, 0.99) * 1e3,
        "stall_max_ms": max(gaps) * 1e3,
    }


def _gil_stalls(batches: int, mib: float) -> dict[str, dict[str, float]]:
    from ampscope.exporter.http.parse import parse_batch
    from ampscope.exporter.main import _tune_gc
    from ampscope.reporter.schema import IngestBatch

    def bodies() -> list[bytes]:
        rank = SimulatedRank(run="gil", rank=0, world_size=1, devices=16, top_k=32)
        return [_batch(rank, mib) for _ in range(batches)]

    results = {
        "one call": _stalls(IngestBatch.model_validate_json, bodies()),
        "per record": _stalls(parse_batch, bodies()),
    }
    _tune_gc()  # last: it cannot be undone in this process
    results["per record, serve's GC tuning"] = _stalls(parse_batch, bodies())
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.responsiveness", description=__doc__)
    parser.add_argument("--baseline", type=Path, help="another source tree to compare with")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--posters", type=int, default=2)
    parser.add_argument("--batch-mib", type=float, default=7.0)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--gil", action="store_true", help="in-process stall measurement")
    parser.add_argument("--batches", type=int, default=6, help="batches for --gil")
    args = parser.parse_args(argv)
    if args.gil:
        gil = _gil_stalls(args.batches, args.batch_mib)
        print("| parse | seconds | stall p99 ms | stall max ms |\n|---|---|---|---|")
        for name, r in gil.items():
            p99, worst = r["stall_p99_ms"], r["stall_max_ms"]
            print(f"| {name} | {r['seconds']:.1f} | {p99:.0f} | {worst:.0f} |")
        return 0
    trees = {"this tree": Path(__file__).resolve().parents[1]}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    results: dict[str, dict[str, Any]] = {}
    for name, tree in trees.items():
        with _server(tree, name) as server:
            results[name] = _measure(
                server, seconds=args.seconds, posters=args.posters, mib=args.batch_mib
            )
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    keys = list(next(iter(results.values())))
    print("| | " + " | ".join(results) + " |")
    print("|---" * (len(results) + 1) + "|")
    for key in keys:
        cells = [
            f"{v:.1f}" if isinstance(v, float) else str(v)
            for v in (r[key] for r in results.values())
        ]
        print(f"| {key} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
