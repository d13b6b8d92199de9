"""The reruns of one rank: how many of its own flagged results each rerun reproduced, and
the newest of them, for ``ampscope_reruns_total``, the ``transient_fault`` and
``reproducible_fault`` verdicts and the device offences (``ampscope_device_offences_total``).

A rank counts a rerun only where its own result was flagged (``rerun.flagged``): the other
ranks reran the iteration to keep the collectives paired, and no verdict is about them. A
loss scaler's overflow that the rerun reproduced is the scaler's weather (the fault rule's
``edge``), no result either.

For the device: a transient result is an offence of the rank's device (``transient_fault``);
a reproduced one is the data's, so its origin detections (the record keeps the second pass,
whose own gradients held inf/NaN again) are counted in ``data_origins``, which the
``nonfinite_origin`` offences leave out.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

from ampscope.reporter.fault_rule import device_offence
from ampscope.reporter.schema import StepRecord

RerunResult = Literal["transient", "reproducible"]
"""``transient``: the rerun did not reproduce the rank's result (suspect its device);
``reproducible``: it did (the data or the numerics)."""

RERUN_RESULTS: tuple[RerunResult, ...] = get_args(RerunResult)

MAX_RECENT_RERUNS = 16
"""Reruns kept per rank for the verdicts' evidence (the counters count every one)."""


@dataclass(frozen=True, kw_only=True)
class RerunEvent:
    """One rerun of one rank whose own result was flagged."""

    result: RerunResult
    step: int
    received: float
    """Exporter clock when it arrived: what the verdicts' window counts from."""
    first_loss: float | None
    second_loss: float | None
    first_norm: float | None
    second_norm: float | None


class RerunCounts(NamedTuple):
    """Flagged reruns of one rank since the exporter first heard its current process."""

    transient: int = 0
    reproducible: int = 0


NO_RERUNS = RerunCounts()


class RankReruns:
    """A rank's rerun counters and recent reruns; fed the rank's newest records in step
    order (the store's lock held). O(1) per record."""

    def __init__(self) -> None:
        self.counts = NO_RERUNS
        self.recent: deque[RerunEvent] = deque(maxlen=MAX_RECENT_RERUNS)
        self.data_origins = 0
        """Origin detections (devices whose own gradients held inf/NaN, summed over steps)
        of steps whose rerun reproduced the rank's flagged result: the data's, not the
        device's."""

    def observe(self, record: StepRecord, now: float) -> None:
        rerun = record.rerun
        if rerun is None or not rerun.flagged:
            return
        call = record.nonfinite
        if rerun.reproduced and call is not None and call.kind == "weather":
            # A loss scaler's overflow the rerun reproduced (the fault rule's ``edge``): the
            # gradients outgrew a scale that trained cleanly, the scaler's job; no result.
            return
        result: RerunResult = "reproducible" if rerun.reproduced else "transient"
        self.counts = self.counts._replace(**{result: getattr(self.counts, result) + 1})
        if rerun.reproduced:
            self.data_origins += sum(record.found_inf_origin.values())
        self.recent.append(
            RerunEvent(
                result=result,
                step=record.step,
                received=now,
                first_loss=rerun.first.loss,
                second_loss=rerun.second.loss,
                first_norm=rerun.first.norm,
                second_norm=rerun.second.norm,
            )
        )

    def reset(self) -> None:
        """A new process of the rank: its counters start from zero."""
        self.counts = NO_RERUNS
        self.recent.clear()
        self.data_origins = 0


def device_offended(record: StepRecord) -> bool:
    """Whether ``record``'s step is an offence of its rank's device as the record alone
    tells: the fault rule called it a fault of the rank's own that no rerun reproduced
    (``fault_rule.device_offence``). A record of a reporter that predates the rule: its own
    gradients held inf/NaN (origin tracking) and no rerun reproduced that, or its flagged
    result was not reproduced by the rerun (a transient fault)."""
    call = record.nonfinite
    if call is not None:
        return device_offence(call.kind, call.reason, call.own)
    if record.totals.faults is not None:
        return False  # the fault rule saw no inf/NaN (or a spike rerun reproduced)
    rerun = record.rerun
    if rerun is not None and rerun.flagged:
        return not rerun.reproduced
    return any(record.found_inf_origin.values())
