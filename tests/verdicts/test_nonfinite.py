"""The inf/NaN rules over their window facts, as any view calls them (the exporter's
windows over its store are in tests/exporter/test_health.py)."""

from __future__ import annotations

from ampscope.verdicts.nonfinite import (
    AppliedFacts,
    InfFacts,
    SkippedFacts,
    StepFacts,
    inf_hotspot,
    nonfinite_skipped,
    nonfinite_update_applied,
    skip_storm,
)
from ampscope.verdicts.thresholds import Thresholds


def test_skip_storm_needs_enough_steps_and_a_ratio_above_the_threshold() -> None:
    t = Thresholds()
    ranks = [
        StepFacts(rank=0, node="n0", steps=20, skipped=5),  # 25%: not above
        StepFacts(rank=3, node="n1", steps=9, skipped=9),  # under min_steps
        StepFacts(rank=6, node="n2", steps=40, skipped=12),
    ]
    verdict = skip_storm(ranks, t)
    assert verdict.status == "warning"
    assert verdict.evidence == {
        "ranks_affected": 1,
        "ranks": [{"rank": 6, "node": "n2", "steps": 40, "skipped": 12, "ratio": 0.3}],
    }
    assert verdict.summary == (
        "12 of rank 6's last 40 steps were skipped (30%) on 1 rank(s), not counting the loss "
        "scaler's weather"
    )
    calm = skip_storm(ranks[:2], t)
    assert (calm.status, calm.evidence) == ("ok", {"worst_ratio": 0.25})


def test_skip_storm_leaves_out_the_scalers_weather_and_counts_the_rest() -> None:
    t = Thresholds()
    # An fp16 warm-up from 2**16 with slow steps: 3 of the window's 10 steps were backoffs,
    # all weather. Silent, however many: a short growth_interval's probes are weather too.
    warmup = StepFacts(rank=0, node="n0", steps=10, skipped=3, weather=3)
    probes = StepFacts(rank=1, node="n0", steps=40, skipped=20, weather=20)
    calm = skip_storm([warmup, probes], t)
    assert (calm.status, calm.evidence) == ("ok", {"worst_ratio": 0.0})
    # Beyond its weather, 3 of 10 steps skipped for inf/NaN the rule calls faults: a storm.
    storm = StepFacts(rank=2, node="n1", steps=10, skipped=6, weather=3)
    verdict = skip_storm([warmup, probes, storm], t)
    assert verdict.status == "warning"
    assert verdict.evidence["ranks"] == [
        {"rank": 2, "node": "n1", "steps": 10, "skipped": 3, "ratio": 0.3}
    ]
    # A watch has no weather (no scale): every skip counts; so do the skips of a reporter
    # that predates the weather count (weather 0), as before it.
    watch = StepFacts(rank=3, node="n1", steps=10, skipped=3)
    assert skip_storm([watch], t).evidence["ranks"][0]["skipped"] == 3


def test_inf_hotspot_leaves_out_the_scalers_weather_and_counts_the_rest() -> None:
    t = Thresholds()
    # One rank whose model spans two GPUs: every warm-up backoff overflowed on cuda:1 (the
    # head's large gradients), the first on cuda:0 too. All weather: no hotspot.
    devices = {"cuda:0": 1, "cuda:1": 6}
    split = InfFacts(rank=0, node="n0", local=devices, origin={}, weather_local=devices)
    calm = inf_hotspot([split], t)
    assert (calm.status, calm.evidence["detections"]) == ("ok", 0)
    # The same with origin tracking: the origin counts leave the weather out as well.
    tracked = InfFacts(
        rank=0, node="n0", local=devices, origin=devices, weather_local=devices,
        weather_origin=devices,
    )  # fmt: skip
    assert inf_hotspot([tracked], t).status == "ok"
    # After the warm-up cuda:1 made 6 more the rule calls faults: those count.
    faults = {"cuda:0": 1, "cuda:1": 12}
    hot = InfFacts(rank=0, node="n0", local=faults, origin={}, weather_local=devices)
    verdict = inf_hotspot([hot], t)
    assert verdict.status == "warning"
    assert verdict.summary == "rank 0 device cuda:1 holds 100% of 6 local found-inf detections"
    # A reporter that predates the weather count (no weather facts) counts every detection.
    old = inf_hotspot([InfFacts(rank=0, node="n0", local=devices, origin={})], t)
    assert old.summary == "rank 0 device cuda:1 holds 86% of 7 local found-inf detections"


def test_inf_hotspot_over_window_facts_names_the_rank_and_its_node() -> None:
    t = Thresholds()
    ranks = [
        InfFacts(rank=0, node="n0", local={"cuda:0": 1}, origin={"cuda:0": 1}),
        InfFacts(rank=9, node="n2", local={"cuda:1": 9}, origin={"cuda:1": 9}),
    ]
    verdict = inf_hotspot(ranks, t)
    assert verdict.status == "warning"
    assert verdict.evidence["top"][0] == {
        "rank": 9,
        "node": "n2",
        "device": "cuda:1",
        "detections": 9,
        "share": 0.9,
    }
    assert verdict.summary == "rank 9 device cuda:1 holds 90% of 10 origin found-inf detections"


def test_nonfinite_update_applied_names_the_first_step_and_its_origin_ranks() -> None:
    def applied(rank: int, first: int, origin: bool | None, n: int) -> AppliedFacts:
        return AppliedFacts(
            rank=rank, node=f"n{rank // 2}", first_step=first, origin=origin, applied=n,
            policy="observe",
        )  # fmt: skip

    ranks = [applied(3, 12, True, 2), applied(1, 7, False, 7), applied(2, 7, True, 7)]
    verdict = nonfinite_update_applied(ranks)
    assert verdict.status == "critical"
    assert (verdict.evidence["first_step"], verdict.evidence["origin_ranks"]) == (7, [2])
    assert [r["rank"] for r in verdict.evidence["ranks"]] == [1, 2, 3]
    assert verdict.summary == (
        "3 rank(s) applied 16 optimizer step(s) on inf/NaN gradients: the weights hold "
        "inf/NaN since step 7; origin: rank(s) 2"
    )
    untracked = nonfinite_update_applied([applied(0, 4, None, 1)])
    assert untracked.evidence["origin_tracked"] is False
    assert untracked.summary.endswith(
        "origin not tracked (attach(model, track_origin=True) names it)"
    )
    assert nonfinite_update_applied([]).status == "ok"


def test_nonfinite_skipped_counts_the_steps_and_names_the_origin_at_the_newest() -> None:
    t = Thresholds()

    def skipping(rank: int, n: int, last: int | None, origin: bool | None) -> SkippedFacts:
        return SkippedFacts(rank=rank, node=f"n{rank // 2}", mode="watch", policy="skip",
                            skipped=n, last_step=last, origin=origin)  # fmt: skip

    # Rank 3 arrived late at step 40 (its newest is 38); ranks 1 and 2 both held inf at 40.
    ranks = [skipping(0, 5, 40, False), skipping(1, 5, 40, True), skipping(2, 5, 40, True),
             skipping(3, 4, 38, True)]  # fmt: skip
    verdict = nonfinite_skipped(ranks, t)
    assert verdict.status == "warning"
    assert verdict.summary.endswith("the last at step 40; origin: rank(s) 1, 2")
    assert verdict.evidence["skipped"] == 5
    assert verdict.evidence["ranks_affected"] == 4
    # From a source with counts only (Prometheus): how many, and no step.
    counted = nonfinite_skipped([skipping(0, 2, None, None)], t)
    assert counted.summary == (
        "2 step(s) skipped for inf/NaN gradients within 600 s (watch policy skip)"
    )
    assert "last_step" not in counted.evidence
    # A scaler, or a watch under observe or raise, is not judged here.
    others = [
        SkippedFacts(rank=0, node="n0", mode=None, policy="skip", skipped=9),
        SkippedFacts(rank=1, node="n0", mode="watch", policy="observe", skipped=9),
    ]
    quiet = nonfinite_skipped(others, t)
    assert (quiet.status, quiet.summary) == ("ok", "no rank runs a watch under policy skip")


def test_an_inf_no_rank_held_of_its_own_was_born_in_the_reduction() -> None:
    t = Thresholds()

    def skipping(rank: int, origin: bool | None) -> SkippedFacts:
        return SkippedFacts(rank=rank, node="n0", mode="watch", policy="skip", skipped=1,
                            last_step=7, origin=origin)  # fmt: skip

    born = nonfinite_skipped([skipping(0, False), skipping(1, False)], t)
    assert born.summary.endswith(
        "origin: no rank held inf/NaN of its own at that step: born in the cross-rank "
        "reduction (finite gradients whose sum overflowed)"
    )
    # A rank that does not track its own gradients could have held it: nothing is claimed.
    unsure = nonfinite_skipped([skipping(0, False), skipping(1, None)], t)
    assert unsure.summary.endswith(
        "origin: no rank that tracks it held inf/NaN of its own at that step"
    )
