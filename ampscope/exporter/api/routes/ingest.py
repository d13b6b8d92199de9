"""``POST /api/v1/ingest``: where ranks' reporters deliver batches of step records."""

from __future__ import annotations

import logging

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from ampscope.exporter.api.deps import DeliveryDep
from ampscope.exporter.api.errors import ApiError, refusal, responses
from ampscope.exporter.api.models import IngestResult
from ampscope.exporter.http.body import (
    BodyLimit,
    openapi_body,
    parse_counted,
)
from ampscope.exporter.http.parse import parse_batch
from ampscope.exporter.settings import Settings
from ampscope.exporter.state.ingest_counters import IngestStats
from ampscope.exporter.state.store import BatchRefused, LimitExceeded, Store
from ampscope.reporter.schema import INGEST_PATH, IngestBatch

router = APIRouter(tags=["ingest"])
log = logging.getLogger("ampscope.exporter")


def _check_series_limits(batch: IngestBatch, settings: Settings) -> None:
    """Per-rank series limits that need no store state: devices and parameters."""
    max_devices, max_params = settings.max_devices_per_rank, settings.max_params_per_rank
    for record in batch.records:
        totals = record.totals
        devices = {*totals.found_inf_local, *totals.found_inf_origin}
        devices.update(record.found_inf_local, record.found_inf_origin)
        if len(devices) > max_devices:
            raise LimitExceeded(
                "max_devices_per_rank",
                max_devices,
                f"step {record.step} names {len(devices)} devices; a rank may report "
                f"{max_devices} (max_devices_per_rank)",
            )
        params = max(len(totals.nonfinite_params), len(record.nonfinite_params))
        if params > max_params:
            raise LimitExceeded(
                "max_params_per_rank",
                max_params,
                f"step {record.step} names {params} non-finite parameters; a rank may report "
                f"{max_params} (max_params_per_rank: lower the scaler's top_k)",
            )


def _apply(
    body: bytes, settings: Settings, store: Store, stats: IngestStats, now: float
) -> IngestResult:
    """Parse, check and apply one batch. Runs in a worker thread: a 7 MiB batch takes
    about a CPU-second, which on the event loop would stall every other request
    (``parse_batch`` lets other threads in between records)."""
    batch = parse_counted(parse_batch, body, "IngestBatch", stats)
    if len(batch.records) > settings.max_records_per_batch:
        stats.rejected("too_large")
        raise ApiError(
            413,
            "too_large",
            f"batch holds {len(batch.records)} records; at most "
            f"{settings.max_records_per_batch} per batch (max_records_per_batch)",
            limit="max_records_per_batch",
            value=settings.max_records_per_batch,
        )
    try:
        _check_series_limits(batch, settings)
        outcome = store.ingest(batch, now)
    except BatchRefused as exc:  # a limit, a live rank's identity changed, a clock ahead
        stats.rejected(exc.reason)
        raise refusal(exc) from None
    stats.accepted(len(batch.records))
    if outcome.new_run:
        who = batch.records[0].identity
        log.info(
            "run %r: first record, from rank %d of %d on node %s (step %d)",
            who.run,
            who.rank,
            who.world_size,
            who.node,
            batch.records[0].step,
        )
    return IngestResult(
        accepted=outcome.accepted,
        ignored=outcome.ignored,
        heartbeat_interval_s=settings.stale_after_s / 4,
    )


@router.post(
    INGEST_PATH,
    response_model=IngestResult,
    summary="Deliver a batch of step records from one rank",
    responses=responses(400, 401, 408, 409, 413, 422, 429),
    # The body is read by hand (bounded), so OpenAPI is told what it holds.
    openapi_extra=openapi_body("IngestBatch"),
)
async def ingest(delivery: DeliveryDep) -> IngestResult:
    """Validate an ``IngestBatch`` strictly and apply it to the rank's state.

    Answers 400 (not JSON, or nested deeper than ``max_json_depth``), 401 (token), 408
    (body not complete within ``body_timeout_s``), 409 (a live rank's identity changed),
    413 (body or batch too large), 422 (schema violations, with their locations, or
    records timed too far ahead) or 429 (a cardinality limit, or ``max_inflight_bytes``
    of bodies being received already; named in ``limit``). A rejected batch changes nothing.
    """
    settings = delivery.settings
    async with delivery.body(BodyLimit(settings.max_body_bytes), route="ingest") as body:
        now = delivery.clock()
        return await run_in_threadpool(_apply, body, settings, delivery.store, delivery.stats, now)
