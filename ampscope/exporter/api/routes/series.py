"""``/api/v1/runs/{run}/series``: a run's recent steps as columns, for charts."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from ampscope.exporter.api.deps import StoreDep
from ampscope.exporter.api.errors import ApiError, responses
from ampscope.exporter.state import columns as series

router = APIRouter(prefix="/api/v1/runs", tags=["runs"])

MAX_STEPS_CAP = 8192
"""Most steps one series answer holds (64 ranks x 8192 steps is ~5 MB of JSON)."""


@router.get(
    "/{run}/series",
    response_model=series.RunSeries,
    summary="Every rank's recent steps as compact columns (what the web view draws)",
    responses=responses(404),
)
def get_series(
    run: Annotated[str, Path(description="Run id, as in the records' identity.run.")],
    store: StoreDep,
    since_step: Annotated[
        int, Query(ge=0, description="Only steps greater than this (poll with the newest seen).")
    ] = 0,
    max_steps: Annotated[
        int,
        Query(ge=1, le=MAX_STEPS_CAP, description="Newest steps to return at most."),
    ] = 1024,
) -> series.RunSeries:
    """The scale of every rank at every held step, aligned on the union of steps, and the
    steps where a rank skipped, backed off or saw non-finite gradients (per device, local
    and origin). One request replaces a history page per rank; polling with ``since_step``
    set to the newest step seen returns only what arrived since (records that arrive late
    for older steps, and restarts, show on a full reload)."""
    snaps = store.ranks(run)
    if snaps is None:
        raise ApiError(
            404,
            "not_found",
            f"unknown run {run!r}: no rank of it reported (GET /api/v1/runs lists the runs held)",
        )
    return series.build(run, snaps, since_step=since_step, max_steps=max_steps)
