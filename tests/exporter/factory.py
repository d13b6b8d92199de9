"""Valid records and batches for the service tests, built from the real schema models."""

from __future__ import annotations

from typing import Any

from ampscope.reporter.schema import (
    AlignedScale,
    DeviceIdentity,
    Identity,
    IngestBatch,
    NonfiniteApplied,
    NonfiniteParam,
    ParamNorm,
    Policy,
    RankTotals,
    ScaleEvent,
    Setup,
    StepRecord,
    StepStats,
    WeatherTotals,
)

T0 = 1_700_000_000.0
"""Start of the tests' fake time (record times and the exporter's fake clock)."""


class FakeClock:
    """An exporter clock the test moves by hand."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def totals(
    steps: int,
    *,
    skipped: int = 0,
    backoffs: int = 0,
    growths: int = 0,
    local: dict[str, int] | None = None,
    origin: dict[str, int] | None = None,
    params: dict[str, int] | None = None,
    aligned: tuple[int, float] | None = None,
    applied: int = 0,
    first_applied: tuple[int, bool | None] | None = None,
    weather: WeatherTotals | None = None,
) -> RankTotals:
    return RankTotals(
        steps=steps,
        skipped_steps=skipped,
        backoffs=backoffs,
        growths=growths,
        found_inf_local=local if local is not None else {"cuda:0": skipped},
        found_inf_origin=origin or {},
        nonfinite_params=[NonfiniteParam(name=n, count=c) for n, c in (params or {}).items()],
        min_scale=None,
        max_scale=None,
        aligned_scale=None if aligned is None else AlignedScale(step=aligned[0], scale=aligned[1]),
        nonfinite_applied=applied,
        first_nonfinite_applied=None
        if first_applied is None
        else NonfiniteApplied(step=first_applied[0], origin=first_applied[1]),
        weather=weather,
    )


def record(
    step: int,
    *,
    run: str = "run-a",
    rank: int = 0,
    node: str = "node0",
    world_size: int = 2,
    job_id: str | None = None,
    local_world_size: int | None = None,
    time: float | None = None,
    scale: float = 65536.0,
    scale_before: float | None = None,
    skipped: bool = False,
    growth_tracker: int = 0,
    total: RankTotals | None = None,
    found_inf: bool | None = None,
    event: ScaleEvent | None = None,
    origin: bool = False,
    **extra: Any,
) -> StepRecord:
    """Step ``step`` of a rank; its time defaults to T0 + step seconds. ``found_inf`` (the
    local and global flags) and ``event`` default to what a scaler does: a skip is a
    found-inf and a backoff. ``origin``: the rank's own gradients held inf/NaN (origin
    tracking on ``cuda:0``)."""
    found_inf = skipped if found_inf is None else found_inf
    return StepRecord(
        identity=Identity(
            run=run,
            node=node,
            rank=rank,
            local_rank=rank % 8,
            world_size=world_size,
            local_world_size=local_world_size,
            job_id=job_id,
        ),
        step=step,
        time=T0 + step if time is None else time,
        found_inf_local={"cuda:0": found_inf},
        found_inf_origin={"cuda:0": True} if origin else {},
        found_inf_global=found_inf,
        skipped=skipped,
        scale_before=scale if scale_before is None else scale_before,
        scale_after=scale,
        growth_tracker=growth_tracker,
        event=event if event is not None else ("backoff" if skipped else "none"),
        optimizers=[],
        nonfinite_params=[],
        totals=total if total is not None else totals(step),
        **extra,
    )


def watch(
    step: int,
    *,
    policy: Policy = "observe",
    grad_dtype: str | None = "bfloat16",
    total: RankTotals | None = None,
    **kwargs: Any,
) -> StepRecord:
    """Step ``step`` of a rank running a ``GradWatch`` (bf16/fp32, no loss scaler): scale 1,
    event ``none``, no backoffs or growths; ``skipped`` only under ``skip``."""
    return record(
        step,
        scale=1.0,
        event="none",
        total=total if total is not None else totals(step),
        setup=Setup(mode="watch", policy=policy, grad_dtype=grad_dtype),
        **kwargs,
    )


def batch(
    *records: StepRecord, dropped: int = 0, device: DeviceIdentity | None = None
) -> IngestBatch:
    return IngestBatch(
        schema_version=1, records=list(records), dropped_records=dropped, device=device
    )


def steps(first: int, last: int, **kwargs: Any) -> list[StepRecord]:
    """Clean steps ``first..last`` of one rank with consistent totals."""
    return [record(s, **kwargs) for s in range(first, last + 1)]


def body(*records: StepRecord, dropped: int = 0, device: DeviceIdentity | None = None) -> bytes:
    return batch(*records, dropped=dropped, device=device).model_dump_json().encode()


def gpu(n: int = 0, host: str = "host-a") -> DeviceIdentity:
    """The device of a rank on GPU ``n`` of ``host``, as a CUDA rank names it."""
    return DeviceIdentity(
        device=f"GPU-{n:08x}-0000-0000-0000-00000000abcd",
        pci_bus_id=f"00000000:{0x18 + n:02X}:00.0",
        hostname=host,
    )


def stats(
    loss: float | None,
    grad_norm: float | None = None,
    origin: float | None = None,
    *,
    top: dict[str, float] | None = None,
) -> StepStats:
    """A record's stats: ``grad_norm`` defaults to the loss, ``top`` (name: norm) lists the
    top parameters by gradient norm, as a rank records them on its own spike iterations."""
    return StepStats(
        loss=loss,
        grad_norm=loss if grad_norm is None else grad_norm,
        grad_norm_origin=origin,
        top_params=[ParamNorm(name=n, norm=v) for n, v in (top or {}).items()],
    )
