"""Demo options are checked before anything starts."""

from __future__ import annotations

import pytest

from ampscope.demo.session import MIN_STEPS, DemoOptions


def test_too_few_steps_to_reach_the_thresholds_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="inf_hotspot needs 5 detections"):
        DemoOptions(steps=MIN_STEPS - 1)
    assert DemoOptions(steps=MIN_STEPS).steps == MIN_STEPS
