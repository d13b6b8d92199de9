"""The loss-scale rules over their facts, as any view calls them (the exporter's path over
its store is in tests/exporter/test_health.py)."""

from __future__ import annotations

from ampscope.verdicts.scale import (
    NO_SCALE,
    AlignedFacts,
    ScaleFacts,
    scale_collapse,
    scale_desync,
)
from ampscope.verdicts.thresholds import Thresholds


def at(rank: int, node: str, step: int | None, scale: float | None) -> AlignedFacts:
    return AlignedFacts(rank=rank, node=node, scaler=True, step=step, scale=scale)


def test_scale_collapse_below_the_floor_or_fallen_from_the_window_peak() -> None:
    t = Thresholds()

    def rank(r: int, scale: float, peak: float, scaler: bool = True) -> ScaleFacts:
        return ScaleFacts(rank=r, node="n0", scaler=scaler, scale=scale, window_peak_scale=peak)

    verdict = scale_collapse([rank(0, 2.0**16, 2.0**16), rank(1, 256.0, 2.0**16)], t)
    assert verdict.status == "critical"
    assert verdict.evidence["ranks"] == [
        {"rank": 1, "node": "n0", "scale": 256.0, "window_peak_scale": 65536.0,
         "fall_factor": 256.0, "reasons": ["fell"]},
    ]  # fmt: skip
    # A watch's scale 1 is no scale: not below the floor, and alone it says so.
    watch = rank(2, 1.0, 1.0, scaler=False)
    assert scale_collapse([rank(0, 2.0**16, 2.0**16), watch], t).status == "ok"
    assert scale_collapse([watch], t).summary == NO_SCALE


def test_aligned_desync_compares_ranks_at_the_same_aligned_step_only() -> None:
    # Rank 4 lags at step 20 with another scale: nothing to compare it with.
    agree = [at(0, "n0", 30, 1024.0), at(1, "n0", 30, 1024.0), at(4, "n2", 20, 64.0)]
    verdict = scale_desync(agree)
    assert (verdict.status, verdict.evidence["compared_steps"]) == ("ok", 1)
    # Node n1's two ranks differ from the majority at step 30: they are named, with n1.
    split = [*agree, at(2, "n1", 30, 64.0), at(3, "n1", 30, 64.0), at(5, "n2", 30, 1024.0)]
    verdict = scale_desync(split)
    assert verdict.status == "critical"
    assert verdict.evidence["ranks"] == [
        {"rank": 2, "node": "n1", "scale": 64.0},
        {"rank": 3, "node": "n1", "scale": 64.0},
    ]
    assert (verdict.evidence["newest_mismatched_step"], verdict.evidence["majority_scale"]) == (
        30,
        1024.0,
    )
    assert verdict.summary.endswith("2 of 5 rank(s) differ from the majority's 1024, on node(s) n1")


def test_desync_leaves_watches_and_ranks_before_their_first_aligned_step_out() -> None:
    young = [at(0, "n0", 10, 1024.0), at(1, "n0", None, None), at(2, "n1", 10, 1024.0)]
    watch = AlignedFacts(rank=3, node="n1", scaler=False, step=None, scale=None)
    verdict = scale_desync([*young, watch])
    assert (verdict.status, verdict.evidence["compared_steps"]) == ("ok", 1)
    assert verdict.summary == "ranks agree on the scale at 1 shared aligned step(s)"
    assert scale_desync([watch]).summary == NO_SCALE
    # No rank at all (every rank quiet for longer than the window) is no watch run.
    assert scale_desync([]).summary == "ranks agree on the scale at 0 shared aligned step(s)"
