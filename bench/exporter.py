"""Exporter load test: ``ampscope serve`` and a Pushgateway under the same pushers.

For each server, in a fresh process: concurrent ingest with each rank count (64-rank
phase first, then the first ranks of the same run again, so the server holds exactly
``max_ranks`` ranks), then sequential scrapes of /metrics, then in a second fresh process
the resident memory after each cumulative record checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from bench.config import ExporterBenchConfig
from bench.load import (
    LoadResult,
    RequestFactory,
    ampscope_ingest,
    push_concurrently,
    pushgateway_put,
    scrape,
)
from bench.payloads import SimulatedRank
from bench.servers import ServerProcess, ampscope_exporter, pushgateway
from bench.stats import latency_percentiles

log = logging.getLogger(__name__)

RUN = "bench"
ServerFactory = Callable[[], ServerProcess]
FactoryFor = Callable[[int], RequestFactory]


def _ranks(config: ExporterBenchConfig, run: str) -> list[SimulatedRank]:
    return [
        SimulatedRank(
            run=run, rank=r, world_size=config.max_ranks, devices=config.devices, top_k=config.top_k
        )
        for r in range(config.max_ranks)
    ]


def _ms(samples: list[float]) -> dict[str, float]:
    return {k: v * 1e3 for k, v in latency_percentiles(samples).items()}


def _ingest_summary(result: LoadResult, records_per_request: int) -> dict[str, Any]:
    if result.errors:
        raise RuntimeError(f"{len(result.errors)} failed requests, first: {result.errors[0]}")
    return {
        "requests": result.requests,
        "records": result.requests * records_per_request,
        "seconds": result.seconds,
        "requests_per_second": result.requests_per_second,
        "records_per_second": result.requests_per_second * records_per_request,
        "mean_body_bytes": result.body_bytes / result.requests if result.requests else 0.0,
        "latency_ms": _ms(result.latencies),
    }


def _measure_server(
    server: ServerFactory, request_for: FactoryFor, config: ExporterBenchConfig
) -> dict[str, Any]:
    ranks = _ranks(config, RUN)
    out: dict[str, Any] = {"records_per_request": config.records_per_batch, "ingest": {}}
    with server() as proc:
        out["rss_idle_bytes"] = proc.rss_bytes()
        # Warm-up: every rank registers and every connection path is hot before timing.
        push_concurrently(
            host=proc.host,
            port=proc.port,
            ranks=ranks,
            requests_per_rank=2,
            make_request=request_for(config.records_per_batch),
        )
        for count in sorted(config.rank_counts, reverse=True):
            per_rank = max(2, config.requests_per_phase // count)
            result = push_concurrently(
                host=proc.host,
                port=proc.port,
                ranks=ranks[:count],
                requests_per_rank=per_rank,
                make_request=request_for(config.records_per_batch),
            )
            out["ingest"][str(count)] = _ingest_summary(result, config.records_per_batch)
            log.info("%s ingest %d ranks: %s", proc.name, count, out["ingest"][str(count)])
        scraped = scrape(host=proc.host, port=proc.port, times=config.scrapes)
        out["scrape"] = {
            "ranks": config.max_ranks,
            "devices_per_rank": config.devices,
            "params_per_rank": config.top_k,
            "size_bytes": scraped.size_bytes,
            "samples": scraped.samples,
            "latency_ms": _ms(scraped.latencies),
        }
        zipped = scrape(host=proc.host, port=proc.port, times=config.scrapes, gzip=True)
        out["scrape_gzip"] = {"size_bytes": zipped.size_bytes, "latency_ms": _ms(zipped.latencies)}
        out["scrape_after_change"] = _scrape_after_change(proc, ranks, request_for, config)
        out["rss_loaded_bytes"] = proc.rss_bytes()
    out["memory"] = _measure_memory(server, request_for, config)
    return out


def _scrape_after_change(
    proc: ServerProcess,
    ranks: list[SimulatedRank],
    request_for: FactoryFor,
    config: ExporterBenchConfig,
) -> dict[str, Any]:
    """Scrapes each right after every rank pushed once more (untimed), so no rank's state
    is the one the previous scrape saw: what Prometheus meets when ranks report more
    often than it scrapes."""
    latencies: list[float] = []
    for _ in range(max(3, config.scrapes // 5)):
        push_concurrently(
            host=proc.host,
            port=proc.port,
            ranks=ranks,
            requests_per_rank=1,
            make_request=request_for(config.records_per_batch),
        )
        latencies += scrape(host=proc.host, port=proc.port, times=1, gzip=True).latencies
    return {"latency_ms": _ms(latencies)}


def _measure_memory(
    server: ServerFactory, request_for: FactoryFor, config: ExporterBenchConfig
) -> dict[str, Any]:
    """RSS of a fresh server process after each cumulative record checkpoint."""
    ranks = _ranks(config, RUN)
    batch = config.rss_records_per_batch
    checkpoints: list[dict[str, int]] = []
    sent = 0
    with server() as proc:
        start = proc.rss_bytes()
        for target in config.rss_checkpoints:
            per_rank = max(1, round((target - sent) / (batch * len(ranks))))
            result = push_concurrently(
                host=proc.host,
                port=proc.port,
                ranks=ranks,
                requests_per_rank=per_rank,
                make_request=request_for(batch),
                prebuild=False,
            )
            if result.errors:
                raise RuntimeError(f"memory phase: {result.errors[0]}")
            sent += result.requests * batch
            checkpoints.append({"records": sent, "rss_bytes": proc.rss_bytes()})
            log.info("%s RSS after %d records: %d", proc.name, sent, checkpoints[-1]["rss_bytes"])
    return {"rss_start_bytes": start, "checkpoints": checkpoints}


def _add_rss_per_held_record(memory: dict[str, Any], config: ExporterBenchConfig) -> None:
    """RSS growth over the records the exporter holds at the last checkpoint: each rank
    keeps its newest ``history_length`` records (the server runs with the default)."""
    from ampscope.exporter.settings import Settings

    last = memory["checkpoints"][-1]
    per_rank = last["records"] // config.max_ranks
    held = min(per_rank, Settings().history_length) * config.max_ranks
    memory["held_records"] = held
    memory["rss_per_held_record_bytes"] = (last["rss_bytes"] - memory["rss_start_bytes"]) / held


def _ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """ampscope / Pushgateway for each headline figure (> 1: ampscope is higher)."""

    def r(a: float, b: float) -> float:
        return a / b if b else float("nan")

    out: dict[str, Any] = {"ingest": {}}
    for count, mine in ours["ingest"].items():
        other = theirs["ingest"][count]
        out["ingest"][count] = {
            "requests_per_second": r(mine["requests_per_second"], other["requests_per_second"]),
            "latency_p50": r(mine["latency_ms"]["p50"], other["latency_ms"]["p50"]),
            "latency_p99": r(mine["latency_ms"]["p99"], other["latency_ms"]["p99"]),
        }
    out["scrape"] = {
        "latency_p50": r(
            ours["scrape"]["latency_ms"]["p50"], theirs["scrape"]["latency_ms"]["p50"]
        ),
        "latency_p99": r(
            ours["scrape"]["latency_ms"]["p99"], theirs["scrape"]["latency_ms"]["p99"]
        ),
        "size_bytes": r(ours["scrape"]["size_bytes"], theirs["scrape"]["size_bytes"]),
    }
    out["rss_final"] = r(
        ours["memory"]["checkpoints"][-1]["rss_bytes"],
        theirs["memory"]["checkpoints"][-1]["rss_bytes"],
    )
    return out


def run_exporter_bench(
    config: ExporterBenchConfig, *, pushgateway_bin: str | None
) -> dict[str, Any]:
    """Measure the ampscope exporter and, when installed, the Pushgateway side by side.

    Cost: two server start-ups per target plus the load itself; the full preset takes a
    few minutes, dominated by the 1M-record memory phase.
    """
    results: dict[str, Any] = {
        "ampscope": _measure_server(ampscope_exporter, ampscope_ingest, config)
    }
    _add_rss_per_held_record(results["ampscope"]["memory"], config)
    if pushgateway_bin is None:
        results["pushgateway"] = {"status": "not run: prometheus-pushgateway not installed"}
        return results
    binary = pushgateway_bin
    results["pushgateway"] = _measure_server(lambda: pushgateway(binary), pushgateway_put, config)
    results["ratio"] = _ratios(results["ampscope"], results["pushgateway"])
    return results
