"""Merging several exporters' answers into one whole-job answer: pure functions over the
JSON API's data, so hand-made answers drive them."""

from __future__ import annotations

from typing import Any

from ampscope.status.fanout import TargetResult, job_answer
from ampscope.status.merge import merge_health, merge_ranks, merge_summaries
from ampscope.verdicts import fp8 as fp8_rules


def _view(rank: int, node: str, state: str = "running", heard: float = 100.0) -> dict[str, Any]:
    return {
        "rank": rank,
        "node": node,
        "state": state,
        "up": state != "lost",
        "world_size": 16,
        "local_world_size": 4,
        "step": 50,
        "last_report_time": heard,
        "seconds_since_report": 200.0 - heard,
    }


def _verdict(rule: str, status: str = "ok", summary: str = "fine", **evidence: Any) -> dict:
    thresholds = {"stale_after_s": 60.0, "critical_share": 0.25} if rule == "lost_rank" else {}
    return {
        "rule": rule,
        "status": status,
        "summary": summary,
        "evidence": evidence,
        "thresholds": thresholds,
    }


def _report(*verdicts: dict) -> dict[str, Any]:
    rules = {v["rule"]: v for v in verdicts}
    names = ("scale_collapse", "skip_storm", "lost_rank", "missing_rank", "stalled_rank")
    return {
        "run": "r",
        "status": "ok",
        "evaluated_at": 200.0,
        "verdicts": [rules.get(name) or _verdict(name) for name in names],
    }


def test_a_rank_two_exporters_hold_counts_once_as_its_newest_copy() -> None:
    old, new = _view(3, "n0", "lost", heard=50.0), _view(3, "n1", heard=150.0)
    merged = merge_ranks([[_view(0, "n0"), old], [new, _view(1, "n1")]])
    assert [(v["rank"], v["node"]) for v in merged] == [(0, "n0"), (1, "n1"), (3, "n1")]


def test_whole_job_rules_are_computed_again_over_every_node() -> None:
    lost_node = [_view(r, "n0", "lost", heard=90.0) for r in range(3)] + [_view(3, "n0")]
    live = [_view(r, f"n{r // 4}") for r in range(4, 15)]  # rank 15 never reported
    node0 = _report(
        _verdict("lost_rank", "critical", "3 of 4 lost", lost=3),
        _verdict("stalled_rank", summary="the live rank is making progress (3 lost)"),
    )
    node1 = _report(
        _verdict("skip_storm", "warning", "storm on rank 5", ranks=[{"rank": 5, "node": "n1"}])
    )
    views = merge_ranks([lost_node, live])
    health = merge_health("r", [("http://n0", node0), ("http://n1", node1)], views)
    verdicts = {v["rule"]: v for v in health["verdicts"]}
    # The node's exporter saw 3 of its 4 ranks lost (critical); the job lost 3 of 15.
    assert verdicts["lost_rank"]["status"] == "warning"
    assert verdicts["lost_rank"]["evidence"]["lost"] == 3
    assert verdicts["missing_rank"]["status"] == "warning"
    assert verdicts["missing_rank"]["evidence"]["ranks"] == [15]
    # Per-rank verdicts: the worst exporter's, naming the exporters that flagged it.
    storm = verdicts["skip_storm"]
    assert (storm["status"], storm["summary"]) == ("warning", "storm on rank 5")
    assert storm["evidence"]["exporters"] == [
        {"url": "http://n1", "status": "warning", "summary": "storm on rank 5"}
    ]
    assert verdicts["stalled_rank"]["summary"] == "all 12 live ranks are making progress (3 lost)"
    assert (health["status"], health["ranks"], health["up"]) == ("warning", 15, 12)
    assert health["states"] == {
        "running": 12,
        "stalled": 0,
        "lost": 3,
        "finished": 0,
        "failed": 0,
        "stopped": 0,
    }
    assert verdicts["rank_failed"]["status"] == "ok"  # recomputed: no exporter said it


def test_summaries_of_one_run_on_several_exporters_are_one_line() -> None:
    a = {"run": "r", "ranks": 2, "up": 2, "stale": 0, "states": {"running": 2},
         "world_size": 8, "newest_step": 40, "last_report_time": 10.0}  # fmt: skip
    b = {**a, "ranks": 1, "up": 0, "stale": 1, "states": {"lost": 1}, "world_size": 4,
         "newest_step": 55, "last_report_time": 20.0}  # fmt: skip
    (merged,) = merge_summaries([[a], [b]])
    assert merged == {"run": "r", "ranks": 3, "up": 2, "stale": 1,
                      "states": {"running": 2, "lost": 1}, "world_size": 4,
                      "newest_step": 55, "last_report_time": 20.0}  # fmt: skip
    assert a["states"] == {"running": 2}  # the inputs are left alone


def test_exit_status_when_targets_fail() -> None:
    def failed(url: str, status: str, code: int) -> TargetResult:
        return TargetResult(url, None, status, f"{status} at {url}", code)

    dead = [failed("http://a", "unreachable", 3), failed("http://b", "refused", 5)]
    answer, code = job_answer(dead, "r")
    assert code == 3
    assert [t["status"] for t in answer["targets"]] == ["unreachable", "refused"]
    assert job_answer([failed("http://b", "refused", 5)] * 2, "r")[1] == 5
    assert job_answer([failed("http://a", "no_such_run", 4)] * 2, "r")[1] == 4
    # One target answers: its verdicts decide, the others are named.
    held = {"run": "r", "ranks": [_view(0, "n0")], "health": _report()}
    answer, code = job_answer([TargetResult("http://c", held, "ok"), *dead], "r")
    assert code == 1  # 15 of 16 ranks never reported
    assert answer["missing_ranks"] == list(range(1, 16))
    assert answer["url"] == "http://c, http://a, http://b"


def _fp8_report(*facts: fp8_rules.Fp8Facts) -> dict[str, Any]:
    """One exporter's report with the FP8 verdicts its exporter computes over ``facts``."""
    rule = fp8_rules.Fp8Rule()
    report = _report()
    report["verdicts"] += [
        fp8_rules.fp8_amax_spike(facts, rule, now=200.0, window_s=600.0).model_dump(),
        fp8_rules.fp8_underflow(facts, rule).model_dump(),
        fp8_rules.fp8_nonfinite_amax(facts, now=200.0, window_s=600.0).model_dump(),
    ]
    return report


def _fp8(
    rank: int,
    node: str,
    layer: str,
    *,
    spike_step: int | None = None,
    underflow: float = 0.0,
    nonfinite_step: int | None = None,
) -> fp8_rules.Fp8Facts:
    def event(step: int | None, value: float | None) -> fp8_rules.Fp8Event | None:
        if step is None:
            return None
        baseline = None if value is None else 2.0
        return fp8_rules.Fp8Event(step=step, value=value, baseline=baseline, received=150.0)

    return fp8_rules.Fp8Facts(
        rank=rank,
        node=node,
        layer=layer,
        tensor="input",
        step=50,
        underflow_recent=(underflow,) * 5,
        spike=event(spike_step, 40.0),
        nonfinite=event(nonfinite_step, None),
    )


def test_fp8_verdicts_list_every_exporters_flagged_series() -> None:
    node0 = _fp8_report(
        _fp8(0, "n0", "layers.0", spike_step=40, underflow=0.3),
        _fp8(1, "n0", "layers.0"),
    )
    node1 = _fp8_report(
        _fp8(4, "n1", "layers.1", spike_step=45, nonfinite_step=48),
        _fp8(5, "n1", "layers.1", underflow=0.5),
    )
    views = merge_ranks([[_view(0, "n0"), _view(1, "n0")], [_view(4, "n1"), _view(5, "n1")]])
    health = merge_health("r", [("http://n0", node0), ("http://n1", node1)], views)
    verdicts = {v["rule"]: v for v in health["verdicts"]}
    spike = verdicts["fp8_amax_spike"]
    # Both nodes' spikes, the newest step first; the summary names it.
    assert [(s["rank"], s["step"]) for s in spike["evidence"]["series"]] == [(4, 45), (0, 40)]
    assert spike["evidence"]["series_affected"] == 2
    assert spike["summary"] == (
        "FP8 amax spiked in 2 series: rank 4 layer layers.1 input at step 45: 40, 20x its median 2"
    )
    assert [e["url"] for e in spike["evidence"]["exporters"]] == ["http://n0", "http://n1"]
    underflow = verdicts["fp8_underflow"]
    assert [(s["rank"], s["ratio"]) for s in underflow["evidence"]["series"]] == [
        (5, 0.5),
        (0, 0.3),
    ]
    assert underflow["status"] == "warning"
    # One exporter flagged a non-finite amax: critical, the other's ok counts its series.
    nonfinite = verdicts["fp8_nonfinite_amax"]
    assert nonfinite["status"] == "critical"
    assert nonfinite["summary"] == (
        "FP8 amax not finite in 1 series: first rank 4 layer layers.1 input at step 48"
    )
    assert health["status"] == "critical"


def test_fp8_verdicts_of_calm_exporters_count_every_series_and_a_run_without_fp8_has_none() -> None:
    node0 = _fp8_report(_fp8(0, "n0", "layers.0", underflow=0.05))
    node1 = _fp8_report(_fp8(4, "n1", "layers.0"), _fp8(4, "n1", "layers.1"))
    views = merge_ranks([[_view(0, "n0")], [_view(4, "n1")]])
    health = merge_health("r", [("http://n0", node0), ("http://n1", node1)], views)
    verdicts = {v["rule"]: v for v in health["verdicts"]}
    assert verdicts["fp8_amax_spike"]["summary"] == "no FP8 amax spike in 3 series"
    assert verdicts["fp8_underflow"]["evidence"] == {"series": 3, "worst_ratio": 0.05}
    assert verdicts["fp8_nonfinite_amax"]["status"] == "ok"
    assert "exporters" not in verdicts["fp8_amax_spike"]["evidence"]
    plain = merge_health("r", [("http://n0", _report()), ("http://n1", _report())], views)
    assert not [v for v in plain["verdicts"] if v["rule"].startswith("fp8_")]


def test_replica_divergence_takes_the_exporter_that_names_the_minoritys_device() -> None:
    # Node 0's exporter holds ranks 0-1, which only know rank 2 by number; node 1's holds
    # rank 2 itself and names its device. Both saw the divergence at step 300.
    far = _verdict(
        "replica_divergence", "critical", "rank 2 disagree(s)", step=300, ranks=[{"rank": 2}]
    )
    near = _verdict(
        "replica_divergence",
        "critical",
        "rank 2 (device GPU-2) disagree(s)",
        step=300,
        ranks=[{"rank": 2, "node": "n1", "device": "GPU-2"}],
    )
    views = merge_ranks([[_view(0, "n0"), _view(1, "n0")], [_view(2, "n1"), _view(3, "n1")]])
    for order in (
        [("http://n0", far), ("http://n1", near)],
        [("http://n1", near), ("http://n0", far)],
    ):
        reports = [
            (url, {**_report(), "verdicts": [*_report()["verdicts"], v]}) for url, v in order
        ]
        merged = {v["rule"]: v for v in merge_health("r", reports, views)["verdicts"]}
        verdict = merged["replica_divergence"]
        assert verdict["status"] == "critical"
        assert verdict["summary"] == "rank 2 (device GPU-2) disagree(s)"
        assert verdict["evidence"]["ranks"] == [{"rank": 2, "node": "n1", "device": "GPU-2"}]
        assert [e["url"] for e in verdict["evidence"]["exporters"]] == [u for u, _ in order]


def test_a_finished_run_reads_its_spikes_as_history_on_every_exporter() -> None:
    """Node n1's exporter saw the origin outlier and read it as history (the run finished
    normally); node n0's saw none; an older exporter on n2 still says warning. The job is
    ok, and its verdict is n1's history, naming the exporter that has the details."""
    views = [_view(r, f"n{r // 4}", "finished") for r in range(16)]
    history = _verdict(
        "origin_outlier",
        summary="history, the run finished normally since: rank 5's own gradients were x33",
        history=True,
        ranks=[{"rank": 5, "step": 150}],
    )
    calm = _verdict("origin_outlier", summary="no rank's own gradients stood out")
    old = _verdict("origin_outlier", "warning", "rank 9's own gradients were x12", ranks=[])

    def spiked(verdict: dict) -> dict[str, Any]:
        report = _report()
        return {**report, "verdicts": [*report["verdicts"], verdict]}

    reports = [("http://n0", spiked(calm)), ("http://n1", spiked(history))]
    health = merge_health("r", reports, views)
    (outlier,) = [v for v in health["verdicts"] if v["rule"] == "origin_outlier"]
    assert (health["status"], health["state"]) == ("ok", "finished")
    assert outlier["status"] == "ok"
    assert outlier["summary"] == history["summary"]
    assert outlier["evidence"]["exporters"] == [
        {"url": "http://n1", "status": "ok", "summary": history["summary"]}
    ]
    # The older exporter's warning is read as history by the merge's roll-up.
    health = merge_health("r", [*reports, ("http://n2", spiked(old))], views)
    (outlier,) = [v for v in health["verdicts"] if v["rule"] == "origin_outlier"]
    assert health["status"] == "ok"
    assert outlier["status"] == "ok"
    assert outlier["summary"].startswith("history, the run finished normally since: rank 9's")
    # A run still running keeps the old exporter's warning.
    live = [_view(r, f"n{r // 4}") for r in range(16)]
    assert merge_health("r", [("http://n2", spiked(old))], live)["status"] == "warning"
