"""A run's recent steps as compact columns: what the web view's charts draw.

``/api/v1/runs/{run}/ranks/{rank}/history`` returns whole records, one rank at a time: 64
ranks x 1024 steps would be 64 requests and ~90 MB of JSON. The web view needs only the
scale of every rank at every step and the few steps where something happened (a skip, a
backoff, a found-inf on a device), so this module folds the held histories into one
document: the scale, loss and gradient norm as one array per rank aligned on the union of
steps, and sparse lists of steps for the events, spikes included (~0.6 MB for 64 x 1024
without stats, most of it the scales; the loss and norm columns triple that).

Pure functions of snapshots, like ``health``: no lock, no I/O.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from pydantic import BaseModel, Field

from ampscope.exporter.state.ranks import HeldRecord, RankSnapshot
from ampscope.exporter.state.spike_windows import SPIKE_KINDS, SpikeKindName
from ampscope.verdicts.ranks import is_scaler


class DeviceSteps(BaseModel):
    """The steps at which one rank saw non-finite gradients on one device."""

    rank: int
    device: str
    steps: list[int] = Field(description="Ascending; a subset of RunSeries.steps.")


class SpikeSteps(BaseModel):
    """The steps at which one rank had spikes of one kind."""

    rank: int
    kind: SpikeKindName
    steps: list[int] = Field(description="Ascending.")


class RunSeries(BaseModel):
    """A run's held step records as columns, oldest step first."""

    run: str
    ranks: list[int] = Field(description="Ranks held, ascending: the row order of every list.")
    steps: list[int] = Field(
        description="Ascending union of the steps any rank holds after since_step (the newest "
        "max_steps of them)."
    )
    scale: list[list[float | None]] = Field(
        description="scale_after per rank (outer, in `ranks` order) per step (inner, in "
        "`steps` order); null where that rank holds no record of the step, and everywhere "
        "for a watch rank (bf16/fp32: it has no loss scale)."
    )
    skipped: list[list[int]] = Field(description="Per rank: the steps it skipped.")
    backoffs: list[list[int]] = Field(description="Per rank: the steps whose update backed off.")
    found_inf_local: list[DeviceSteps] = Field(
        description="Every rank/device the ranks report, with the steps whose local gradient "
        "shards held inf/NaN there (empty lists included, so quiet devices show too)."
    )
    found_inf_origin: list[DeviceSteps] = Field(
        description="Likewise for origin detections (a rank's own pre-reduction gradients); "
        "only ranks that track origin have rows."
    )
    loss: list[list[float | None]] = Field(
        default=[],
        description="Each rank's loss per step, like `scale`; null where the rank holds no "
        "record of the step, reports no stats, or overflowed.",
    )
    grad_norm: list[list[float | None]] = Field(
        default=[],
        description="The total gradient norm per rank per step (the same on every rank), "
        "like `loss`.",
    )
    spikes: list[SpikeSteps] = Field(
        default=[],
        description="Every rank's spikes the exporter still holds (the most recent 32 per "
        "rank), whatever since_step: an origin outlier is found when another rank's record "
        "of its step arrives, possibly after a poll has passed that step.",
    )
    oldest_held_step: int | None = Field(
        description="Oldest step any rank still holds: older steps are gone from the exporter."
    )
    truncated: bool = Field(
        description="Steps after since_step were left out to respect max_steps (oldest first)."
    )


def _after(history: Sequence[HeldRecord], since_step: int) -> Sequence[HeldRecord]:
    return history[bisect.bisect_right(history, since_step, key=lambda held: held.step) :]


def build(run: str, snaps: Sequence[RankSnapshot], *, since_step: int, max_steps: int) -> RunSeries:
    """Fold ``snaps`` (one run's ranks, sorted by rank) into columns.

    Cost: O(ranks x held records after ``since_step``), reading only the flags each held
    record keeps beside its JSON (no decoding). A poll with ``since_step`` at the newest
    step it saw reads only the new records.
    """
    tails = [_after(snap.history, since_step) for snap in snaps]
    union = sorted({held.step for tail in tails for held in tail})
    truncated = len(union) > max_steps
    if truncated:
        union = union[-max_steps:]
    first = union[0] if union else 0
    column = {step: index for index, step in enumerate(union)}
    scale: list[list[float | None]] = []
    loss: list[list[float | None]] = []
    grad_norm: list[list[float | None]] = []
    spikes: list[SpikeSteps] = []
    skipped: list[list[int]] = []
    backoffs: list[list[int]] = []
    local: list[DeviceSteps] = []
    origin: list[DeviceSteps] = []
    for snap, tail in zip(snaps, tails, strict=True):
        rank = snap.identity.rank
        # The history holds one process's records (a restart clears it), so the newest
        # record's mode is the mode of every held one.
        scaler = is_scaler(snap.newest.setup.mode)
        row: list[float | None] = [None] * len(union)
        loss_row: list[float | None] = [None] * len(union)
        norm_row: list[float | None] = [None] * len(union)
        rank_skipped: list[int] = []
        rank_backoffs: list[int] = []
        local_steps: dict[str, list[int]] = {d: [] for d in snap.newest.totals.found_inf_local}
        origin_steps: dict[str, list[int]] = {d: [] for d in snap.newest.totals.found_inf_origin}
        for held in tail:
            if held.step < first:
                continue
            at = column[held.step]
            if scaler:
                row[at] = held.scale_after
            loss_row[at], norm_row[at] = held.loss, held.grad_norm
            if held.skipped:
                rank_skipped.append(held.step)
            if held.backoff:
                rank_backoffs.append(held.step)
            for device in held.inf_local:
                local_steps.setdefault(device, []).append(held.step)
            for device in held.inf_origin:
                origin_steps.setdefault(device, []).append(held.step)
        scale.append(row)
        loss.append(loss_row)
        grad_norm.append(norm_row)
        for kind in SPIKE_KINDS:
            steps = sorted({e.step for e in snap.spikes if e.kind == kind})
            if steps:
                spikes.append(SpikeSteps(rank=rank, kind=kind, steps=steps))
        skipped.append(rank_skipped)
        backoffs.append(rank_backoffs)
        local += [DeviceSteps(rank=rank, device=d, steps=s) for d, s in sorted(local_steps.items())]
        origin += [
            DeviceSteps(rank=rank, device=d, steps=s) for d, s in sorted(origin_steps.items())
        ]
    held_oldest = [snap.history[0].step for snap in snaps if snap.history]
    return RunSeries(
        run=run,
        ranks=[snap.identity.rank for snap in snaps],
        steps=union,
        scale=scale,
        skipped=skipped,
        backoffs=backoffs,
        found_inf_local=local,
        found_inf_origin=origin,
        loss=loss,
        grad_norm=grad_norm,
        spikes=spikes,
        oldest_held_step=min(held_oldest) if held_oldest else None,
        truncated=truncated,
    )
