"""The fault rule, defined once: whether a non-finite iteration is a fault or the loss
scaler's weather.

A loss scaler overflows by design: it starts high (``init_scale``) and backs off until the
gradients fit, and every ``growth_interval`` clean iterations it doubles the scale to probe
whether a larger one fits. Those overflows are **weather**: skipping the step and halving
the scale is the scaler doing its job. A **fault** is an iteration whose inf/NaN no scale
explains:

- ``nonfinite_loss``: the loss itself is inf/NaN (any mode);
- ``nonfinite_gradients``: inf/NaN gradients without a loss scaler (a ``GradWatch`` on a
  bf16/fp32 run: nothing there overflows by design), or ones a scaler's step was applied
  on (a DeepSpeed fp16 engine that did not skip them: no scale explains new weights);
- ``overflow_at_clean_scale``: a scaler's overflow at or below its *clean scale*, the newest
  scale at which it recently trained cleanly (below), and below its *edge*. The scale alone
  cannot tell a device's one-time inf from gradients that outgrew the scale, so this kind is
  no device offence and no suspect batch by itself: it is what a rerun closure reruns; a
  clean rerun makes it ``transient`` (the device's), a reproduced overflow with a finite
  loss makes it weather (``edge``: the gradients outgrew the scale);
- ``transient``: a rerun from the same batch (``rerun=closure``) did not reproduce the
  rank's inf/NaN: the device made it;
- ``reproducible``: a rerun reproduced the rank's fault: the data (or the numerics) made it.

An iteration that is non-finite only because an earlier non-finite update was applied
(a watch under policy ``observe``: the weights hold inf/NaN from then on) is a
**consequence**: the origin iteration is the fault, not the ones after it.

The clean scale follows the scaler's own state, the scale and the growth tracker (torch's
count of consecutive clean iterations at the current scale): a scale becomes clean after
``settle_steps`` clean iterations in a row at it when the scaler reached it by backing off
(or started at it), after ``probe_steps`` when it reached it by growing (probing upward),
and at once when the scaler grows from it (``growth_interval`` clean iterations). A later
confirmation replaces it, lower or higher, so the clean scale is always the recent one.

The *edge* is the scale at which the scaler last overflowed warming up or probing: the
largest scale that fits lies just below it, and the gradients' largest values move from
one batch to the next (dropout, the data), so an overflow within ``edge_factor`` below the
edge (one backoff, by default) is weather too, however long the scale trained cleanly.
Only an overflow lower than that is a fault: the gradients grew past what the scaler had
measured, or something made them inf/NaN whatever the scale. The price: a one-time fault
of a run that sits at its edge scale is called weather; with no overflow of warm-up or
probing yet (an fp32 model, a modest ``init_scale``), every overflow at or below the clean
scale is a fault.
Examples (the defaults: ``settle_steps`` 3, ``probe_steps`` 100):

- ``init_scale`` 2**40, the gradients fit at 2**15: the 25 backoffs of the warm-up are
  weather (no clean scale yet); after 3 clean iterations at 2**15 the clean scale is 2**15.
- Growth from 2**15 to 2**16 and an overflow at 2**16 within 100 iterations: weather
  (probing; the edge is 2**16); back at 2**15, an overflow there: weather (the edge);
  at 2**14 after 3 clean iterations, an overflow: a fault.
- ``init_scale`` 2**10 on a run that never overflows by itself, an inf in one rank's
  gradients after 5 clean iterations: ``overflow_at_clean_scale``, rerun with a closure; the
  rerun clean, a ``transient`` fault, and the rank whose own gradients held it (origin
  tracking) is its device's offender.
- A warm-up that trains once at 2**18 and overflows there on the next iteration: weather
  (2**18 was never clean three times in a row).

Both sides import it: a rank's telemetry thread decides each iteration from the whole history
of its own scale and writes the decision into the record (``StepRecord.nonfinite``), the
training thread compares its scale with :meth:`FaultState.threshold` on the device to rerun
faults only, and the exporter's consumers (device offences, suspect batches, reruns,
``scale_collapse``) read the record's decision instead of deriving their own. Only the
standard library is imported; :meth:`FaultState.observe` is O(1) and keeps no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

NonfiniteClass = Literal["weather", "fault", "consequence"]
"""What a non-finite iteration is: the scaler's dynamics, a fault, or the consequence of an
earlier non-finite update that was applied."""

FaultKind = Literal[
    "nonfinite_loss", "nonfinite_gradients", "overflow_at_clean_scale", "transient", "reproducible"
]
"""Why an iteration is a fault (see the module)."""

WeatherKind = Literal["warmup", "probing", "edge"]
"""Why an overflow is weather: no clean scale yet (``warmup``), above the clean scale
(``probing``), or within ``edge_factor`` below the scale at which the scaler last overflowed
warming up or probing (``edge``: the highest scale that fits sits right there)."""

ConsequenceKind = Literal["after_applied"]

CallKind = Literal[
    "nonfinite_loss",
    "nonfinite_gradients",
    "overflow_at_clean_scale",
    "transient",
    "reproducible",
    "warmup",
    "probing",
    "edge",
    "after_applied",
]
"""Every reason a :class:`Call` gives, of the three classes together."""

FAULT_KINDS: tuple[FaultKind, ...] = get_args(FaultKind)
DEVICE_FAULT_KINDS: frozenset[str] = frozenset({"nonfinite_loss", "nonfinite_gradients"})
"""Fault kinds that point at the rank that held them, before any rerun tells the device
(``transient``) from the data (``reproducible``): the rank's device offences
(``nonfinite_origin``) and its suspect batches count these. Not ``overflow_at_clean_scale``:
a scale alone cannot tell a device's one-time inf from gradients that outgrew a scale that
trained cleanly (healthy runs do both), so only a rerun pins it (a clean rerun:
``transient``, the device's; a reproduced overflow: the scaler's weather)."""


@dataclass(frozen=True, kw_only=True)
class FaultRule:
    """When a scale counts as clean (see the module)."""

    settle_steps: int = 3
    """Clean iterations in a row at a scale the scaler backed off to (or started at)
    before an overflow at or below it is a fault. More than one: a warm-up often trains
    one iteration cleanly at a scale and overflows at it on the next."""
    probe_steps: int = 100
    """Clean iterations in a row at a scale the scaler grew to (probing upward) before an
    overflow at or below it is a fault; growing again from it confirms it at once."""
    edge_factor: float = 2.0
    """An overflow at a scale at least the edge divided by this is weather (2: one of
    torch's backoffs below the edge)."""

    def __post_init__(self) -> None:
        if not (self.edge_factor >= 1 and math.isfinite(self.edge_factor)):
            raise ValueError(f"edge_factor must be a finite number >= 1, not {self.edge_factor}")
        if self.settle_steps < 1 or self.probe_steps < 1:
            raise ValueError(
                f"settle_steps and probe_steps must be >= 1, not {self.settle_steps}, "
                f"{self.probe_steps}"
            )


@dataclass(kw_only=True, slots=True)
class Iteration:
    """What the rule reads of one iteration: the scaler's own state and the flags the
    rank already holds on the host when its record is built.

    Read-only by convention (``dataclasses.replace`` makes a changed copy); not frozen,
    because a frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__``, which made building one cost more than deciding it, once per
    record on the telemetry thread."""

    scaler: bool
    """An fp16 loss scaler (else a watch: no scale)."""
    nonfinite: bool
    """Some gradients held inf/NaN: found-inf after the reduction, or this rank's own."""
    loss_nonfinite: bool = False
    """This rank's loss (what ``scale()`` saw) was inf/NaN."""
    own: bool | None = None
    """This rank's own gradients held inf/NaN before the reduction; ``None``: not tracked."""
    scale_before: float = 1.0
    scale_after: float = 1.0
    growth_tracker: int = 0
    """torch's growth tracker after ``update()``: clean iterations in a row at the scale."""
    grew: bool = False
    """``update()`` grew the scale (its event ``growth``)."""
    manual: bool = False
    """``update(new_scale)`` set the scale by hand: the scaler starts settling afresh."""
    after_applied: bool = False
    """An earlier iteration's update ran on inf/NaN gradients (policy ``observe``)."""
    applied: bool = False
    """This iteration's update ran on its inf/NaN gradients (a watch under ``observe``, or
    a DeepSpeed fp16 engine that applied them): a fault whatever the scale."""


@dataclass(frozen=True)
class Call:
    """The rule's decision about one non-finite iteration."""

    cls: NonfiniteClass
    kind: CallKind
    own: bool | None
    """This rank's own loss or gradients held inf/NaN (the rank offends at a fault);
    ``None``: origin not tracked, so the rank cannot be told from the others."""
    clean_scale: float | None
    """The clean scale the iteration was judged against; ``None``: none yet."""


class FaultState:
    """One rank's rule state, fed its iterations in step order. Not thread-safe: one owner
    (the telemetry thread) feeds it; :meth:`threshold` is a plain float read."""

    def __init__(self, rule: FaultRule | None = None) -> None:
        self.rule = rule or FaultRule()
        self.clean_scale: float | None = None
        """The newest clean scale (see the module); ``None`` before the first."""
        self.edge: float | None = None
        """The scale at which the scaler last overflowed warming up or probing."""
        self._grown_to: float | None = None
        """The scale the scaler last grew to, while it holds it."""

    def threshold(self) -> tuple[float, float]:
        """Where an overflow is a fault now: at a scale at or below the first value (the
        clean scale; ``-1.0`` while there is none) and strictly below the second (the edge
        divided by ``edge_factor``; ``inf`` without an edge). Host floats for the training
        thread's comparison on the device; both are the scaler's own values (powers of two
        for torch's defaults), so a float32 scale compares with them exactly."""
        clean = -1.0 if self.clean_scale is None else self.clean_scale
        edge = math.inf if self.edge is None else self.edge / self.rule.edge_factor
        return clean, edge

    def is_fault_scale(self, scale: float) -> bool:
        """Whether an overflow at ``scale`` would be a fault now (:meth:`threshold`)."""
        clean, edge = self.threshold()
        return scale <= clean and scale < edge

    def observe(self, it: Iteration) -> Call | None:
        """Decide ``it`` (``None`` for a clean iteration), then let it move the clean scale.
        O(1)."""
        call = self._decide(it) if it.nonfinite or it.loss_nonfinite else None
        if it.scaler:
            self._advance(it)
        return call

    def _decide(self, it: Iteration) -> Call:
        own = True if it.loss_nonfinite else it.own
        clean = self.clean_scale
        if it.after_applied:
            return Call("consequence", "after_applied", own, clean)
        if it.loss_nonfinite:
            return Call("fault", "nonfinite_loss", own, clean)
        if not it.scaler or it.applied:
            return Call("fault", "nonfinite_gradients", own, clean)
        if clean is None or it.manual:
            self.edge = it.scale_before
            return Call("weather", "warmup", own, clean)
        if it.scale_before > clean:
            self.edge = it.scale_before
            return Call("weather", "probing", own, clean)
        if not self.is_fault_scale(it.scale_before):  # at or above the edge's band
            return Call("weather", "edge", own, clean)
        return Call("fault", "overflow_at_clean_scale", own, clean)

    def _advance(self, it: Iteration) -> None:
        if it.manual:
            self.clean_scale, self._grown_to, self.edge = None, None, None
            return
        if it.nonfinite:
            self._grown_to = None  # backed off: the next scale is a settling one
            return
        scale = it.scale_before
        if it.grew:
            if math.isfinite(scale):
                self.clean_scale = scale  # a whole growth interval ran clean at it
            self._grown_to = it.scale_after
            return
        probing = self._grown_to is not None and scale == self._grown_to
        need = self.rule.probe_steps if probing else self.rule.settle_steps
        if it.growth_tracker >= need and math.isfinite(scale):
            self.clean_scale = scale
            self._grown_to = None


def device_offence(cls: str, kind: str, own: bool | None) -> bool:
    """Whether a decision is an offence of the rank's device: a fault whose inf/NaN was the
    rank's own, of a kind that points at it (:data:`DEVICE_FAULT_KINDS`) or a rerun that did
    not reproduce it (``transient``); never a reproduced one (the data's)."""
    return cls == "fault" and own is True and (kind in DEVICE_FAULT_KINDS or kind == "transient")


def after_rerun(
    call: Call | None,
    flagged: bool,
    reproduced: bool,
    first_nonfinite: bool,
    nonfinite: bool = True,
) -> Call | None:
    """The decision about a rerun iteration whose record keeps the second pass: the rule's
    ``call`` about that pass, corrected by what the rerun found on this rank. A flagged
    result the rerun did not reproduce is a ``transient`` fault (the device's); a non-finite
    result it reproduced is ``reproducible`` (the data's); a spike rerun (``nonfinite``
    false: no rank's inf/NaN flagged it) stays as ``call``."""
    if not flagged or not nonfinite:
        return call
    clean = None if call is None else call.clean_scale
    if not reproduced:
        return Call("fault", "transient", True, clean)
    if call is not None and call.kind == "overflow_at_clean_scale":
        # Reproduced with a finite loss: the gradients outgrew the scale, the scaler's job.
        return Call("weather", "edge", call.own, clean)
    if first_nonfinite:
        return Call("fault", "reproducible", True, clean)
    return call
