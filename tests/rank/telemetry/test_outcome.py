"""outcome(): applied, skipped and the scale's event, for every kind of front-end."""

from __future__ import annotations

import pytest

from ampscope.rank.capture import layout
from ampscope.rank.capture.layout import OptimizerSlot
from ampscope.rank.telemetry.outcome import outcome
from ampscope.reporter.schema import Policy

STEPPED = OptimizerSlot(index=0, name="AdamW", fused=False, stepped=True, num_flags=1)
UNSTEPPED = OptimizerSlot(index=1, name="SGD", fused=False, stepped=False, num_flags=1)


def _decoded(
    found: tuple[float, ...],
    before: float = 8.0,
    after: float = 8.0,
    tracker: float = 1.0,
    *,
    local: tuple[float, ...] = (),
    origin: tuple[float, ...] = (),
) -> layout.StepValues:
    """A step of two optimizers (the first stepped) and ``local``/``origin`` flags."""
    values = layout.head(before, (*found, *local)) + layout.tail(after, tracker, origin)
    local_devices = tuple(f"cuda:{i}" for i in range(len(local)))
    origin_devices = tuple(f"cuda:{i}" for i in range(len(origin)))
    return layout.decode(values, (STEPPED, UNSTEPPED), local_devices, origin_devices)


@pytest.mark.parametrize(
    ("found", "watch", "policy", "told", "expected"),
    [
        # A scaler skips a stepped optimizer's inf/NaN and backs off.
        ((1, 0), False, "skip", None, (True, False, True, "backoff")),
        # Found only by an optimizer that was not stepped: no skip, still a backoff.
        ((0, 1), False, "skip", None, (True, False, False, "backoff")),
        # A watch: no scale, so no event; observe applies, skip skips.
        ((1, 0), True, "observe", None, (True, True, False, "none")),
        ((1, 0), True, "skip", None, (True, False, True, "none")),
        # The front-end's word (DeepSpeed) decides over the policy, for a scaler too.
        ((1, 0), False, "skip", True, (True, True, False, "none")),
        ((1, 0), True, "observe", False, (True, False, True, "none")),
        # Clean: nothing applied on inf/NaN, nothing skipped, whatever was told.
        ((0, 0), True, "observe", True, (False, False, False, "none")),
    ],
)
def test_applied_skipped_and_event(
    found: tuple[float, float],
    watch: bool,
    policy: Policy,
    told: bool | None,
    expected: tuple[bool, bool, bool, str],
) -> None:
    found_global, own, applied, skipped, event = outcome(
        _decoded(found), watch, policy, told, False, 8
    )
    assert (found_global, applied, skipped, event) == expected
    assert own is None  # no origin flags in a world of 8: whose it was is unknown


@pytest.mark.parametrize(
    ("before", "after", "event"),
    [(8.0, 4.0, "backoff"), (8.0, 16.0, "growth"), (8.0, 8.0, "none")],
)
def test_an_applied_scaler_step_takes_its_event_from_the_scale(
    before: float, after: float, event: str
) -> None:
    decoded = _decoded((1, 0), before, after, tracker=0.0)
    assert outcome(decoded, False, "skip", True, False, 1)[4] == event


def test_a_clean_scaler_step_grew_when_the_tracker_is_back_at_zero() -> None:
    assert outcome(_decoded((0, 0), tracker=0.0), False, "skip", None, False, 1)[4] == "growth"
    assert outcome(_decoded((0, 0), tracker=3.0), False, "skip", None, False, 1)[4] == "none"
    # update(new_scale) is manual, whatever the flags.
    assert outcome(_decoded((1, 0), tracker=0.0), False, "skip", None, True, 1)[4] == "manual"


def test_own_needs_origin_flags_or_a_world_of_one() -> None:
    def own(decoded: layout.StepValues, world_size: int) -> bool | None:
        return outcome(decoded, False, "skip", None, False, world_size)[1]

    assert own(_decoded((1, 0), local=(1,), origin=(1,)), 8) is True
    assert own(_decoded((1, 0), local=(1,), origin=(0,)), 8) is False
    assert own(_decoded((1, 0), local=(1,)), 1) is True
    assert own(_decoded((0, 0), local=(0,)), 1) is False
    assert own(_decoded((1, 0), local=(1,)), 8) is None
