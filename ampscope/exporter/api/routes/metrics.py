"""``GET /metrics``: the Prometheus text exposition, gzip-compressed when asked."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ampscope.exporter.metrics.exposition import Exposition

router = APIRouter(tags=["metrics"])


def accepts_gzip(accept_encoding: str | None) -> bool:
    """Whether an ``Accept-Encoding`` header allows gzip (``gzip`` or ``*`` with q > 0)."""
    for item in (accept_encoding or "").split(","):
        coding, _, params = item.strip().partition(";")
        if coding.strip().lower() not in ("gzip", "*"):
            continue
        quality = params.strip().lower()
        if quality.startswith("q="):
            try:
                return float(quality[2:]) > 0
            except ValueError:
                return False
        return True
    return False


@router.get(
    "/metrics",
    response_class=Response,
    summary="Prometheus metrics",
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}},
)
def metrics(request: Request) -> Response:
    """Every rank's scaler state and the exporter's own counters, in text format 0.0.4.

    Each rank's lines are rendered once per change of its state and reused (see
    :mod:`ampscope.exporter.metrics.exposition`); the body is gzip-compressed when the client's
    ``Accept-Encoding`` allows it, as Prometheus' does. A sync route: FastAPI runs it in
    its thread pool, so a large scrape does not stall ingest on the event loop.
    """
    exposition: Exposition = request.app.state.exposition
    headers = {"Vary": "Accept-Encoding"}
    if accepts_gzip(request.headers.get("accept-encoding")):
        _, compressed = exposition.render_gzip()
        headers["Content-Encoding"] = "gzip"
        return Response(compressed, media_type=CONTENT_TYPE_LATEST, headers=headers)
    return Response(exposition.render(), media_type=CONTENT_TYPE_LATEST, headers=headers)
