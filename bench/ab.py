"""Interleaved A/B(/C) comparison of step times, robust to machine drift.

Contenders run in blocks, in an order that rotates and reverses from one group of blocks
to the next (ABBA BAAB ... for two). Each group compares every contender's block median
to the baseline's in the same group, so drift between groups cancels; the headline is the
median of those per-group ratios, with its IQR and a 95% bootstrap interval.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from bench.stats import bootstrap_median_ci, quantile, summarize

T = TypeVar("T")


def interleaved_order(group: int, names: Sequence[str]) -> list[str]:
    """Order of the contenders in block group ``group``: rotated, and reversed every other.

    With two contenders this gives AB BA BA AB ...; with three, every contender takes
    every position equally often over six groups.
    """
    names = list(names)
    k = group // 2 % len(names)
    rotated = names[k:] + names[:k]
    return rotated if group % 2 == 0 else rotated[::-1]


def run_interleaved(
    contenders: dict[str, T], run_block: Callable[[T], list[float]], *, groups: int
) -> dict[str, list[list[float]]]:
    """Call ``run_block(contender)`` for every contender in every group, interleaved.

    Returns, per contender name, one list of samples per group (in group order).
    """
    blocks: dict[str, list[list[float]]] = {name: [] for name in contenders}
    for group in range(groups):
        for name in interleaved_order(group, list(contenders)):
            blocks[name].append(run_block(contenders[name]))
    return blocks


def compare_groups(
    blocks: dict[str, list[list[float]]], *, baseline: str, unit_scale: float = 1e3
) -> dict[str, Any]:
    """Summaries per contender and per-group ratios against ``baseline``.

    Args:
        blocks: Per contender, one list of samples (seconds) per group; all contenders
            must have the same number of groups.
        baseline: The contender the others are divided by.
        unit_scale: Multiplier from seconds to the reported unit (1e3: milliseconds).

    Returns:
        ``{"samples": {name: Summary dict}, "ratio": {name: {...}}}``; each ratio entry
        holds the median, p25, p75 and 95% bootstrap interval of the per-group ratios,
        the number of groups, and ``delta`` (difference of overall medians, in the unit).
    """
    flat = {
        name: [s * unit_scale for block in groups for s in block] for name, groups in blocks.items()
    }
    out: dict[str, Any] = {"samples": {n: summarize(v).as_dict() for n, v in flat.items()}}
    ratios: dict[str, Any] = {}
    base_medians = [statistics.median(b) for b in blocks[baseline]]
    for name, groups in blocks.items():
        if name == baseline:
            continue
        per_group = [
            statistics.median(block) / base
            for block, base in zip(groups, base_medians, strict=True)
        ]
        low, high = bootstrap_median_ci(per_group)
        ratios[name] = {
            "median": statistics.median(per_group),
            "p25": quantile(per_group, 0.25),
            "p75": quantile(per_group, 0.75),
            "ci_low": low,
            "ci_high": high,
            "groups": len(per_group),
            "delta": statistics.median(flat[name]) - statistics.median(flat[baseline]),
        }
    out["ratio"] = ratios
    return out
