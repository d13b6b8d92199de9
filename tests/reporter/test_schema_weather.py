"""``RankTotals.weather`` is a part of the totals it rides in: each of its three counts at most
the matching total's (``skipped_steps``; ``found_inf_local`` and ``found_inf_origin`` device
by device, each against the totals' map of the same name), and no device the totals lack."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from ampscope.reporter.schema import RankTotals, WeatherTotals


def _totals(weather: dict[str, Any] | None) -> RankTotals:
    """Totals of a rank with two local devices, origin tracked on one: 3 skips, cuda:0 found
    inf/NaN 3 times (twice at the origin), cuda:1 once (never at the origin)."""
    return RankTotals.model_validate(
        {
            "steps": 40,
            "skipped_steps": 3,
            "backoffs": 3,
            "growths": 1,
            "found_inf_local": {"cuda:0": 3, "cuda:1": 1},
            "found_inf_origin": {"cuda:0": 2},
            "nonfinite_params": [],
            "min_scale": 1024.0,
            "max_scale": 65536.0,
            "aligned_scale": None,
            "weather": weather,
        }
    )


def _weather(skipped: int = 0, local: Any = None, origin: Any = None) -> dict[str, Any]:
    return {
        "skipped_steps": skipped,
        "found_inf_local": local or {},
        "found_inf_origin": origin or {},
    }


@pytest.mark.parametrize(
    "weather",
    [
        None,  # a reporter that predates the count
        _weather(),
        # Every count at its bound: every skip and detection was weather.
        _weather(3, {"cuda:0": 3, "cuda:1": 1}, {"cuda:0": 2}),
        # A device of the totals with 0 weather, or none listed: both mean none.
        _weather(1, {"cuda:0": 0, "cuda:1": 1}, {"cuda:0": 0}),
    ],
)
def test_weather_within_its_totals_is_accepted(weather: dict[str, Any] | None) -> None:
    totals = _totals(weather)
    assert totals.weather == (None if weather is None else WeatherTotals(**weather))


@pytest.mark.parametrize(
    ("weather", "message"),
    [
        (_weather(skipped=4), "weather.skipped_steps (4) exceeds skipped_steps (3)"),
        (
            _weather(local={"cuda:1": 2}),
            "weather.found_inf_local['cuda:1'] (2) exceeds found_inf_local['cuda:1'] (1)",
        ),
        (
            _weather(origin={"cuda:0": 3}),
            "weather.found_inf_origin['cuda:0'] (3) exceeds found_inf_origin['cuda:0'] (2)",
        ),
        # Origin is held against the origin totals, not the local ones: cuda:0's 3 local
        # detections do not make room for 3 at the origin, and cuda:1 has no origin count.
        (
            _weather(origin={"cuda:1": 0}),
            "weather.found_inf_origin names device 'cuda:1', which found_inf_origin does not hold",
        ),
        (
            _weather(local={"cuda:7": 0}),
            "weather.found_inf_local names device 'cuda:7', which found_inf_local does not hold",
        ),
    ],
)
def test_weather_beyond_its_totals_is_refused_naming_the_count(
    weather: dict[str, Any], message: str
) -> None:
    with pytest.raises(pydantic.ValidationError) as caught:
        _totals(weather)
    (error,) = caught.value.errors(include_url=False)
    assert error["type"] == "value_error"
    assert message in error["msg"]
