"""A rank's running totals: :class:`RunningTotals`, and how one step moves them.

The record builder works out a step's totals from the previous ones without touching them
(the counts per device and per parameter with :func:`add_flags` and :func:`add_counts`),
puts them in the step's record, and only once the record exists makes them the running
totals (:meth:`RunningTotals.take`): a step whose record strict validation rejects leaves
the totals as they were.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ampscope.reporter.schema import (
    AlignedScale,
    NonfiniteApplied,
    NonfiniteParam,
    WeatherTotals,
)

NO_WEATHER = WeatherTotals(skipped_steps=0, found_inf_local={}, found_inf_origin={})
"""A rank's weather before its first weather iteration."""


@dataclass
class RunningTotals:
    """Cumulative counters of one rank, as the records' ``totals`` carry them.

    The dicts are replaced, never changed in place, once a record holds them.
    """

    steps: int = 0
    skipped_steps: int = 0
    backoffs: int = 0
    growths: int = 0
    found_inf_local: dict[str, int] = field(default_factory=dict)
    found_inf_origin: dict[str, int] = field(default_factory=dict)
    nonfinite: dict[str, int] = field(default_factory=dict)
    min_scale: float | None = None
    max_scale: float | None = None
    last_growth_tracker: int | None = None
    aligned_scale: AlignedScale | None = None
    nonfinite_applied: int = 0
    first_nonfinite_applied: NonfiniteApplied | None = None
    faults: dict[str, int] = field(default_factory=dict)
    """The rank's own faults by kind (the fault rule's ``faults``)."""
    weather: WeatherTotals = field(default_factory=lambda: NO_WEATHER)
    """What of the counters the fault rule called the scaler's weather; replaced, never
    changed, on a weather iteration only (rare after the warm-up)."""
    top: list[NonfiniteParam] = field(default_factory=list, repr=False)
    """The ``k`` most counted of ``nonfinite``, as the newest record names them: the next
    record shares the list while no count moved."""

    def take(self, moved: tuple[Any, ...]) -> None:
        """Become the totals of a record that exists: ``moved`` holds every field's new
        value, in the fields' order (as :func:`dataclasses.astuple` would give them)."""
        (
            self.steps,
            self.skipped_steps,
            self.backoffs,
            self.growths,
            self.found_inf_local,
            self.found_inf_origin,
            self.nonfinite,
            self.min_scale,
            self.max_scale,
            self.last_growth_tracker,
            self.aligned_scale,
            self.nonfinite_applied,
            self.first_nonfinite_applied,
            self.faults,
            self.weather,
            self.top,
        ) = moved


def add_flags(counter: dict[str, int], flags: dict[str, bool]) -> dict[str, int]:
    """Per-device counts: ``counter`` plus one per true flag; the same dict when nothing
    changes (every flag false, every device already counted), else a new one."""
    for device, flag in flags.items():
        if flag is not False or device not in counter:
            break
    else:
        return counter
    out = dict(counter)
    for device, found in flags.items():
        out[device] = out.get(device, 0) + int(found)
    return out


def add_counts(counter: dict[str, int], counts: Mapping[str, int]) -> dict[str, int]:
    """Per-parameter counts: a new dict, ``counter`` plus ``counts``."""
    out = dict(counter)
    for name, count in counts.items():
        out[name] = out.get(name, 0) + count
    return out
