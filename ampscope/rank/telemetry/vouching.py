"""The record builder's stand-in for strict validation: cheap checks, and models built on
their word.

Validating a record with pydantic costs about as much as everything else the telemetry
thread does for it, and on clean iterations nearly everything it would look at is what it
passed the previous time. :class:`RecordChecks` checks the few values that vary (the step,
its time, the scales, the tracker, the parameter names' counts) and each label or
parameter name once; what they vouch for, :func:`build_model` builds without validating
again. Anything they cannot vouch for goes through strict validation instead
(``validate=True``), which raises exactly as pydantic does; the exporter validates every
record strictly either way.
"""

from __future__ import annotations

import math
import re
from typing import Any, TypeVar

from pydantic import BaseModel

from ampscope.rank.capture.pending import PendingStep
from ampscope.rank.config import LABEL_PATTERN
from ampscope.reporter.schema import (
    MAX_DEVICES,
    MAX_LABEL_LENGTH,
    MAX_NONFINITE_PARAMS,
    MAX_OPTIMIZERS,
    MAX_PARAM_NAME_LENGTH,
)

_Model = TypeVar("_Model", bound=BaseModel)

PARAM_NAME = re.compile(r'^[^\s"\\]+$')
"""The schema's ParamName pattern (see ampscope.reporter.schema)."""


class Vouched:
    """Strings known to pass one of the schema's string checks (a length and a pattern),
    each checked once."""

    __slots__ = ("_max_length", "_passed", "_pattern")

    def __init__(self, pattern: re.Pattern[str], max_length: int) -> None:
        self._pattern = pattern
        self._max_length = max_length
        self._passed: set[str] = set()

    def __call__(self, value: str) -> bool:
        if value in self._passed:
            return True
        if type(value) is str and len(value) <= self._max_length and self._pattern.match(value):
            self._passed.add(value)
            return True
        return False


class RecordChecks:
    """Whether strict validation would pass a step's record, told cheaply.

    Args:
        k: How many parameters a record and the totals name at most.
    """

    def __init__(self, k: int) -> None:
        self._k = k
        self._label = Vouched(LABEL_PATTERN, MAX_LABEL_LENGTH)
        self._param_name = Vouched(PARAM_NAME, MAX_PARAM_NAME_LENGTH)
        self._vouched_shape: tuple[Any, ...] | None = None
        """The newest (optimizers, local devices, origin devices) that passed the checks."""

    def vouch(
        self,
        pending: PendingStep,
        scale_before: float,
        scale_after: float,
        tracker: int,
        local_counts: dict[str, int],
        origin_counts: dict[str, int],
    ) -> bool:
        """Whether every value that strict validation would look at is known to pass: the
        step's own (its decoded scales and growth tracker among them), and the sizes of
        the totals' per-device counts that include it."""
        return (
            pending.step >= 1
            and 0.0 <= pending.time < math.inf
            and 0.0 <= scale_before < math.inf  # a scale: False for NaN too
            and 0.0 <= scale_after < math.inf
            and tracker >= 0
            and (
                (pending.optimizers, pending.local_devices, pending.origin_devices)
                == self._vouched_shape
                or self._shape_checked(pending)
            )
            and (
                not pending.nonfinite
                or all(
                    self._param_name(name) and type(count) is int and count >= 0
                    for name, count in pending.nonfinite.items()
                )
            )
            and len(local_counts) <= MAX_DEVICES
            and len(origin_counts) <= MAX_DEVICES
        )

    def _shape_checked(self, pending: PendingStep) -> bool:
        """Whether the step's optimizers and device names pass the schema's checks; a shape
        that passed is kept, and :meth:`vouch` compares each step's with it (tuples of the
        same objects, whatever the number of parameters) before calling this."""
        shape = (pending.optimizers, pending.local_devices, pending.origin_devices)
        passed = (
            len(pending.local_devices) <= MAX_DEVICES
            and len(pending.origin_devices) <= MAX_DEVICES
            and len(pending.optimizers) <= MAX_OPTIMIZERS
            and self._k <= MAX_NONFINITE_PARAMS
            and all(self._label(d) for d in pending.local_devices)
            and all(self._label(d) for d in pending.origin_devices)
            and all(self._label(slot.name) for slot in pending.optimizers)
        )
        if passed:
            self._vouched_shape = shape
        return passed


_set = object.__setattr__
"""Sets a frozen model's instance state as pydantic stores it (bypassing its __setattr__)."""
_FIELD_NAMES: dict[type[BaseModel], set[str]] = {}
"""Per schema model: the set of its field names, shared as ``model_fields_set`` by every
instance :func:`build_model` gives all fields (every call in the record builder does)."""


def build_model(cls: type[_Model], validate: bool, fields: dict[str, Any]) -> _Model:
    """A ``cls`` of ``fields`` (every field, by name; the dict becomes the model's own):
    strictly validated when ``validate``, else as vouched for by :class:`RecordChecks`. A
    dict display at the call, not keywords: one dict, built in one step."""
    if validate:
        return cls(**fields)
    # The values were vouched for; what strict validation would do on top is only to copy
    # them. Frozen models: set the instance state as pydantic stores it.
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = set(cls.model_fields)
    # One set per model class instead of one per instance (a container less per model
    # for the garbage collector to track): frozen models never change theirs, and
    # pydantic copies it before any change (model_copy). Every call passes every field by
    # its name (the strict-validation tests compare each record's fields), so the count
    # tells a full set.
    fields_set = names if len(fields) == len(names) else set(fields)
    model = cls.__new__(cls)
    _set(model, "__dict__", fields)
    _set(model, "__pydantic_fields_set__", fields_set)
    _set(model, "__pydantic_extra__", None)
    _set(model, "__pydantic_private__", None)
    return model
