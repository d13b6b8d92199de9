"""``GET /metrics``: the Prometheus text exposition of the app's registry."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    response_class=Response,
    summary="Prometheus metrics",
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}},
)
def metrics(request: Request) -> Response:
    """Every rank's scaler state and the exporter's own counters, in text format 0.0.4.

    A sync route: FastAPI runs it in its thread pool, so a large scrape does not stall
    ingest on the event loop.
    """
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)
