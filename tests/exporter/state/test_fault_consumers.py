"""The exporter's consumers read the fault rule's decision from the record: device offences,
suspect batches and the scale ``scale_collapse`` measures from; records that predate the
rule are judged as before."""

from __future__ import annotations

from ampscope.exporter.state.batches import record_reasons
from ampscope.exporter.state.ranks import collapse_reference
from ampscope.exporter.state.reruns import device_offended
from ampscope.reporter.schema import NonfiniteCall
from exporter.factory import record, totals


def _with_rule(step: int, call: NonfiniteCall | None, clean: float | None = None, **kw: object):
    base = totals(step, skipped=int(call is not None))
    return record(
        step,
        skipped=call is not None,
        origin=call is not None and bool(call.own),
        total=base.model_copy(update={"faults": {}, "clean_scale": clean}),
        nonfinite=call,
        **kw,
    )


def test_weather_is_no_offence_and_no_suspect() -> None:
    for reason in ("warmup", "probing", "edge"):
        weather = _with_rule(
            3, NonfiniteCall(kind="weather", reason=reason, own=True, clean_scale=None)
        )
        assert not device_offended(weather)
        assert record_reasons(weather) == []
    later = NonfiniteCall(kind="consequence", reason="after_applied", own=True, clean_scale=None)
    assert not device_offended(_with_rule(4, later))
    assert record_reasons(_with_rule(4, later)) == []


def test_a_fault_of_the_rank_s_own_is_an_offence_and_a_suspect() -> None:
    own = NonfiniteCall(kind="fault", reason="nonfinite_gradients", own=True, clean_scale=None)
    assert device_offended(_with_rule(5, own))
    assert record_reasons(_with_rule(5, own)) == ["nonfinite_origin"]
    peer = own.model_copy(update={"own": False})
    assert not device_offended(_with_rule(5, peer))
    assert record_reasons(_with_rule(5, peer)) == []
    untracked = own.model_copy(update={"own": None})
    assert record_reasons(_with_rule(5, untracked)) == ["skipped_step"]
    data = NonfiniteCall(kind="fault", reason="reproducible", own=True, clean_scale=None)
    assert not device_offended(_with_rule(6, data))
    # An overflow at a clean scale, not rerun: the scale alone blames neither the device
    # nor the batch (healthy gradients outgrow a scale too).
    at_clean = NonfiniteCall(
        kind="fault", reason="overflow_at_clean_scale", own=True, clean_scale=8.0
    )
    assert not device_offended(_with_rule(7, at_clean))
    assert record_reasons(_with_rule(7, at_clean)) == []


def test_records_before_the_rule_are_judged_as_before() -> None:
    old = record(3, skipped=True, origin=True)
    assert old.totals.faults is None
    assert device_offended(old)
    assert record_reasons(old) == ["nonfinite_origin"]
    assert collapse_reference(old) == old.scale_after


def test_collapse_is_measured_from_the_clean_scale() -> None:
    warmup = _with_rule(
        2,
        NonfiniteCall(kind="weather", reason="warmup", own=True, clean_scale=None),
        scale=2.0**39,
        scale_before=2.0**40,
    )
    assert collapse_reference(warmup) == 0.0  # a warm-up is no height to fall from
    settled = _with_rule(30, None, clean=2.0**15, scale=2.0**16)
    assert collapse_reference(settled) == 2.0**15
