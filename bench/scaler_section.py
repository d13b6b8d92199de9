"""The scaler-overhead section: every scaler measurement against one live exporter."""

from __future__ import annotations

import http.client
import logging
from typing import Any

from bench.config import ScalerBenchConfig
from bench.scaler_distributed import run_distributed_bench
from bench.scaler_single import overflow_cost, step_time_ab, update_cost
from bench.servers import ServerProcess, ampscope_exporter
from bench.watch_single import watch_cost

log = logging.getLogger(__name__)


def _records_received(server: ServerProcess) -> float:
    """``ampscope_exporter_ingest_records_total`` from the exporter's /metrics."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        body = conn.getresponse().read().decode()
    finally:
        conn.close()
    for line in body.splitlines():
        if line.startswith("ampscope_exporter_ingest_records_total"):
            return float(line.split()[-1])
    raise RuntimeError("the exporter's /metrics lacks ampscope_exporter_ingest_records_total")


def run_scaler_bench(config: ScalerBenchConfig, *, device: str) -> dict[str, Any]:
    """Run every scaler measurement; ampscope's reporters send to a fresh ``ampscope serve``.

    Cost: the full preset takes about two minutes on an idle 2-core machine.
    """
    import torch

    # One intra-op thread, as in each spawned rank: the exporter and ampscope's background
    # thread then find a free core, as they would on a real many-core node, and step
    # times vary less with other load on the host.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    results: dict[str, Any] = {"device": device, "torch_threads": 1}
    try:
        _run_all(config, device=device, results=results)
    finally:
        torch.set_num_threads(threads)
    return results


def _run_all(config: ScalerBenchConfig, *, device: str, results: dict[str, Any]) -> None:
    with ampscope_exporter() as exporter:
        url = f"http://{exporter.host}:{exporter.port}"
        log.info("scaler: single-process step time A/B")
        results["single_process"] = step_time_ab(config, device=device, url=url)
        log.info("scaler: per-update cost")
        results["update_cost"] = update_cost(config, device=device, url=url)
        log.info("scaler: overflow attribution cost")
        results["overflow"] = overflow_cost(config, device=device)
        log.info("scaler: GradWatch per-iteration cost")
        results["watch"] = watch_cost(config, device=device)
        log.info("scaler: distributed step time A/B/C")
        results["distributed"] = run_distributed_bench(config, device=device, url=url)
        # Proof that the reporters were really on: every update() reached the exporter
        # (the scalers' close() flushes their reporters).
        results["exporter_records_received"] = _records_received(exporter)
        results["exporter_records_expected"] = sum(
            results[part]["reported_updates"]
            for part in ("single_process", "update_cost", "distributed")
        )
