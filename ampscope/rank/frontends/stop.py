"""Stopping a run everywhere with the same words: :class:`NonFiniteGradientsError`.

When a watch raises (policy ``raise``, or ``max_consecutive_skips`` reached), every
rank reaches the same ``step()`` with the same agreed flag. Each contributes what only
it knows (whether its own gradients held inf/NaN before the reduction, whether its local
shards did, its top parameters, and with a rerun closure what the rerun found of its own
result and the batch ids it noted); :func:`gather` shares them, and every rank builds the
same message from the same gathered list.

The reports travel as JSON in byte tensors, through two ``all_gather`` calls (sizes,
then bytes), not ``all_gather_object``: that one reads its result through NumPy, which
a training environment need not have. A rank whose gather fails raises with its own
report only, and its message says so; it never speaks for ranks it has not heard.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from ampscope.rank.gradients.attribution import top_k
from ampscope.rank.telemetry.identity import collective_device

logger = logging.getLogger("ampscope")

MESSAGE_PARAMS = 5
"""Parameters a message names at most."""

MESSAGE_IDS = 8
"""Batch ids a message names at most per rank."""

RerunResult = Literal["transient", "reproducible"]
"""What a rerun found of a rank's own flagged result (``RerunOutcome.transient``)."""


class NonFiniteGradientsError(RuntimeError):
    """A ``GradWatch`` stopped training: gradients held inf/NaN.

    Raised from ``step()`` on every rank with the same message.

    Attributes:
        step: The iteration (1-based count of update() calls, this one included).
        origin_ranks: Ranks whose own gradients held inf/NaN before the reduction;
            ``None`` when origin tracking is off.
        local_ranks: Ranks whose local gradients (shards) held inf/NaN.
        params: Top parameters, ``(rank, name, non-finite elements)``, most first.
        gathered: Whether every rank's report reached this one. ``False``: the ranks'
            reports could not be gathered, and the attributes and the message hold this
            rank's view only.
        reproduced_ranks: With a rerun closure: ranks whose own flagged result the rerun
            reproduced (the data or the numerics).
        transient_ranks: Ranks whose own flagged result the rerun did not reproduce
            (suspect their device).
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        origin_ranks: tuple[int, ...] | None,
        local_ranks: tuple[int, ...],
        params: tuple[tuple[int, str, int], ...],
        gathered: bool = True,
        reproduced_ranks: tuple[int, ...] = (),
        transient_ranks: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message)
        self.step = step
        self.origin_ranks = origin_ranks
        self.local_ranks = local_ranks
        self.params = params
        self.gathered = gathered
        self.reproduced_ranks = reproduced_ranks
        self.transient_ranks = transient_ranks


@dataclass(frozen=True)
class RankReport:
    """What one rank contributes to the message (small)."""

    rank: int
    origin: bool | None
    """Its own gradients held inf/NaN before the reduction; ``None``: not tracked."""
    local: bool
    params: tuple[tuple[str, int], ...]
    known: bool = True
    """``False``: ampscope failed on that rank before it knew what to report; the
    message then says so and claims nothing of that rank."""
    rerun: RerunResult | None = None
    """What this iteration's rerun found of the rank's own flagged result; ``None``: no
    rerun, or its result was not flagged."""
    batch_ids: tuple[int | str, ...] = ()
    """With a reproduced result: the first batch ids the rank noted for the iteration."""


def unknown(rank: int) -> RankReport:
    """The report of a rank that could not make its own."""
    return RankReport(rank=rank, origin=None, local=False, params=(), known=False)


def encode(report: RankReport) -> bytes:
    """A report as UTF-8 JSON (no pickle: what a rank sends is data only)."""
    params = [list(p) for p in report.params]
    fields = [
        report.rank,
        report.origin,
        report.local,
        params,
        report.known,
        report.rerun,
        list(report.batch_ids),
    ]
    return json.dumps(fields, separators=(",", ":")).encode()


def decode(payload: bytes) -> RankReport:
    """The report :func:`encode` made.

    Raises:
        ValueError: not such a report (``json.JSONDecodeError`` is one).
    """
    rank, origin, local, params, known, rerun, ids = json.loads(payload.decode())
    report = RankReport(
        rank=rank,
        origin=origin,
        local=local,
        params=tuple((n, c) for n, c in params),
        known=known,
        rerun=rerun,
        batch_ids=tuple(ids),
    )
    if not (
        type(rank) is int
        and origin in (None, True, False)
        and type(local) is bool
        and type(known) is bool
        and all(type(n) is str and type(c) is int for n, c in report.params)
        and rerun in (None, "transient", "reproducible")
        and all(type(i) in (int, str) for i in report.batch_ids)
    ):
        raise ValueError(f"not a rank report: {payload[:80]!r}")
    return report


def gather(report: RankReport, group: dist.ProcessGroup | None) -> tuple[list[RankReport], bool]:
    """Every rank's report, by rank, and whether they all arrived.

    Distributed, two ``all_gather`` calls of small tensors on ``group`` (the sizes, then
    the padded bytes), which every rank makes whatever it sends: a report that cannot be
    encoded goes as nothing. No NumPy, no pickle. If a collective fails, or a report does
    not decode, this rank goes on with its own report only (``False``): its message then
    says it holds its own view, and it still raises.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return [report], True
    try:
        payload = encode(report)
    except Exception:
        logger.warning("ampscope: could not encode this rank's report", exc_info=True)
        payload = b""
    try:
        device = collective_device(group)
        world = dist.get_world_size(group)
        size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
        sizes = [torch.zeros_like(size) for _ in range(world)]
        dist.all_gather(sizes, size, group=group)
        lengths = [int(s.item()) for s in sizes]
        mine = torch.zeros(max([*lengths, 1]), dtype=torch.uint8, device=device)
        if payload:
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        received = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(received, mine, group=group)
        reports = [
            decode(bytes(tensor[:length].tolist()))
            for tensor, length in zip(received, lengths, strict=True)
        ]
    except Exception:
        logger.warning(
            "ampscope: could not gather the ranks' reports; this rank's message holds its "
            "own view only",
            exc_info=True,
        )
        return [report], False
    return sorted(reports, key=lambda r: r.rank), True


def build_error(
    reports: list[RankReport], step: int, reason: str, *, gathered: bool = True
) -> NonFiniteGradientsError:
    """The error every rank raises; the same for the same reports. It claims nothing of a
    rank whose report is unknown, nor, with ``gathered=False`` (``reports`` is this
    rank's own alone), of the other ranks: it says whose view it holds."""
    known = [r for r in reports if r.known]
    silent = tuple(r.rank for r in reports if not r.known)
    tracked = [r for r in known if r.origin is not None]
    origin_ranks = tuple(r.rank for r in tracked if r.origin) if tracked else None
    local_ranks = tuple(r.rank for r in known if r.local)
    counts: dict[str, int] = {}
    where: dict[str, int] = {}
    for report in known:
        for name, count in report.params:
            key = f"{name}@{report.rank}"
            counts[key] = count
            where[key] = report.rank
    top = [(where[k], k.rsplit("@", 1)[0], c) for k, c in top_k(counts, MESSAGE_PARAMS)]
    parts = [f"ampscope: non-finite gradients at step {step}: {reason}."]
    if not gathered:
        own = reports[0].rank
        parts.append(f"This is rank {own}'s view only: the ranks' reports could not be gathered.")
    if silent:
        parts.append(
            f"Rank(s) {', '.join(map(str, silent))} could not report (ampscope failed there)."
        )
    if origin_ranks is None:
        parts.append("Origin not tracked (attach(model, track_origin=True) names the rank).")
    elif origin_ranks:
        parts.append(f"Origin rank(s): {', '.join(map(str, origin_ranks))}.")
    elif not gathered:
        parts.append(f"Rank {own}'s own gradients held no inf/NaN before the reduction.")
    elif silent:
        parts.append("No reporting rank's own gradients held inf/NaN before the reduction.")
    else:
        parts.append("No rank's own gradients held inf/NaN before the reduction.")
    if local_ranks:
        parts.append(f"Local gradients held inf/NaN on rank(s) {', '.join(map(str, local_ranks))}.")
    reproduced = [r for r in known if r.rerun == "reproducible"]
    transient = tuple(r.rank for r in known if r.rerun == "transient")
    if reproduced:
        ranks = ", ".join(str(r.rank) for r in reproduced)
        noted = "; ".join(
            f"rank {r.rank}: {', '.join(map(str, r.batch_ids))}" for r in reproduced if r.batch_ids
        )
        ids = f" Batch ids noted at step {step}: {noted}." if noted else ""
        parts.append(
            f"Reproducible: the rerun from the same batch reproduced it on rank(s) {ranks}: "
            f"suspect the data or the numerics of step {step}.{ids}"
        )
    if transient:
        parts.append(
            f"Transient on rank(s) {', '.join(map(str, transient))}: the rerun did not "
            "reproduce that rank's result: suspect its device."
        )
    if top:
        named = ", ".join(f"{name} ({count} on rank {rank})" for rank, name, count in top)
        parts.append(f"Top parameters: {named}.")
    return NonFiniteGradientsError(
        " ".join(parts),
        step=step,
        origin_ranks=origin_ranks,
        local_ranks=local_ranks,
        params=tuple(top),
        gathered=gathered,
        reproduced_ranks=tuple(r.rank for r in reproduced),
        transient_ranks=transient,
    )


def own_params(counts: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """This rank's top parameters for its report."""
    return tuple(top_k(dict(counts), MESSAGE_PARAMS))
