"""The exporter's batch ledger: which sample or batch ids lay behind each flagged step.

Per run, ``BatchLedger`` keeps each rank's ids of its most recent ``RECENT_STEPS`` steps
(those an origin outlier can still be found at, see ``spike_windows.ORIGIN_STEPS``), and
every flagged (step, rank) with its reasons and ids, at most ``MAX_SUSPECTS`` per run
(the oldest dropped first, counted). A step is flagged on a rank when:

- ``nonfinite_origin``: the fault rule (``ampscope.reporter.fault_rule``) called the step a
  fault of the rank's own loss or gradients (the loss scaler's weather is never flagged);
- ``skipped_step``: a fault's step was skipped and origin tracking is off on the rank, so
  any rank's batch may be the cause;
- ``nonfinite_update_applied``: the rank's first optimizer step on inf/NaN gradients;
- ``reproducible_fault``, ``transient_fault``: the step was rerun and the rank's own
  flagged result was, or was not, reproduced;
- ``loss_spike``, ``grad_norm_spike``, ``origin_outlier``: the exporter's spike rules.

Not thread-safe: the store calls it under its lock. Every method is O(1) unless noted.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from ampscope.exporter.state.spike_windows import ORIGIN_STEPS
from ampscope.reporter.fault_rule import DEVICE_FAULT_KINDS
from ampscope.reporter.schema import BatchIds, StepRecord

RECENT_STEPS = ORIGIN_STEPS
"""Steps of each rank whose ids are kept whether flagged or not."""

MAX_SUSPECTS = 1024
"""Flagged (step, rank) pairs one run keeps; older ones are dropped (and counted)."""

SPIKE_REASONS = {"loss": "loss_spike", "grad_norm": "grad_norm_spike"}
"""Spike kinds (``SpikeEvent.kind``) and the reason (verdict) each stands for."""

_NO_IDS = BatchIds(ids=[])


@dataclass
class Suspect:
    """One flagged step of one rank."""

    step: int
    rank: int
    reasons: list[str] = field(default_factory=list)
    """Verdict names, in the order found."""
    batch: BatchIds = _NO_IDS
    """The ids the rank noted for the step; none when it noted none (``note_batch``) or
    the record arrived after the exporter had dropped its step from ``RECENT_STEPS``."""

    def to_json(self) -> dict[str, object]:
        return {
            "step": self.step,
            "rank": self.rank,
            "reasons": list(self.reasons),
            "batch_ids": list(self.batch.ids),
            "batch_ids_left_out": self.batch.left_out,
        }


def record_reasons(record: StepRecord) -> list[str]:
    """The reasons a record flags its own step for, without the spike rules.

    Where the record carries the fault rule's decision (``record.nonfinite``), only a fault
    flags the step: the loss scaler's weather and the consequences of an earlier applied
    update do not. Records of reporters that predate the rule flag every inf/NaN step.
    """
    reasons = []
    call = record.nonfinite
    if call is not None or record.totals.faults is not None:
        # A rerun's fault (transient, reproducible) is flagged by the rerun's reason below.
        fault = call is not None and call.kind == "fault" and call.reason in DEVICE_FAULT_KINDS
        if fault and call is not None and call.own:
            reasons.append("nonfinite_origin")
        if fault and call is not None and call.own is None and record.skipped:
            reasons.append("skipped_step")
    else:
        if any(record.found_inf_origin.values()):
            reasons.append("nonfinite_origin")
        if record.skipped and not record.found_inf_origin:
            reasons.append("skipped_step")
    first = record.totals.first_nonfinite_applied
    if first is not None and first.step == record.step:
        reasons.append("nonfinite_update_applied")
    rerun = record.rerun
    if rerun is not None and rerun.flagged:
        reasons.append("reproducible_fault" if rerun.reproduced else "transient_fault")
    return reasons


class BatchLedger:
    """One run's batch ids: recent ones per rank, and those of every flagged step."""

    def __init__(self, recent_steps: int = RECENT_STEPS, max_suspects: int = MAX_SUSPECTS) -> None:
        self._recent_steps = recent_steps
        self._max_suspects = max_suspects
        self._recent: dict[int, dict[int, BatchIds]] = {}
        self._order: dict[int, deque[int]] = {}
        self._suspects: OrderedDict[tuple[int, int], Suspect] = OrderedDict()
        self.dropped = 0
        """Suspects dropped past ``max_suspects``."""

    def observe(self, rank: int, record: StepRecord) -> None:
        """Keep the record's ids among the rank's recent ones, and flag its step for the
        reasons the record itself gives."""
        if record.batch is not None:
            recent = self._recent.setdefault(rank, {})
            order = self._order.setdefault(rank, deque())
            if record.step not in recent:
                order.append(record.step)
            recent[record.step] = record.batch
            while len(order) > self._recent_steps:
                recent.pop(order.popleft(), None)
        for reason in record_reasons(record):
            self.flag(rank, record.step, reason, record.batch)

    def flag(self, rank: int, step: int, reason: str, batch: BatchIds | None = None) -> None:
        """Flag ``step`` on ``rank`` for ``reason``; the ids from ``batch`` or the rank's
        recent ones."""
        if batch is None:
            batch = self._recent.get(rank, {}).get(step)
        key = (step, rank)
        suspect = self._suspects.get(key)
        if suspect is None:
            suspect = self._suspects[key] = Suspect(step=step, rank=rank)
            if len(self._suspects) > self._max_suspects:
                self._suspects.popitem(last=False)
                self.dropped += 1
        if reason not in suspect.reasons:
            suspect.reasons.append(reason)
        if batch is not None and not suspect.batch.ids:
            suspect.batch = batch

    def forget(self, rank: int) -> None:
        """The rank's process restarted: its step numbers start over, so its recent ids no
        longer match them. Its suspects stay (each names the ids it had)."""
        self._recent.pop(rank, None)
        self._order.pop(rank, None)

    def ids_at(self, rank: int, step: int) -> BatchIds | None:
        """The rank's ids for ``step``: a suspect's, else a recent step's; ``None`` if
        unknown."""
        suspect = self._suspects.get((step, rank))
        if suspect is not None and suspect.batch.ids:
            return suspect.batch
        return self._recent.get(rank, {}).get(step)

    def suspects(self) -> list[Suspect]:
        """Every flagged (step, rank), sorted by step then rank. O(n log n)."""
        return sorted(self._suspects.values(), key=lambda s: (s.step, s.rank))
