"""What an iteration did, from its decoded values: applied or skipped, and the scale's event.

Pure functions of host values, called once per record by the record builder.
"""

from __future__ import annotations

from ampscope.rank.capture.layout import StepValues
from ampscope.reporter.schema import Policy, ScaleEvent


def outcome(
    decoded: StepValues, watch: bool, policy: Policy, told: bool | None, manual: bool
) -> tuple[bool, bool, bool, ScaleEvent]:
    """What the iteration did: ``(found_global, applied, skipped, event)``.

    * ``found_global``: an optimizer's found-inf was set (after the reduction: inf/NaN
      here or on another rank);
    * ``applied``: a stepped optimizer found inf/NaN and the step ran anyway, as a watch
      under ``observe`` does. Where the front-end says what the library did (``told``:
      ``PendingStep.applied``, DeepSpeed), that decides instead of the policy, for a
      scaler too;
    * ``skipped``: a stepped optimizer found inf/NaN and the step did not run;
    * ``event``: what update() did to the scale. A watch has none (``none``); a scaler's
      step with inf/NaN backs off unless it was applied, when the scale alone says what
      happened.
    """
    stepped = decoded.stepped_on_nonfinite
    applied = (watch and policy == "observe" and stepped) if told is None else (told and stepped)
    skipped = stepped and not applied
    found_global = True in decoded.optimizer_found
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
    return found_global, applied, skipped, event


def own_nonfinite(origin: dict[str, bool], local: dict[str, bool], world_size: int) -> bool | None:
    """Whether this rank's own gradients held inf/NaN: its origin flags, or alone in its
    world its local ones; ``None`` when it cannot be told (no origin tracking)."""
    if origin:
        return any(origin.values())
    return any(local.values()) if world_size == 1 else None
