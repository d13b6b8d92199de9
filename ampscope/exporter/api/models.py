"""Response models of the JSON API (what /docs shows). Requests use the record schema."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from ampscope.reporter.schema import (
    Fp8Tensor,
    RankFailure,
    RankTotals,
    ScaleEvent,
    Setup,
    StepRecord,
)
from ampscope.verdicts.ranks import STATES, RankStateName
from ampscope.verdicts.rollup import RunState
from ampscope.verdicts.verdict import Status, Verdict

_PER_STATE = f"Ranks per state ({', '.join(STATES)})."


class IngestResult(BaseModel):
    """Answer to an accepted ingest batch."""

    accepted: int = Field(description="Records that changed the rank's state.")
    ignored: int = Field(
        description="Duplicates of records already held (retries) and records from a "
        "process of this rank that has since restarted."
    )
    heartbeat_interval_s: float | None = Field(
        default=None,
        description="How often the reporter should send a heartbeat while it has no records "
        "to send: a quarter of the exporter's stale_after_s.",
    )


class ErrorBody(BaseModel):
    """Every error answer of every endpoint, the server's own 400/408/503 included."""

    error: str = Field(
        description="Machine-readable reason: unauthorized, too_large, malformed, invalid, "
        "cardinality, busy, header_timeout, body_timeout, over_capacity, not_found, "
        "method_not_allowed, internal."
    )
    detail: str = Field(description="What was wrong, for people.")
    limit: str | None = Field(default=None, description="The setting a 413/429 hit.")
    value: int | float | None = Field(
        default=None, description="That setting's value (seconds for a timeout)."
    )
    errors: list[dict[str, Any]] | None = Field(
        default=None, description="422: schema violations (location, message, type), trimmed."
    )


class RunSummary(BaseModel):
    run: str
    ranks: int = Field(description="Ranks held (stale ones included until retention).")
    up: int = Field(description="Ranks that reported within the stale TTL.")
    stale: int = Field(
        description="Ranks not heard from within the stale TTL (lost, finished, failed or stopped)."
    )
    states: dict[str, int] = Field(description=_PER_STATE)
    world_size: int = Field(description="world_size the newest-reporting rank declared.")
    newest_step: int = Field(description="Highest step any rank reported.")
    last_report_time: float = Field(description="Unix time of the newest report received.")


class Fp8Event(BaseModel):
    """A judged FP8 observation: an amax spike, or (``value`` null) a non-finite amax."""

    step: int
    value: float | None
    baseline: float | None = Field(description="Median of the preceding observations.")
    received: float = Field(description="Exporter clock when it was judged.")


class Fp8SeriesView(BaseModel):
    """One FP8 layer's tensor on one rank (docs/fp8.md)."""

    layer: str
    tensor: str
    step: int = Field(description="Step of the newest observation.")
    newest: Fp8Tensor
    skipped: bool = Field(description="That iteration was skipped for overflow (not judged).")
    baseline: float | None = Field(
        description="Median amax the next observation is compared with; null: too few known."
    )
    underflow_recent: list[float] = Field(description="Recent underflow ratios, oldest first.")
    spike: Fp8Event | None = Field(description="The newest amax spike.")
    nonfinite: Fp8Event | None = Field(description="The newest non-finite amax.")


class ReplicaChecksView(BaseModel):
    """A rank's replica checks (``attach(model, replica_check_every=N)``)."""

    agree: int
    diverged: int
    first_diverged_step: int | None = Field(
        default=None, description="Step of the first check whose replicas disagreed."
    )
    ranks: list[int] = Field(
        default=[], description="The ranks that disagreed at that check (the minority)."
    )
    parameters: list[str] = Field(default=[], description="The parameters that differed.")


class PauseView(BaseModel):
    """A live rank that says it stops stepping on purpose (``paused()`` on the rank side)."""

    reason: str = Field(description="What it does meanwhile (checkpoint, eval...).")
    seconds: float = Field(description="How long it has been paused.")


class RankView(BaseModel):
    """A rank's current state, from its newest record."""

    run: str
    node: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int | None = Field(
        default=None, description="Ranks on its node, when the rank said (LOCAL_WORLD_SIZE)."
    )
    job_id: str | None = Field(default=None, description="The scheduler's job id, if any.")
    step: int
    step_time: float = Field(description="Rank's wall-clock time of that step.")
    setup: Setup = Field(
        description="What the rank runs: mode scaler (an fp16 loss scaler) or watch (a "
        "GradWatch on a bf16/fp32 run, no loss scale), its policy for non-finite gradients "
        "and its gradient dtype. Ranks of reporters that predate it read as a scaler."
    )
    scale: float = Field(
        description="scale_after of the newest step; always 1 for a watch rank, which has no "
        "loss scale (growth_tracker 0, last_event none, no backoffs or growths either)."
    )
    growth_tracker: int
    last_event: ScaleEvent
    last_skipped: bool
    totals: RankTotals
    dropped_records: int = Field(description="Records the rank's reporter dropped (cumulative).")
    up: bool = Field(description="Heard from (records or heartbeats) within the stale TTL.")
    state: RankStateName = Field(
        description="running: heard from within stale_after_s and its step advanced within "
        "stall_after_s; stalled: heard from, no new step for stall_after_s; lost: nothing "
        "heard for stale_after_s and no final record; finished: sent its final record, "
        "training ended normally; failed: sent its final record, training ended on an "
        "exception (see failure); stopped: sent its final record, its launcher stopped it "
        "with a signal (SIGTERM: an elastic restart, a preemption, an eviction; see "
        "stop_signal). lost_rank never counts a stopped rank. A rank that says it paused "
        "on purpose (see pause) is running until pause_limit_s without a step, then "
        "stalled."
    )
    pause: PauseView | None = Field(
        default=None,
        description="For a running or stalled rank whose heartbeats say it paused on "
        "purpose (a checkpoint save, an evaluation): the reason and for how long; null "
        "otherwise.",
    )
    failure: RankFailure | None = Field(
        default=None,
        description="For a failed rank: the exception its training ended on (class, "
        "message, step; for a non-finite stop the origin ranks) and where the reporter "
        "saw it; null otherwise.",
    )
    stop_signal: int | None = Field(
        default=None,
        description="For a stopped rank: the number of the signal that stopped it (15: "
        "SIGTERM); null otherwise.",
    )
    last_report_time: float = Field(description="Unix time the exporter last heard from it.")
    seconds_since_report: float
    restarts: int = Field(description="Times the exporter saw this rank's process restart.")
    fp8: list[Fp8SeriesView] = Field(
        default=[],
        description="Every FP8 layer's tensors (torchao Float8Linear), when the rank has any.",
    )
    replica_checks: ReplicaChecksView | None = Field(
        default=None,
        description="Its replica group's checks (attach(model, replica_check_every=N)) "
        "since its process started; null when it ran none.",
    )


class History(BaseModel):
    """A page of a rank's bounded record history, oldest first."""

    run: str
    rank: int
    records: list[StepRecord]
    oldest_held_step: int | None = Field(description="Oldest step the exporter still holds.")
    newest_held_step: int | None
    capacity: int = Field(description="Records held per rank at most (history_length).")
    next_since_step: int | None = Field(
        description="Pass as since_step for the next page; null when this page reached the end."
    )


class SuspectBatch(BaseModel):
    """One flagged step of one rank and the batch ids the rank noted for it."""

    step: int = Field(description="The rank's step (its count of update() calls).")
    rank: int
    reasons: list[str] = Field(
        description="Why the step is suspect: nonfinite_origin, skipped_step, "
        "nonfinite_update_applied, loss_spike, grad_norm_spike, origin_outlier."
    )
    batch_ids: list[int | str] = Field(
        description="The ids the rank noted for the step (note_batch); empty when it noted none."
    )
    batch_ids_left_out: int = Field(
        description="Ids noted beyond the per-iteration bound, or invalid, counted instead."
    )


class HealthReport(BaseModel):
    run: str
    status: Status = Field(description="The worst verdict.")
    state: RunState = Field(
        description="active: a rank has not sent its final record; finished: every rank "
        "sent its final record and none failed or was stopped; failed: every rank sent its "
        "final record and at least one failed (rank_failed is critical); stopped: every rank "
        "sent its final record, none failed and at least one was stopped by a signal (its "
        "launcher stopped it). Once ended, the instability rules are evaluated as of the "
        "last final record. No alert fires for a finished or stopped run."
    )
    evaluated_at: float
    ranks: int
    up: int
    states: dict[str, int] = Field(description=_PER_STATE)
    verdicts: list[Verdict]
