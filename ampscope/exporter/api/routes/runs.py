"""``/api/v1/runs/...``: the JSON query API over runs, ranks, histories and health."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from ampscope.exporter import health
from ampscope.exporter.api.deps import ClockDep, SettingsDep, StoreDep
from ampscope.exporter.api.errors import ApiError, responses
from ampscope.exporter.api.models import (
    Fp8Event,
    Fp8SeriesView,
    HealthReport,
    History,
    PauseView,
    RankView,
    ReplicaChecksView,
    RunSummary,
    SuspectBatch,
)
from ampscope.exporter.settings import Settings
from ampscope.exporter.state.ranks import RankSnapshot
from ampscope.verdicts.ranks import LIVE_STATES, state_counts

router = APIRouter(prefix="/api/v1/runs", tags=["runs"])

RunId = Annotated[str, Path(description="Run id, as in the records' identity.run.")]
RankId = Annotated[int, Path(ge=0, description="Global rank.")]
NOT_FOUND = responses(404)
"""Every route here answers 404 for a run or rank not held. The response model of each is
its return annotation."""


def _replica_checks(snap: RankSnapshot) -> ReplicaChecksView | None:
    counts, first = snap.replica_counts, snap.replica_divergence
    if not any(counts):
        return None
    return ReplicaChecksView(
        agree=counts.agree,
        diverged=counts.diverged,
        first_diverged_step=None if first is None else first.step,
        ranks=[] if first is None else list(first.ranks),
        parameters=[] if first is None else list(first.parameters),
    )


def _view(snap: RankSnapshot, now: float, settings: Settings) -> RankView:
    record, who = snap.newest, snap.identity
    age = now - snap.last_report
    lifecycle = settings.lifecycle()
    state = lifecycle.state(snap, now)
    pause = lifecycle.pause_of(snap) if state in LIVE_STATES else None
    return RankView(
        run=who.run,
        node=who.node,
        rank=who.rank,
        local_rank=who.local_rank,
        world_size=who.world_size,
        local_world_size=who.local_world_size,
        job_id=who.job_id,
        step=record.step,
        step_time=record.time,
        setup=record.setup,
        scale=record.scale_after,
        growth_tracker=record.growth_tracker,
        last_event=record.event,
        last_skipped=record.skipped,
        totals=record.totals,
        dropped_records=snap.dropped_records,
        up=snap.reported_within(now, settings.stale_after_s),
        state=state,
        pause=None if pause is None else PauseView(reason=pause.reason, seconds=pause.seconds(now)),
        failure=snap.failure if snap.finished_at is not None else None,
        stop_signal=snap.stop_signal if snap.finished_at is not None else None,
        last_report_time=snap.last_report,
        seconds_since_report=age,
        restarts=snap.restarts,
        fp8=[
            Fp8SeriesView(
                layer=series.layer,
                tensor=series.tensor,
                step=series.step,
                newest=series.entry,
                skipped=series.skipped,
                baseline=series.baseline,
                underflow_recent=list(series.underflow_recent),
                spike=None if series.spike is None else Fp8Event(**vars(series.spike)),
                nonfinite=None if series.nonfinite is None else Fp8Event(**vars(series.nonfinite)),
            )
            for series in snap.fp8
        ],
        replica_checks=_replica_checks(snap),
    )


def _unknown_run(run: str) -> ApiError:
    return ApiError(
        404,
        "not_found",
        f"unknown run {run!r}: no rank of it reported (GET /api/v1/runs lists the runs held)",
    )


def _ranks(store: StoreDep, run: str) -> list[RankSnapshot]:
    ranks = store.ranks(run)
    if ranks is None:
        raise _unknown_run(run)
    return ranks


def _rank(store: StoreDep, run: str, rank: int) -> RankSnapshot:
    snap = store.rank(run, rank)
    if snap is None:
        if store.ranks(run) is None:
            raise _unknown_run(run)
        raise ApiError(404, "not_found", f"run {run!r} has no rank {rank}")
    return snap


def _summary(run: str, snaps: list[RankSnapshot], now: float, settings: Settings) -> RunSummary:
    up = sum(1 for snap in snaps if snap.reported_within(now, settings.stale_after_s))
    life = settings.lifecycle()
    states = [life.state(snap, now) for snap in snaps]
    freshest = max(snaps, key=lambda snap: snap.last_report)
    return RunSummary(
        run=run,
        ranks=len(snaps),
        up=up,
        stale=len(snaps) - up,
        states=state_counts(states),
        world_size=freshest.identity.world_size,
        newest_step=max(snap.newest.step for snap in snaps),
        last_report_time=freshest.last_report,
    )


@router.get("", summary="Runs the exporter holds")
def list_runs(store: StoreDep, settings: SettingsDep, clock: ClockDep) -> list[RunSummary]:
    """Every run with its rank counts, newest step and last report time, sorted by run."""
    now = clock()
    runs: dict[str, list[RankSnapshot]] = {}
    for run, _, snap in store.latest():
        runs.setdefault(run, []).append(snap)
    return [_summary(run, snaps, now, settings) for run, snaps in runs.items()]


@router.get("/{run}/ranks", summary="Every rank's current state", responses=NOT_FOUND)
def list_ranks(
    run: RunId, store: StoreDep, settings: SettingsDep, clock: ClockDep
) -> list[RankView]:
    """Each rank's newest step, scale, growth tracker, totals and liveness, sorted by rank."""
    now = clock()
    return [_view(snap, now, settings) for snap in _ranks(store, run)]


@router.get("/{run}/ranks/{rank}", summary="One rank's current state", responses=NOT_FOUND)
def get_rank(
    run: RunId, rank: RankId, store: StoreDep, settings: SettingsDep, clock: ClockDep
) -> RankView:
    return _view(_rank(store, run, rank), clock(), settings)


@router.get(
    "/{run}/ranks/{rank}/history",
    summary="A page of one rank's recent step records",
    responses=NOT_FOUND,
)
def get_history(
    run: RunId,
    rank: RankId,
    store: StoreDep,
    settings: SettingsDep,
    since_step: Annotated[
        int | None,
        Query(
            ge=0,
            description="Only records with a step greater than this, oldest first. Without "
            "it: the newest `limit` records.",
        ),
    ] = None,
    limit: Annotated[
        int,
        Query(ge=1, description="Records per page; capped at the exporter's history_limit_max."),
    ] = 100,
) -> History:
    """Records oldest first from the rank's bounded history (``history_length`` per rank).

    Without ``since_step``: the newest ``limit`` records (the latest steps). With it: the
    ``limit`` records after that step; page forward by passing ``next_since_step`` back.
    """
    snap = _rank(store, run, rank)
    limit = min(limit, settings.history_limit_max)
    if since_step is None:
        records = page = list(snap.history[-limit:])
    else:
        records = [r for r in snap.history if r.step > since_step]
        page = records[:limit]
    return History(
        run=run,
        rank=rank,
        records=[held.record() for held in page],
        oldest_held_step=snap.history[0].step if snap.history else None,
        newest_held_step=snap.history[-1].step if snap.history else None,
        capacity=settings.history_length,
        next_since_step=page[-1].step if len(records) > limit else None,
    )


@router.get("/{run}/health", summary="Instability verdicts for a run", responses=NOT_FOUND)
def get_health(run: RunId, store: StoreDep, settings: SettingsDep, clock: ClockDep) -> HealthReport:
    """Scale collapse, skip storm, scale desync, lost and stalled ranks, inf hotspots and
    non-finite updates applied (a bf16/fp32 watch under ``observe``), each with its evidence
    and thresholds; ``status`` is the worst of them. The scale rules leave watch ranks out
    (they have no loss scale). A finished run is judged as it ended (see ``state``)."""
    ranks = _ranks(store, run)
    return health.evaluate(
        run,
        ranks,
        clock(),
        settings.thresholds(),
        lambda pairs: store.batch_ids(run, pairs),
        fp8=store.fp8_rule,
    )


@router.get(
    "/{run}/suspect-batches",
    response_model=list[SuspectBatch],
    summary="The batch ids behind a run's flagged steps",
    responses=responses(404),
)
def get_suspect_batches(run: RunId, store: StoreDep) -> list[dict[str, object]]:
    """One object per flagged (step, rank), sorted by step then rank: the reasons (the
    verdicts that flagged it) and the ids the rank noted for the step (``note_batch``), ready
    for a skip list on resume. Kept per run, at most 1024 (the oldest dropped first)."""
    suspects = store.suspect_batches(run)
    if suspects is None:
        raise _unknown_run(run)
    return suspects
