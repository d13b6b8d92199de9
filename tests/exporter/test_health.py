"""Every health rule firing and staying quiet, driven by hand-made times."""

from __future__ import annotations

from ampscope.exporter.health import evaluate
from ampscope.exporter.state.ranks import RankSnapshot, RankState
from ampscope.reporter.schema import StepRecord
from ampscope.verdicts.thresholds import Thresholds
from ampscope.verdicts.verdict import FP8_RULES, RULES
from exporter.factory import T0, record, totals, watch

T = Thresholds()


def _rank(*batches: tuple[float, list[StepRecord]]) -> RankSnapshot:
    """A rank that received each (exporter time, records) batch in turn."""
    state = RankState(history_length=1024)
    for now, records in batches:
        state.apply_batch(records, 0, now)
    return state.snapshot()


def _run(rank: int, step_scales: list[float], *, now: float, skipped: int = 0) -> RankSnapshot:
    """One batch, received at ``now``, of steps 1..n with the given scales; the totals carry
    the scale of the newest step that is a multiple of 10, as a rank's do."""
    records = []
    for i, s in enumerate(step_scales):
        step = i + 1
        aligned = step - step % 10
        held = (aligned, step_scales[aligned - 1]) if aligned else None
        total = totals(step, skipped=min(skipped, step), aligned=held)
        records.append(record(step, rank=rank, scale=s, total=total))
    return _rank((now, records))


def _verdict(ranks: list[RankSnapshot], rule: str, now: float = T0) -> dict:
    report = evaluate("run-a", ranks, now, T)
    (verdict,) = [v for v in report.verdicts if v.rule == rule]
    return verdict.model_dump()


def test_scale_below_floor_is_critical() -> None:
    v = _verdict([_run(0, [2.0, 1.0, 0.5], now=T0)], "scale_collapse")
    assert v["status"] == "critical"
    (hit,) = v["evidence"]["ranks"]
    assert hit["scale"] == 0.5
    assert "below_floor" in hit["reasons"]
    assert v["thresholds"] == {"scale_floor": 1.0, "collapse_factor": 256.0, "window_s": 600.0}


def test_scale_fall_within_window() -> None:
    fell = _verdict([_run(0, [65536.0, 1024.0, 256.0], now=T0)], "scale_collapse")
    assert fell["status"] == "critical"
    assert fell["evidence"]["ranks"][0]["fall_factor"] == 256.0
    assert fell["evidence"]["ranks"][0]["reasons"] == ["fell"]
    # A fall by 128 is not a collapse.
    assert _verdict([_run(0, [65536.0, 512.0], now=T0)], "scale_collapse")["status"] == "ok"


def test_scale_fall_older_than_window_is_ok() -> None:
    old_peak = _rank(
        (T0, [record(1, scale=65536.0)]),
        (T0 + 10, [record(2, scale=256.0)]),
        (T0 + 700, [record(3, scale=256.0)]),
    )
    v = _verdict([old_peak], "scale_collapse", now=T0 + 700)
    assert v["status"] == "ok"
    assert v["evidence"]["lowest_scale"] == 256.0


def test_scale_collapse_window_starts_again_at_a_new_process() -> None:
    # What AmpscopeScaleCollapse and status --prometheus take as the window too (a reset of
    # ampscope_steps_total within it): a restart with the same run id that resumes at a
    # lower scale is no fall; a collapse within the new process is.
    old = [record(s, time=T0 + s - 4000, scale=2.0**24, total=totals(s)) for s in (4000, 4001)]
    grown = (T0 + 1, old)
    resumed = _rank(grown, (T0 + 60, [record(1, time=T0 + 60, scale=2.0**14, total=totals(1))]))
    assert resumed.restarts == 1
    assert _verdict([resumed], "scale_collapse", now=T0 + 60)["status"] == "ok"
    after = [
        record(1, time=T0 + 60, scale=65536.0, total=totals(1)),
        record(2, time=T0 + 61, scale=128.0, total=totals(2)),
    ]
    collapsed = _rank(grown, (T0 + 61, after))
    v = _verdict([collapsed], "scale_collapse", now=T0 + 61)
    assert v["status"] == "critical"
    (hit,) = v["evidence"]["ranks"]
    assert (hit["window_peak_scale"], hit["fall_factor"]) == (65536.0, 512.0)


def test_skip_storm_fires_on_ratio_within_window() -> None:
    storm = _run(0, [65536.0] * 20, now=T0, skipped=6)  # 6 of 20 = 30%
    v = _verdict([storm], "skip_storm")
    assert v["status"] == "warning"
    assert v["evidence"]["ranks"][0] | {} == {
        "rank": 0,
        "node": "node0",
        "steps": 20,
        "skipped": 6,
        "ratio": 0.3,
    }
    calm = _run(0, [65536.0] * 20, now=T0, skipped=5)  # exactly 25%: not above
    assert _verdict([calm], "skip_storm")["status"] == "ok"
    few = _run(0, [65536.0] * 9, now=T0, skipped=9)  # 100% but under min_steps
    assert _verdict([few], "skip_storm")["status"] == "ok"


def test_skip_storm_counts_only_the_window() -> None:
    # 8 skips long ago, then 40 clean steps: the window (last 300 s) holds 0 of 40.
    snap = _rank(
        (T0, [record(10, total=totals(10, skipped=8))]),
        (T0 + 400, [record(50, total=totals(50, skipped=8))]),
    )
    v = _verdict([snap], "skip_storm", now=T0 + 430)
    assert v["status"] == "ok"
    assert v["evidence"]["worst_ratio"] == 0.0
    # Same history seen from within 300 s of the skips: 8 of 50 steps since start = 16%;
    # 20 more skips in the window make it fire.
    burst = _rank(
        (T0, [record(10, total=totals(10, skipped=8))]),
        (T0 + 400, [record(50, total=totals(50, skipped=28))]),
    )
    v = _verdict([burst], "skip_storm", now=T0 + 430)
    assert v["status"] == "warning"
    assert v["evidence"]["ranks"][0]["steps"] == 40
    assert v["evidence"]["ranks"][0]["skipped"] == 20


def test_skip_storm_after_an_exporter_restart_counts_from_the_first_batch() -> None:
    # Heard first at step 1000 (900 skipped long ago), then 20 steps with 10 skipped.
    snap = _rank(
        (T0, [record(1000, total=totals(1000, skipped=900))]),
        (T0 + 30, [record(1020, total=totals(1020, skipped=910))]),
    )
    v = _verdict([snap], "skip_storm", now=T0 + 30)
    assert v["status"] == "warning"
    assert v["evidence"]["ranks"][0]["steps"] == 20
    assert v["evidence"]["ranks"][0]["skipped"] == 10


def test_scale_desync_compares_the_ranks_aligned_scales() -> None:
    agree = [_run(r, [65536.0] * 9 + [32768.0] * 11, now=T0) for r in (0, 1, 2)]
    v = _verdict(agree, "scale_desync")
    assert (v["status"], v["summary"]) == (
        "ok",
        "ranks agree on the scale at 1 shared aligned step(s)",
    )
    # Rank 2 backed off at step 15 alone: seen at the next aligned step, 20.
    apart = [*agree[:2], _run(2, [65536.0] * 9 + [32768.0] * 5 + [16384.0] * 6, now=T0)]
    v = _verdict(apart, "scale_desync")
    assert v["status"] == "critical"
    assert v["evidence"] == {
        "source": "aligned",
        "compared_steps": 1,
        "mismatched_steps": 1,
        "newest_mismatched_step": 20,
        "ranks_at_newest": 3,
        "majority_scale": 32768.0,
        "ranks": [{"rank": 2, "node": "node0", "scale": 16384.0}],
    }
    # Before the first aligned step there is nothing to compare.
    young = [_run(0, [65536.0] * 9, now=T0), _run(1, [1024.0] * 9, now=T0)]
    assert _verdict(young, "scale_desync")["evidence"]["compared_steps"] == 0


def test_lost_rank_after_ttl() -> None:
    fresh = _run(0, [65536.0, 65536.0], now=T0 + 100)
    silent = _run(1, [65536.0, 65536.0], now=T0)
    v = _verdict([fresh, silent], "lost_rank", now=T0 + 61)
    assert v["status"] == "critical"  # 1 of 2 lost: more than a quarter of the run
    assert v["evidence"]["ranks"] == [
        {"rank": 1, "node": "node0", "seconds_since_report": 61, "last_step": 2}
    ]
    assert evaluate("run-a", [fresh, silent], T0 + 61, T).up == 1
    assert _verdict([fresh, silent], "lost_rank", now=T0 + 60)["status"] == "ok"
    # 1 of 5 lost is a warning.
    others = [_run(r, [65536.0, 65536.0], now=T0 + 100) for r in (2, 3, 4)]
    assert _verdict([fresh, silent, *others], "lost_rank", now=T0 + 61)["status"] == "warning"


def test_ranks_count_while_their_last_report_is_within_the_window() -> None:
    fresh = _run(0, [65536.0] * 10, now=T0 + 500)
    gone = _run(1, [65536.0] * 9 + [8.0], now=T0)  # collapsed and disagrees, then went quiet
    # Quiet for 500 s: lost, but what killed it still shows.
    report = evaluate("run-a", [fresh, gone], T0 + 500, T)
    statuses = {v.rule: v.status for v in report.verdicts}
    assert statuses["scale_collapse"] == "critical"
    assert statuses["scale_desync"] == "critical"
    # Quiet for longer than the 600 s window: only the lost verdict remains.
    report = evaluate("run-a", [fresh, gone], T0 + 601, T)
    statuses = {v.rule: v.status for v in report.verdicts}
    assert statuses == {
        "scale_collapse": "ok",
        "skip_storm": "ok",
        "scale_desync": "ok",
        "lost_rank": "critical",
        "missing_rank": "ok",
        "stalled_rank": "ok",
        "stopped_rank": "ok",
        "rank_failed": "ok",
        "inf_hotspot": "ok",
        "nonfinite_update_applied": "ok",
        "nonfinite_skipped": "ok",
        "loss_spike": "ok",
        "grad_norm_spike": "ok",
        "origin_outlier": "ok",
        "transient_fault": "ok",
        "reproducible_fault": "ok",
        "replica_divergence": "ok",
    }
    assert report.status == "critical"


def test_missing_rank_is_judged_only_where_the_node_holds_the_whole_job() -> None:
    def node(rank: int, local_world_size: int | None) -> RankSnapshot:
        one = record(1, rank=rank, world_size=4, local_world_size=local_world_size)
        return _rank((T0 + 1, [one]))

    # A single-node job of 4 (torchrun's LOCAL_WORLD_SIZE 4): ranks 1 and 3 never reported.
    v = _verdict([node(0, 4), node(2, 4)], "missing_rank", T0 + 1)
    assert v["status"] == "warning"
    assert v["evidence"] == {
        "judged": True,
        "world_size": 4,
        "seen": 2,
        "missing": 2,
        "ranks": [1, 3],
    }
    assert "2 of 4 rank(s) never reported" in v["summary"]
    assert evaluate("run-a", [node(0, 4), node(2, 4)], T0 + 1, T).status == "warning"
    assert _verdict([node(r, 4) for r in range(4)], "missing_rank", T0 + 1)["status"] == "ok"
    # One node of two (2 ranks here, 4 in all), or ranks that did not say: the exporter
    # cannot tell a missing rank from one that reports to another node's exporter.
    for local in (2, None):
        v = _verdict([node(0, local), node(1, local)], "missing_rank", T0 + 1)
        assert (v["status"], v["evidence"]["judged"]) == ("ok", False)
        assert "not judged" in v["summary"]


def _infs(rank: int, *, local: dict[str, int], origin: dict[str, int]) -> RankSnapshot:
    """A rank heard from step 1 whose found-inf totals reached ``local``/``origin``."""
    clean = totals(1, local=dict.fromkeys(local, 0), origin=dict.fromkeys(origin, 0))
    return _rank(
        (T0 - 100, [record(1, rank=rank, total=clean)]),
        (T0, [record(20, rank=rank, total=totals(20, local=local, origin=origin))]),
    )


def test_inf_hotspot_prefers_origin_detections() -> None:
    ranks = [
        _infs(0, local={"cuda:0": 9}, origin={"cuda:0": 0}),
        _infs(1, local={"cuda:1": 9}, origin={"cuda:1": 9}),
        _infs(2, local={"cuda:2": 9}, origin={"cuda:2": 1}),
    ]
    v = _verdict(ranks, "inf_hotspot")
    assert v["status"] == "warning"
    assert v["evidence"]["source"] == "origin"
    assert v["evidence"]["detections"] == 10
    assert v["evidence"]["top"][0] == {
        "rank": 1,
        "node": "node0",
        "device": "cuda:1",
        "detections": 9,
        "share": 0.9,
    }


def test_inf_hotspot_quiet_cases() -> None:
    even = [_infs(r, local={f"cuda:{r}": 5}, origin={}) for r in (0, 1)]
    v = _verdict(even, "inf_hotspot")
    assert (v["status"], v["evidence"]["source"], v["evidence"]["detections"]) == (
        "ok",
        "local",
        10,
    )
    few = [_infs(0, local={"cuda:0": 4}, origin={}), _infs(1, local={"cuda:1": 0}, origin={})]
    assert _verdict(few, "inf_hotspot")["status"] == "ok"  # 100% but under 5 detections
    alone = [_infs(0, local={"cuda:0": 50}, origin={})]
    assert _verdict(alone, "inf_hotspot")["status"] == "ok"  # one device is no hotspot


def test_overall_status_is_the_worst_verdict() -> None:
    report = evaluate("run-a", [_run(0, [65536.0] * 3, now=T0)], T0, T)
    assert report.status == "ok"
    # A run without FP8 layers reports every rule but the FP8 ones.
    assert [v.rule for v in report.verdicts] == [r for r in RULES if r not in FP8_RULES]
    ranks = [_run(r, [65536.0, 65536.0], now=T0 + 61) for r in range(4)]
    report = evaluate("run-a", [*ranks, _run(4, [65536.0, 65536.0], now=T0)], T0 + 61, T)
    assert report.status == "warning"  # one of five lost
    report = evaluate("run-a", [_run(0, [65536.0, 0.5], now=T0)], T0 + 61, T)
    assert report.status == "critical"  # lost and collapsed: the worst wins


def _observe(rank: int, steps: int, first: tuple[int, bool | None] | None, **kw) -> RankSnapshot:
    """A watch rank under observe, heard from step 1, that applied a non-finite update at
    each step from ``first`` on (``None``: never)."""
    applied = 0 if first is None else steps - first[0] + 1
    records = [watch(1, rank=rank, **kw)] + [
        watch(
            step,
            rank=rank,
            found_inf=first is not None and step >= first[0],
            total=totals(
                step,
                local={"cuda:0": 0 if first is None else max(0, step - first[0] + 1)},
                applied=0 if first is None or step < first[0] else step - first[0] + 1,
                first_applied=None if first is None or step < first[0] else first,
            ),
            **kw,
        )
        for step in range(2, steps + 1)
    ]
    snap = _rank((T0, records))
    assert snap.newest.totals.nonfinite_applied == applied
    return snap


def test_nonfinite_update_applied_names_the_first_step_and_its_origin() -> None:
    # DDP spreads rank 2's inf at step 7 into every rank's update; rank 3 (another replica
    # group, say) went non-finite later on its own.
    ranks = [
        _observe(0, 20, (7, False)),
        _observe(1, 20, (7, False)),
        _observe(2, 20, (7, True)),
        _observe(3, 20, (12, True)),
    ]
    v = _verdict(ranks, "nonfinite_update_applied")
    assert v["status"] == "critical"
    evidence = v["evidence"]
    assert evidence["first_step"] == 7
    assert evidence["origin_ranks"] == [2]
    assert evidence["origin_tracked"] is True
    assert evidence["ranks_affected"] == 4
    assert evidence["updates_applied"] == 14 * 3 + 9
    assert [(r["rank"], r["first_step"], r["origin"]) for r in evidence["ranks"]] == [
        (0, 7, False),
        (1, 7, False),
        (2, 7, True),
        (3, 12, True),
    ]
    assert v["summary"] == (
        "4 rank(s) applied 51 optimizer step(s) on inf/NaN gradients: the weights hold "
        "inf/NaN since step 7; origin: rank(s) 2"
    )
    assert evaluate("run-a", ranks, T0, T).status == "critical"


def test_nonfinite_update_applied_without_origin_tracking() -> None:
    ranks = [_observe(0, 10, (4, None)), _observe(1, 10, (4, None))]
    v = _verdict(ranks, "nonfinite_update_applied")
    assert v["status"] == "critical"
    assert (v["evidence"]["origin_tracked"], v["evidence"]["origin_ranks"]) == (False, [])
    assert v["summary"].endswith("since step 4; origin not tracked (attach(model, "
                                 "track_origin=True) names it)")  # fmt: skip


def test_nonfinite_update_applied_quiet_and_forgotten_on_restart() -> None:
    clean = [_observe(0, 10, None), _observe(1, 10, None, policy="skip")]
    v = _verdict(clean, "nonfinite_update_applied")
    assert (v["status"], v["evidence"]) == ("ok", {"ranks_affected": 0})
    # However long ago: the weights stay non-finite until the process restarts.
    broken = _rank((T0, [watch(5, total=totals(5, applied=2, first_applied=(4, True)))]))
    late = T0 + 10 * T.collapse_window_s
    assert _verdict([broken], "nonfinite_update_applied", now=late)["status"] == "critical"
    restarted = _rank(
        (T0, [watch(5, total=totals(5, applied=2, first_applied=(4, True)))]),
        (T0 + 60, [watch(2, time=T0 + 60, total=totals(2))]),
    )
    assert restarted.restarts == 1
    assert _verdict([restarted], "nonfinite_update_applied")["status"] == "ok"


def test_scale_rules_leave_watch_ranks_out() -> None:
    # A watch's records say scale 1; beside a scaler at 2^16 that would look like a desync
    # and, with a floor above 1, like a collapse. Neither is a loss scale.
    watches = [_observe(r, 20, None) for r in (0, 1)]
    report = evaluate("run-a", watches, T0, Thresholds(scale_floor=2.0))
    statuses = {v.rule: (v.status, v.summary) for v in report.verdicts}
    no_scale = "no rank has a loss scale: every rank runs a watch (bf16/fp32)"
    assert statuses["scale_collapse"] == ("ok", no_scale)
    assert statuses["scale_desync"] == ("ok", no_scale)
    mixed = [_run(0, [65536.0] * 5, now=T0), _observe(1, 5, None)]
    v = _verdict(mixed, "scale_desync")
    assert (v["status"], v["evidence"]["compared_steps"]) == ("ok", 0)
    assert v["summary"] == "ranks agree on the scale at 0 shared aligned step(s)"
    v = _verdict(mixed, "scale_collapse")
    assert (v["status"], v["evidence"]["lowest_scale"]) == ("ok", 65536.0)


def test_skip_storm_counts_a_watch_under_skip() -> None:
    # Under skip, a watch's skipped steps are real skips: the optimizer did not step.
    records = [
        watch(s, policy="skip", skipped=s > 10, total=totals(s, skipped=max(0, s - 10)))
        for s in range(1, 21)
    ]
    v = _verdict([_rank((T0, records))], "skip_storm")
    assert v["status"] == "warning"
    assert v["evidence"]["ranks"][0]["skipped"] == 10


def test_a_run_whose_ranks_went_quiet_has_no_live_rank_making_progress() -> None:
    quiet = [_run(0, [65536.0], now=T0), _run(1, [65536.0], now=T0)]
    v = _verdict(quiet, "stalled_rank", now=T0 + T.stale_after_s + 1)
    assert (v["status"], v["summary"]) == ("ok", "no live ranks: 2 lost")
    v = _verdict([_run(0, [65536.0], now=T0)], "stalled_rank", now=T0)
    assert v["summary"] == "the live rank is making progress"


def _skipping(rank: int, skips: dict[int, bool | None], *, steps: int = 20) -> list[StepRecord]:
    """A watch rank under skip, steps 1..steps; ``skips`` maps the skipped steps to whether
    the rank's own gradients held the inf (``None``: origin not tracked)."""
    records = []
    for step in range(1, steps + 1):
        skipped = sum(1 for s in skips if s <= step)
        rec = watch(step, rank=rank, policy="skip", skipped=step in skips, found_inf=step in skips,
                    total=totals(step, skipped=skipped))  # fmt: skip
        if step in skips and skips[step] is not None:
            rec = rec.model_copy(update={"found_inf_origin": {"cuda:0": bool(skips[step])}})
        records.append(rec)
    return records


def test_nonfinite_skipped_names_the_count_the_last_step_and_its_origin() -> None:
    # Rank 1's gradients went inf at steps 6, 11 and 17; both ranks skipped them together.
    ranks = [_rank((T0, _skipping(r, {6: r == 1, 11: r == 1, 17: r == 1}))) for r in (0, 1)]
    v = _verdict(ranks, "nonfinite_skipped")
    assert v["status"] == "warning"
    assert v["summary"] == (
        "3 step(s) skipped for inf/NaN gradients within 600 s (watch policy skip), the last "
        "at step 17; origin: rank(s) 1"
    )
    assert (v["evidence"]["skipped"], v["evidence"]["last_step"]) == (3, 17)
    assert (v["evidence"]["origin_tracked"], v["evidence"]["origin_ranks"]) == (True, [1])
    assert v["evidence"]["ranks"][0] == {
        "rank": 0, "node": "node0", "skipped": 3, "last_step": 17, "origin": False,
    }  # fmt: skip
    assert v["thresholds"] == {"window_s": 600.0}
    assert evaluate("run-a", ranks, T0, T).status == "warning"


def test_nonfinite_skipped_ends_with_its_window_which_is_a_setting() -> None:
    untracked = [_rank((T0, _skipping(r, {4: None}))) for r in (0, 1)]
    v = _verdict(untracked, "nonfinite_skipped", now=T0 + 599)
    assert v["summary"].endswith(
        "the last at step 4; origin not tracked (attach(model, track_origin=True) names it)"
    )
    assert _verdict(untracked, "nonfinite_skipped", now=T0 + 601)["status"] == "ok"
    short = Thresholds(nonfinite_skipped_window_s=30.0)
    report = evaluate("run-a", untracked, T0 + 31, short)
    (verdict,) = [v for v in report.verdicts if v.rule == "nonfinite_skipped"]
    assert (verdict.status, verdict.thresholds) == ("ok", {"window_s": 30.0})
    assert verdict.summary == "no step skipped for inf/NaN gradients within 30 s"


def test_nonfinite_skipped_leaves_scalers_and_other_policies_out() -> None:
    # A scaler skips overflowed steps by design (skip_storm judges how often).
    scaler = _run(0, [65536.0] * 20, now=T0, skipped=3)
    v = _verdict([scaler], "nonfinite_skipped")
    assert (v["status"], v["summary"]) == ("ok", "no rank runs a watch under policy skip")
    observed = _observe(1, 10, (4, True))
    assert _verdict([scaler, observed], "nonfinite_skipped")["status"] == "ok"
