"""The fault rule over scale histories as torch's GradScaler produces them."""

from __future__ import annotations

import pytest

from ampscope.reporter.fault_rule import (
    Call,
    FaultRule,
    FaultState,
    Iteration,
    after_rerun,
    device_offence,
)


class Scaler:
    """torch's GradScaler update() on the host: backoff 0.5, growth 2, ``interval``."""

    def __init__(self, scale: float, interval: int) -> None:
        self.scale, self.tracker, self.interval = scale, 0, interval

    def step(self, overflow: bool, **flags: bool) -> Iteration:
        before = self.scale
        grew = False
        if overflow:
            self.scale, self.tracker = before * 0.5, 0
        else:
            self.tracker += 1
            if self.tracker == self.interval:
                self.scale, self.tracker, grew = before * 2.0, 0, True
        return Iteration(
            scaler=True,
            nonfinite=overflow,
            own=flags.get("own", overflow),
            scale_before=before,
            scale_after=self.scale,
            growth_tracker=self.tracker,
            grew=grew,
            loss_nonfinite=flags.get("loss_nonfinite", False),
        )


def _fits(limit: float) -> object:
    """Overflow whenever the scale is above ``limit`` (gradients of a fixed size)."""
    return lambda scale: scale > limit


def test_warmup_from_any_init_scale_is_weather_then_the_settled_scale_is_clean() -> None:
    state, scaler = FaultState(), Scaler(2.0**40, interval=2000)
    calls = [state.observe(scaler.step(scaler.scale > 2.0**15)) for _ in range(60)]
    nonfinite = [c for c in calls if c is not None]
    assert len(nonfinite) == 25
    assert {(c.cls, c.kind) for c in nonfinite} == {("weather", "warmup")}
    assert state.clean_scale == 2.0**15
    assert state.edge == 2.0**16
    # Right below the edge, where the largest scale that fits lies: an overflow is weather.
    assert state.threshold() == (2.0**15, 2.0**15)
    assert not state.is_fault_scale(2.0**15)
    assert state.observe(scaler.step(True)) == Call("weather", "edge", True, 2.0**15)
    for _ in range(3):
        assert state.observe(scaler.step(False)) is None
    assert state.clean_scale == 2.0**14
    assert state.threshold() == (2.0**14, 2.0**15)
    assert state.is_fault_scale(2.0**14)
    # Lower than that, after it trained cleanly there, an overflow is a fault.
    call = state.observe(scaler.step(True))
    assert call == Call("fault", "overflow_at_clean_scale", True, 2.0**14)


def test_without_an_edge_an_overflow_at_the_clean_scale_is_a_fault() -> None:
    """A run whose scale never overflowed by itself (an fp32 model): a corruption after a
    few clean iterations is a fault."""
    state, scaler = FaultState(), Scaler(2.0**10, interval=2000)
    for _ in range(5):
        assert state.observe(scaler.step(False)) is None
    assert state.threshold() == (2.0**10, float("inf"))
    assert state.is_fault_scale(2.0**10)
    assert not state.is_fault_scale(2.0**11)
    call = state.observe(scaler.step(True, own=False))
    assert call == Call("fault", "overflow_at_clean_scale", False, 2.0**10)


def test_no_clean_scale_before_settle_steps() -> None:
    state, scaler = FaultState(), Scaler(2.0**10, interval=2000)
    for _ in range(FaultRule().settle_steps - 1):
        assert state.observe(scaler.step(False)) is None
    assert state.threshold() == (-1.0, float("inf"))
    assert not state.is_fault_scale(2.0**10)
    assert state.observe(scaler.step(True)) == Call("weather", "warmup", True, None)


def test_probing_upward_is_weather_and_so_is_the_edge_below_it() -> None:
    state, scaler = FaultState(FaultRule(settle_steps=3, probe_steps=50)), Scaler(8.0, 5)
    for _ in range(5):  # grows from 8 at the fifth clean step
        assert state.observe(scaler.step(False)) is None
    assert scaler.scale == 16.0
    assert state.clean_scale == 8.0
    for _ in range(4):  # clean at 16, fewer than probe_steps
        state.observe(scaler.step(False))
    assert state.observe(scaler.step(True)) == Call("weather", "probing", True, 8.0)
    assert (scaler.scale, state.edge) == (8.0, 16.0)
    assert state.observe(scaler.step(True)) == Call("weather", "edge", True, 8.0)
    for _ in range(3):
        state.observe(scaler.step(False))
    assert state.clean_scale == 4.0
    call = state.observe(scaler.step(True))
    assert call == Call("fault", "overflow_at_clean_scale", True, 4.0)


@pytest.mark.parametrize(("probe_steps", "clean"), [(2, 2.0), (4, 1.0)])
def test_a_probed_scale_becomes_clean_after_probe_steps(probe_steps: int, clean: float) -> None:
    state = FaultState(FaultRule(settle_steps=1, probe_steps=probe_steps))
    scaler = Scaler(1.0, 100)
    scaler.interval = 1
    state.observe(scaler.step(False))  # grows from 1 to 2
    scaler.interval = 100
    assert scaler.scale == 2.0
    assert state.clean_scale == 1.0
    for _ in range(2):
        state.observe(scaler.step(False))
    assert state.clean_scale == clean


def test_a_lower_confirmation_replaces_the_clean_scale() -> None:
    state, scaler = FaultState(FaultRule(settle_steps=2)), Scaler(64.0, 1000)
    state.observe(scaler.step(False))
    state.observe(scaler.step(False))
    assert state.clean_scale == 64.0
    assert state.observe(scaler.step(True)).cls == "fault"  # type: ignore[union-attr]
    state.observe(scaler.step(False))
    state.observe(scaler.step(False))
    assert state.clean_scale == 32.0
    assert state.edge is None  # a fault is no edge


def test_loss_watch_consequence_and_manual() -> None:
    state = FaultState()
    assert state.observe(Iteration(scaler=True, nonfinite=True, loss_nonfinite=True)) == Call(
        "fault", "nonfinite_loss", True, None
    )
    watch = Iteration(scaler=False, nonfinite=True, own=False)
    assert state.observe(watch) == Call("fault", "nonfinite_gradients", False, None)
    after = Iteration(scaler=False, nonfinite=True, own=True, after_applied=True)
    assert state.observe(after) == Call("consequence", "after_applied", True, None)
    assert state.observe(Iteration(scaler=False, nonfinite=False)) is None
    settled = FaultState(FaultRule(settle_steps=1))
    settled.observe(Iteration(scaler=True, nonfinite=False, growth_tracker=1, scale_before=4.0))
    assert settled.clean_scale == 4.0
    manual = Iteration(scaler=True, nonfinite=True, manual=True, scale_before=4.0)
    assert settled.observe(manual).kind == "warmup"  # type: ignore[union-attr]
    assert settled.clean_scale is None


def test_a_scalers_step_applied_on_inf_nan_is_a_fault_at_any_scale() -> None:
    """DeepSpeed fp16 that applied the step: no scale explains new weights, even in the
    warm-up where the same overflow, skipped, would be weather."""
    state = FaultState()
    skipped = Iteration(scaler=True, nonfinite=True, own=True, scale_before=2.0**16)
    assert state.observe(skipped).cls == "weather"  # type: ignore[union-attr]
    applied = Iteration(scaler=True, nonfinite=True, own=True, scale_before=2.0**15, applied=True)
    assert state.observe(applied) == Call("fault", "nonfinite_gradients", True, None)


def test_rerun_corrects_the_call_and_offences() -> None:
    weather = Call("weather", "probing", True, 8.0)
    assert after_rerun(weather, False, True, True) is weather
    assert after_rerun(None, True, False, True) == Call("fault", "transient", True, None)
    assert after_rerun(weather, True, True, True) == Call("fault", "reproducible", True, 8.0)
    # An overflow at a clean scale: no offence by its scale alone; a rerun decides.
    at_clean = Call("fault", "overflow_at_clean_scale", True, 8.0)
    assert not device_offence("fault", "overflow_at_clean_scale", True)
    assert after_rerun(at_clean, True, False, True) == Call("fault", "transient", True, 8.0)
    assert after_rerun(at_clean, True, True, True) == Call("weather", "edge", True, 8.0)
    assert device_offence("fault", "nonfinite_gradients", True)
    assert device_offence("fault", "transient", True)
    assert not device_offence("fault", "reproducible", True)
    assert not device_offence("fault", "nonfinite_loss", None)
    assert not device_offence("weather", "warmup", True)


def test_rule_validates() -> None:
    with pytest.raises(ValueError, match="settle_steps"):
        FaultRule(settle_steps=0)
    with pytest.raises(ValueError, match="edge_factor"):
        FaultRule(edge_factor=0.5)
