"""``POST /api/v1/heartbeat``: a rank saying it is alive between records, or that it ended:
finished, or failed with the exception its training ended on."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from ampscope.exporter.api.deps import DeliveryDep
from ampscope.exporter.api.errors import refusal, responses
from ampscope.exporter.http.body import BodyLimit, openapi_body, parse_counted
from ampscope.exporter.http.parse import validate_json
from ampscope.exporter.state.store import BatchRefused
from ampscope.reporter.schema import HEARTBEAT_PATH, Heartbeat

router = APIRouter(tags=["ingest"])

MAX_HEARTBEAT_BYTES = 16384
"""A heartbeat is a few hundred bytes, a final one that says how its rank failed a few KB
(at most about 8 KB: a 1000-character message, each character escaped); anything larger is
not one."""


class HeartbeatResult(BaseModel):
    """Answer to a heartbeat."""

    applied: bool = Field(
        description="False when the exporter holds no record of the rank (a rank is held "
        "from its first record on) or the heartbeat came from a process that has since "
        "restarted. The reporter then sends its newest record again, which brings the "
        "rank back (after an exporter restart, say) with exact counters."
    )
    heartbeat_interval_s: float = Field(
        description="How often the reporter should beat while it sends no records: a "
        "quarter of the exporter's stale_after_s, so a live rank is never lost."
    )


@router.post(
    HEARTBEAT_PATH,
    response_model=HeartbeatResult,
    summary="A rank is alive without new records, or ended (finished or failed)",
    responses=responses(400, 401, 408, 409, 413, 422, 429),
    # The body is read by hand (bounded); the app adds Heartbeat to the OpenAPI components.
    openapi_extra=openapi_body("Heartbeat"),
)
async def heartbeat(delivery: DeliveryDep) -> HeartbeatResult:
    """Validate a ``Heartbeat`` strictly and note that its rank was heard from; a ``final``
    one marks the rank finished, or failed when it carries a ``failure``. Never creates a
    rank. Answers 409 when it names another
    node, local rank or world size than the live rank (as ingest does)."""
    settings, stats = delivery.settings, delivery.stats
    limit = BodyLimit(
        min(settings.max_body_bytes, MAX_HEARTBEAT_BYTES),
        name="heartbeat_bytes",
        hint="a heartbeat is a few hundred bytes, one that says how its rank failed a few KB",
    )
    async with delivery.body(limit, route="heartbeat") as body:
        pass  # a few hundred bytes: validated after the budget is given back
    beat = parse_counted(lambda raw: validate_json(Heartbeat, raw), body, "Heartbeat", stats)
    try:
        applied = delivery.store.heartbeat(beat, delivery.clock())
    except BatchRefused as exc:  # a live rank's identity changed: as ingest answers it
        stats.rejected(exc.reason)
        raise refusal(exc) from None
    return HeartbeatResult(applied=applied, heartbeat_interval_s=settings.stale_after_s / 4)
