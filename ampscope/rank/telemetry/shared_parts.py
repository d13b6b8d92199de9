"""The parts of a record that repeat from step to step, built once and shared.

On clean iterations most of a record is what the previous one held: the per-device flags,
the optimizer details, an empty list of named parameters. Records
never change their parts (frozen models, and nothing in the rank side writes into a
record's dicts or lists), so :class:`SharedParts` hands out one object per distinct value
instead of building it again. Parts built under strict validation (``validate=True``) are
built afresh and not kept: only what the checks vouched for is shared.
"""

from __future__ import annotations

from ampscope.rank.capture.layout import OptimizerSlot
from ampscope.rank.gradients.attribution import top_k
from ampscope.rank.telemetry.vouching import build_model
from ampscope.reporter.schema import NonfiniteParam, OptimizerDetail

_KEPT = 1024
"""At most this many flag dicts, and as many optimizer lists, are kept (devices x flags
combinations: bounded, but a long run with many devices could see many)."""


class SharedParts:
    """One shared object per distinct record part. Not thread-safe (the record builder's).

    Args:
        k: How many parameters a list of named parameters holds at most.
    """

    def __init__(self, k: int) -> None:
        self._k = k
        self._details: dict[tuple[OptimizerSlot, bool], OptimizerDetail] = {}
        self._detail_lists: dict[
            tuple[int | bool, ...],
            tuple[tuple[OptimizerSlot, ...], list[OptimizerDetail]],
        ] = {}
        """Per (the slots' ids, then their flags): the slots, kept alive so that their ids
        stay theirs, and the list."""
        self._flags: dict[tuple[tuple[str, ...], tuple[bool, ...]], dict[str, bool]] = {}
        self.no_params: list[NonfiniteParam] = []
        """The named parameters of a step that named none."""

    def flags(self, devices: tuple[str, ...], flags: tuple[bool, ...]) -> dict[str, bool]:
        """``{device: flag}``; one shared dict per distinct combination."""
        key = (devices, flags)
        out = self._flags.get(key)
        if out is None:
            out = dict(zip(devices, flags, strict=True))
            if len(self._flags) < _KEPT:
                self._flags[key] = out
        return out

    def optimizers(
        self, slots: tuple[OptimizerSlot, ...], found: list[bool], validate: bool
    ) -> list[OptimizerDetail]:
        """The record's ``optimizers``: one shared list per distinct (slots, flags)."""
        # Keyed by the slots' ids: hashing the slots themselves calls a dataclass's
        # __hash__ (Python) per slot. A capture hands the same slot objects every step.
        key = (*map(id, slots), *found)
        kept = None if validate else self._detail_lists.get(key)
        if kept is not None:
            return kept[1]
        details = [
            self._detail(slot, hit, validate) for slot, hit in zip(slots, found, strict=True)
        ]
        if not validate and len(self._detail_lists) < _KEPT:
            self._detail_lists[key] = (slots, details)
        return details

    def _detail(self, slot: OptimizerSlot, found: bool, validate: bool) -> OptimizerDetail:
        key = (slot, found)
        detail = None if validate else self._details.get(key)
        if detail is None:
            detail = build_model(
                OptimizerDetail,
                validate,
                {"index": slot.index, "name": slot.name, "found_inf": found, "fused": slot.fused},
            )
            if not validate:
                self._details[key] = detail
        return detail

    def named(self, counts: dict[str, int], validate: bool) -> list[NonfiniteParam]:
        """The ``k`` most counted of ``counts``, as a record names parameters."""
        return [
            build_model(NonfiniteParam, validate, {"name": n, "count": c})
            for n, c in top_k(counts, self._k)
        ]
