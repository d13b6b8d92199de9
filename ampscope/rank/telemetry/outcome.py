"""What an iteration did, from its decoded values: whose inf/NaN, applied or skipped, and
the scale's event.

A pure function of host values, called once per record by the record builder.
"""

from __future__ import annotations

from ampscope.rank.capture.layout import StepValues
from ampscope.reporter.schema import Policy, ScaleEvent


def outcome(
    decoded: StepValues,
    watch: bool,
    policy: Policy,
    told: bool | None,
    manual: bool,
    world_size: int,
) -> tuple[bool, bool | None, bool, bool, ScaleEvent]:
    """What the iteration did: ``(found_global, own, applied, skipped, event)``.

    * ``found_global``: an optimizer's found-inf was set (after the reduction: inf/NaN
      here or on another rank);
    * ``own``: this rank's own gradients held inf/NaN: its origin flags, or alone in its
      world its local ones; ``None`` when it cannot be told (no origin tracking);
    * ``applied``: a stepped optimizer found inf/NaN and the step ran anyway, as a watch
      under ``observe`` does. Where the front-end says what the library did (``told``:
      ``PendingStep.applied``, DeepSpeed), that decides instead of the policy, for a
      scaler too;
    * ``skipped``: a stepped optimizer found inf/NaN and the step did not run;
    * ``event``: what update() did to the scale. A watch has none (``none``); a scaler's
      step with inf/NaN backs off unless it was applied, when the scale alone says what
      happened.
    """
    found_global = True in decoded.optimizer_found
    if decoded.origin:
        own: bool | None = True in decoded.origin
    else:
        own = True in decoded.local if world_size == 1 else None
    stepped = decoded.stepped_on_nonfinite
    applied = (watch and policy == "observe" and stepped) if told is None else (told and stepped)
    skipped = stepped and not applied
    event: ScaleEvent
    if watch:
        event = "none"
    elif manual:
        event = "manual"
    elif found_global and not applied:
        event = "backoff"
    elif applied:
        # A scaler's step that ran on inf/NaN (DeepSpeed): the scale says what it did.
        before, after = decoded.scale_before, decoded.scale_after
        event = "backoff" if after < before else "growth" if after > before else "none"
    elif decoded.growth_tracker == 0:
        # Without found-inf, torch's update either grows the scale and resets the
        # tracker to 0 or increments the tracker: 0 here means it grew (even if a
        # clamp held it).
        event = "growth"
    else:
        event = "none"
    return found_global, own, applied, skipped, event
