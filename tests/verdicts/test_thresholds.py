"""The rules' thresholds refuse values no rule can judge with."""

from __future__ import annotations

import pytest

from ampscope.verdicts.thresholds import Thresholds


def test_thresholds_validate() -> None:
    with pytest.raises(ValueError, match="collapse_factor"):
        Thresholds(collapse_factor=1.0)
    with pytest.raises(ValueError, match="hotspot_share"):
        Thresholds(hotspot_share=0.0)
    with pytest.raises(ValueError, match="stall_after_s"):
        Thresholds(stall_after_s=0.0)
    assert Thresholds().spike_rule().sigmas == Thresholds().spike_sigmas
