"""The batch ids behind the steps a verdict names, added to its evidence.

A verdict that names a step on a rank (``loss_spike`` and ``origin_outlier`` per rank,
``grad_norm_spike`` per step with the ranks that saw it, ``nonfinite_update_applied`` per
rank's first such step) gets the ids that rank noted for that step (``note_batch``), where
the source holds them (an exporter's batch ledger): ``batch_ids`` beside the step, or, for
``grad_norm_spike``, ``batches``: one ``{"rank", "batch_ids"}`` per rank. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ampscope.exporter.api.models import Verdict

Ids = Sequence[int | str]
Pair = tuple[int, int]
"""(step, rank)."""


def _rank_entries(verdict: Verdict) -> list[tuple[dict[str, Any], int, int]]:
    # (entry, step, rank) of the evidence's per-rank entries that name a step.
    out = []
    for entry in verdict.evidence.get("ranks", ()):
        if not isinstance(entry, dict) or not isinstance(entry.get("rank"), int):
            continue
        step = entry.get("step", entry.get("first_step"))
        if isinstance(step, int):
            out.append((entry, step, entry["rank"]))
    return out


def _step_entries(verdict: Verdict) -> list[tuple[dict[str, Any], int, list[int]]]:
    out = []
    for entry in verdict.evidence.get("steps", ()):
        if isinstance(entry, dict) and isinstance(entry.get("step"), int):
            out.append(
                (entry, entry["step"], [r for r in entry.get("ranks", ()) if isinstance(r, int)])
            )
    return out


def named_pairs(verdicts: Iterable[Verdict]) -> set[Pair]:
    """Every (step, rank) the verdicts' evidence names."""
    pairs: set[Pair] = set()
    for verdict in verdicts:
        pairs.update((step, rank) for _, step, rank in _rank_entries(verdict))
        for _, step, ranks in _step_entries(verdict):
            pairs.update((step, rank) for rank in ranks)
    return pairs


def with_batch_ids(verdicts: list[Verdict], ids: Mapping[Pair, Ids]) -> list[Verdict]:
    """``verdicts`` with the ids of each named (step, rank) that ``ids`` holds added to
    their evidence (copies; the inputs are unchanged). O(named pairs)."""
    out = []
    for verdict in verdicts:
        copy = verdict.model_copy(deep=True)
        for entry, step, rank in _rank_entries(copy):
            if (step, rank) in ids:
                entry["batch_ids"] = list(ids[(step, rank)])
        for entry, step, ranks in _step_entries(copy):
            batches = [
                {"rank": r, "batch_ids": list(ids[(step, r)])} for r in ranks if (step, r) in ids
            ]
            if batches:
                entry["batches"] = batches
        out.append(copy)
    return out


def attach(
    verdicts: list[Verdict], lookup: Callable[[set[Pair]], Mapping[Pair, Ids]]
) -> list[Verdict]:
    """``with_batch_ids`` over what ``lookup`` finds for the pairs the verdicts name."""
    pairs = named_pairs(verdicts)
    return with_batch_ids(verdicts, lookup(pairs)) if pairs else verdicts
