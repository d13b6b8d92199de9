"""Stopping a run everywhere with the same words: :class:`NonFiniteGradientsError`.

When a watch raises (policy ``raise``, or ``max_consecutive_skips`` reached), every
rank reaches the same ``step()`` with the same agreed flag. Each contributes what only
it knows (whether its own gradients held inf/NaN before the reduction, whether its local
shards did, its top parameters); one ``all_gather_object`` shares them, and every rank
builds the same message from the same gathered list.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from ampscope.rank.gradients.attribution import top_k

logger = logging.getLogger("ampscope")

MESSAGE_PARAMS = 5
"""Parameters a message names at most."""


class NonFiniteGradientsError(RuntimeError):
    """A ``GradWatch`` stopped training: gradients held inf/NaN.

    Raised from ``step()`` on every rank with the same message.

    Attributes:
        step: The iteration (1-based count of update() calls, this one included).
        origin_ranks: Ranks whose own gradients held inf/NaN before the reduction;
            ``None`` when origin tracking is off.
        local_ranks: Ranks whose local gradients (shards) held inf/NaN.
        params: Top parameters, ``(rank, name, non-finite elements)``, most first.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        origin_ranks: tuple[int, ...] | None,
        local_ranks: tuple[int, ...],
        params: tuple[tuple[int, str, int], ...],
    ) -> None:
        super().__init__(message)
        self.step = step
        self.origin_ranks = origin_ranks
        self.local_ranks = local_ranks
        self.params = params


@dataclass(frozen=True)
class RankReport:
    """What one rank contributes to the message (picklable, small)."""

    rank: int
    origin: bool | None
    local: bool
    params: tuple[tuple[str, int], ...]


def gather(report: RankReport, group: dist.ProcessGroup | None) -> list[RankReport]:
    """Every rank's report, by rank: one ``all_gather_object`` when distributed. If the
    collective fails the rank goes on with its own report (its message then says less,
    but it still raises)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return [report]
    gathered: list[RankReport | None] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(gathered, report, group=group)
    except Exception:
        logger.warning("ampscope: could not gather the ranks' reports", exc_info=True)
        return [report]
    return sorted((r for r in gathered if r is not None), key=lambda r: r.rank)


def build_error(reports: list[RankReport], step: int, reason: str) -> NonFiniteGradientsError:
    """The error every rank raises; the same for the same reports."""
    tracked = [r for r in reports if r.origin is not None]
    origin_ranks = tuple(r.rank for r in tracked if r.origin) if tracked else None
    local_ranks = tuple(r.rank for r in reports if r.local)
    counts: dict[str, int] = {}
    where: dict[str, int] = {}
    for report in reports:
        for name, count in report.params:
            key = f"{name}@{report.rank}"
            counts[key] = count
            where[key] = report.rank
    top = [(where[k], k.rsplit("@", 1)[0], c) for k, c in top_k(counts, MESSAGE_PARAMS)]
    parts = [f"ampscope: non-finite gradients at step {step}: {reason}."]
    if origin_ranks is None:
        parts.append("Origin not tracked (attach(model, track_origin=True) names the rank).")
    elif origin_ranks:
        parts.append(f"Origin rank(s): {', '.join(map(str, origin_ranks))}.")
    else:
        parts.append("No rank's own gradients held inf/NaN before the reduction.")
    if local_ranks:
        parts.append(f"Local gradients held inf/NaN on rank(s) {', '.join(map(str, local_ranks))}.")
    if top:
        named = ", ".join(f"{name} ({count} on rank {rank})" for rank, name, count in top)
        parts.append(f"Top parameters: {named}.")
    return NonFiniteGradientsError(
        " ".join(parts),
        step=step,
        origin_ranks=origin_ranks,
        local_ranks=local_ranks,
        params=tuple(top),
    )


def own_params(counts: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """This rank's top parameters for its report."""
    return tuple(top_k(dict(counts), MESSAGE_PARAMS))
