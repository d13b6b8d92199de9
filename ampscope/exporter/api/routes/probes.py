"""``GET /healthz``: liveness of the exporter process itself."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

router = APIRouter(tags=["probes"])


class Liveness(BaseModel):
    status: str = "ok"


@router.get("/healthz", response_model=Liveness, summary="Liveness probe")
async def healthz() -> Liveness:
    """Answers 200 while the process serves requests. Says nothing about training runs:
    see ``/api/v1/runs/{run}/health``."""
    # async: answered on the event loop itself, without a hop through the thread pool
    # that ingest parsing and scrapes keep busy.
    return Liveness()
