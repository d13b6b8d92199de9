"""The aligned step and scale packed into one sample: exact round trips, equal pairs pack
alike, different scales never do."""

from __future__ import annotations

import math

import pytest

from ampscope.verdicts.aligned import LOG2_OFFSET, pack, unpack


@pytest.mark.parametrize("step", [0, 10, 12_340, 2**31 - 10])
@pytest.mark.parametrize("scale", [2.0**-14, 0.75, 1.0, 65536.0, 3.0 * 2**20, 2.0**127])
def test_round_trip_keeps_the_step_and_the_scale(step: int, scale: float) -> None:
    got_step, got_scale = unpack(pack(step, scale))
    assert got_step == step
    assert got_scale == pytest.approx(scale, rel=1e-3)


def test_equal_pairs_pack_alike_and_a_backoff_or_growth_never_does() -> None:
    step = 2**31 - 10
    assert pack(step, 65536.0) == pack(step, 65536.0)
    for other in (32768.0, 131072.0, 65536.0 * 1.01):
        assert pack(step, other) != pack(step, 65536.0)
        assert unpack(pack(step, other))[1] != unpack(pack(step, 65536.0))[1]
    # The fraction stays below 1: the step is never off by one, whatever the scale.
    assert unpack(pack(20, math.inf))[0] == 20
    assert unpack(pack(20, 0.0)) == (20, 2.0**-LOG2_OFFSET)
    assert unpack(pack(20, float("nan")))[0] == 20
