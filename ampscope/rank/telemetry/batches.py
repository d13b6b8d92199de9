"""The sample or batch ids of the iteration in progress (``note_batch``), and their check.

The training thread only appends references to Python objects (:meth:`BatchNotes.add`): no
tensor work, no validation, at most ``MAX_BATCH_IDS`` ids per iteration and a count of the
rest. The telemetry thread checks each id (:func:`batch_ids`) when it builds the record, so
an id the schema refuses is counted as left out instead of costing the record.
"""

from __future__ import annotations

import operator
import re
from typing import Any

from ampscope.reporter.schema import MAX_BATCH_ID_LENGTH, MAX_BATCH_IDS, MAX_COUNT, BatchIds

_PRINTABLE = re.compile(r"^[^\x00-\x1f\x7f]+$")  # the schema's BatchId string pattern


class BatchNotes:
    """The ids noted since the last update(). Used by the training thread only."""

    __slots__ = ("ids", "left_out")

    def __init__(self) -> None:
        self.ids: list[Any] = []
        self.left_out = 0

    def add(self, ids: Any) -> None:
        """Append ``ids`` (one id, a sequence of them, or a CPU tensor of integers).

        A tensor on an accelerator is not read (that would wait for the device): its
        elements are counted as left out.
        """
        if isinstance(ids, (int, str)):
            ids = (ids,)
        elif hasattr(ids, "device") and hasattr(ids, "tolist"):
            if ids.device.type != "cpu":
                self.left_out += int(ids.numel())
                return
            ids = ids.reshape(-1).tolist()
        elif not isinstance(ids, (list, tuple)):
            ids = list(ids)
        room = MAX_BATCH_IDS - len(self.ids)
        if len(ids) <= room:
            self.ids.extend(ids)
        else:
            self.ids.extend(ids[:room])
            self.left_out += len(ids) - room

    def restart_pass(self) -> tuple[list[Any], int]:
        """Before a rerun's second pass: take the first pass's ids, leaving none. Hand them
        to :meth:`end_pass` after the pass. O(1)."""
        taken = (self.ids, self.left_out)
        self.ids, self.left_out = [], 0
        return taken

    def end_pass(self, first: tuple[list[Any], int]) -> None:
        """After a rerun's second pass: its own ids when it noted any (a closure that draws
        its batch again), else the first pass's, which are the same batch's. O(1)."""
        if not self.ids and not self.left_out:
            self.ids, self.left_out = first

    def take(self) -> tuple[list[Any], int] | None:
        """The iteration's ids and left-out count, and a fresh start; ``None`` when nothing
        was noted."""
        if not self.ids and not self.left_out:
            return None
        taken = (self.ids, self.left_out)
        self.ids, self.left_out = [], 0
        return taken


def _checked(value: Any) -> int | str | None:
    if isinstance(value, str):
        if len(value) <= MAX_BATCH_ID_LENGTH and _PRINTABLE.fullmatch(value):
            return value
        return None
    if isinstance(value, bool):
        return None
    try:
        number = operator.index(value)  # int, numpy integers
    except TypeError:
        return None
    return number if -MAX_COUNT <= number <= MAX_COUNT else None


def batch_ids(taken: tuple[list[Any], int]) -> BatchIds:
    """The record's ``batch``: the valid ids of ``taken``, the others counted as left out.
    O(ids); telemetry thread."""
    ids, left_out = taken
    kept: list[int | str] = []
    for value in ids:
        checked = _checked(value)
        if checked is None:
            left_out += 1
        else:
            kept.append(checked)
    return BatchIds.model_construct(ids=kept, left_out=min(left_out, MAX_COUNT))
