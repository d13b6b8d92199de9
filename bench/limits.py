"""The exporter at its limits: memory per held object, RSS under records at the schema's
limits, and /metrics at the series limit.

``python -m bench.limits`` prints a JSON report. ``record_at_limits`` is also what
``tests/exporter/test_memory_limits.py`` posts. Every record is as large as the schema
and the exporter's per-rank limits let it be: 128-character labels, 512-character
parameter names, ``max_devices_per_rank`` devices, ``max_params_per_rank`` parameters in
both lists, ``MAX_OPTIMIZERS`` optimizers, counts near ``MAX_COUNT``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import tracemalloc
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ampscope.reporter.schema import (
    MAX_COUNT,
    MAX_LABEL_LENGTH,
    MAX_OPTIMIZERS,
    MAX_PARAM_NAME_LENGTH,
    AlignedScale,
    Identity,
    IngestBatch,
    NonfiniteParam,
    OptimizerDetail,
    RankTotals,
    StepRecord,
)

DEVICES = 16
"""The exporter's default max_devices_per_rank."""
PARAMS = 32
"""The exporter's default max_params_per_rank."""


def _label(prefix: str, length: int = MAX_LABEL_LENGTH) -> str:
    return (prefix + "-" + "x" * length)[:length]


def record_at_limits(
    run: str, rank: int, step: int, now: float, *, devices: int = DEVICES, params: int = PARAMS
) -> StepRecord:
    """A record of ``rank`` as large as the limits allow, its counters growing with
    ``step`` (the same devices and parameters at every step, as a real rank's)."""
    names = [_label(f"{rank}.dev{d}") for d in range(devices)]
    params_list = [
        NonfiniteParam(name=_label(f"{rank}.p{p}", MAX_PARAM_NAME_LENGTH), count=p + 1)
        for p in range(params)
    ]
    count = MAX_COUNT - 10**9 + step
    return StepRecord(
        identity=Identity(
            run=run, node=_label(f"node{rank}"), rank=rank, local_rank=rank, world_size=4096
        ),
        step=step,
        time=now,
        found_inf_local=dict.fromkeys(names, True),
        found_inf_origin=dict.fromkeys(names, True),
        found_inf_global=True,
        skipped=True,
        scale_before=65536.0,
        scale_after=32768.0,
        growth_tracker=count,
        event="backoff",
        optimizers=[
            OptimizerDetail(index=i, name=_label(f"opt{i}"), found_inf=True, fused=False)
            for i in range(MAX_OPTIMIZERS)
        ],
        nonfinite_params=params_list,
        totals=RankTotals(
            steps=count,
            skipped_steps=count,
            backoffs=count,
            growths=count,
            found_inf_local=dict.fromkeys(names, count),
            found_inf_origin=dict.fromkeys(names, count),
            nonfinite_params=[NonfiniteParam(name=p.name, count=count) for p in params_list],
            min_scale=1.0,
            max_scale=65536.0,
            aligned_scale=AlignedScale(step=max(10, step - step % 10), scale=32768.0),
        ),
    )


def object_sizes() -> dict[str, int]:
    """Bytes of one parsed record at the limits, of its JSON, and of the totals dicts a
    window sample keeps alive, measured with tracemalloc."""
    text = record_at_limits("r", 0, 1, 1.7e9).model_dump_json()
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    parsed = StepRecord.model_validate_json(text)
    parsed_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    again = StepRecord.model_validate_json(text)
    kept = (again.totals.found_inf_local, again.totals.found_inf_origin)
    del again
    gc.collect()
    sample_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del kept, parsed
    return {
        "parsed_record_bytes": parsed_bytes,
        "record_json_bytes": len(text),
        "sample_dicts_bytes": sample_bytes,
    }


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (Linux ``/proc``)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def exporter(env: Mapping[str, str], cwd: str | None = None) -> Iterator[tuple[str, int]]:
    """``ampscope serve`` on a free loopback port with ``env`` added: (url, pid).

    ``cwd`` with ``PYTHONPATH`` in ``env`` runs another checkout's exporter (``-m`` puts
    the working directory first on ``sys.path``)."""
    port = _free_port()
    command = [sys.executable, "-m", "ampscope.cli", "serve", "--port", str(port)]
    command += ["--log-level", "warning"]
    process = subprocess.Popen(command, env={**os.environ, **env}, cwd=cwd)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=2):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the exporter did not start") from None
                time.sleep(0.2)
        yield url, process.pid
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def post(url: str, body: bytes) -> int:
    """POST an ingest body; returns the status."""
    request = urllib.request.Request(
        f"{url}/api/v1/ingest",
        data=body,
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def fill(
    url: str,
    pid: int,
    *,
    runs: int,
    ranks: int,
    rounds: int,
    records_per_batch: int,
    deadline_s: float,
) -> dict[str, Any]:
    """Post ``rounds`` batches of records at the limits to every rank of every run,
    sampling RSS after each round. Stops early at ``deadline_s``."""
    started = time.monotonic()
    statuses: dict[int, int] = {}
    rss: list[int] = [rss_bytes(pid)]
    step = 0
    for _ in range(rounds):
        now = time.time()
        for run in range(runs):
            for rank in range(ranks):
                records = [
                    record_at_limits(f"run{run}", rank, step + i + 1, now)
                    for i in range(records_per_batch)
                ]
                body = IngestBatch(
                    schema_version=1, records=records, dropped_records=0
                ).model_dump_json()
                status = post(url, body.encode())
                statuses[status] = statuses.get(status, 0) + 1
        step += records_per_batch
        rss.append(rss_bytes(pid))
        if time.monotonic() - started > deadline_s:
            break
    return {"statuses": statuses, "rss": rss, "records_per_rank": step}


def metrics_time(url: str, repeats: int = 3) -> dict[str, float]:
    """Seconds and bytes of ``GET /metrics`` (best of ``repeats``)."""
    best = float("inf")
    size = 0
    for _ in range(repeats):
        started = time.perf_counter()
        with urllib.request.urlopen(f"{url}/metrics", timeout=120) as response:
            size = len(response.read())
        best = min(best, time.perf_counter() - started)
    return {"seconds": best, "bytes": size}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--records-per-batch", type=int, default=8)
    parser.add_argument("--deadline", type=float, default=300.0)
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the exporter")
    parser.add_argument("--exporter-cwd", help="working directory of the exporter process")
    args = parser.parse_args(argv)
    env = dict(item.split("=", 1) for item in args.env)
    report: dict[str, Any] = {"sizes": object_sizes(), "env": env}
    with exporter(env, args.exporter_cwd) as (url, pid):
        report["fill"] = fill(
            url,
            pid,
            runs=args.runs,
            ranks=args.ranks,
            rounds=args.rounds,
            records_per_batch=args.records_per_batch,
            deadline_s=args.deadline,
        )
        with urllib.request.urlopen(f"{url}/metrics", timeout=120) as response:
            text = response.read().decode()
        report["tracked"] = [
            line for line in text.splitlines() if line.startswith("ampscope_exporter_tracked")
        ]
        report["metrics"] = metrics_time(url)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
