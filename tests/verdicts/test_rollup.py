"""A run's roll-up: the worst verdict, finished only when every rank finished."""

from __future__ import annotations

from ampscope.verdicts.rollup import (
    HISTORY_RULES,
    as_history,
    finished_normally,
    health_report,
    run_ended,
    run_state,
)
from ampscope.verdicts.verdict import Verdict


def _verdict(rule: str, status: str) -> Verdict:
    return Verdict.model_validate(
        {"rule": rule, "status": status, "summary": "", "evidence": {}, "thresholds": {}}
    )


def test_the_report_head_from_verdicts_and_states() -> None:
    verdicts = [_verdict("skip_storm", "warning"), _verdict("lost_rank", "ok")]
    report = health_report("r", verdicts, ["running", "lost"], evaluated_at=5.0, up=1)
    assert report == {
        "run": "r",
        "status": "warning",
        "state": "active",
        "evaluated_at": 5.0,
        "ranks": 2,
        "up": 1,
        "states": {"running": 1, "stalled": 0, "lost": 1, "finished": 0, "failed": 0, "stopped": 0},
        "verdicts": verdicts,
    }
    # The JSON of verdicts (a merge of exporters' answers) rolls up the same way.
    dumped = [v.model_dump() for v in verdicts] + [
        _verdict("scale_desync", "critical").model_dump()
    ]
    report = health_report("r", dumped, ["finished"] * 3, evaluated_at=5.0, up=0)
    assert (report["status"], report["state"], report["ranks"]) == ("critical", "finished", 3)


def test_a_run_finishes_only_when_every_rank_did() -> None:
    assert run_state(["finished", "finished"]) == "finished"
    assert run_state(["finished", "lost"]) == "active"
    assert run_state([]) == "active"


def test_a_run_whose_ranks_all_ended_with_one_failed_is_failed() -> None:
    assert run_ended(["finished", "failed"])
    assert not run_ended(["failed", "running"])
    assert run_state(["finished", "failed", "finished"]) == "failed"
    assert run_state(["failed", "stalled"]) == "active"  # one still steps: not over yet
    verdicts = [_verdict("rank_failed", "critical")]
    report = health_report("r", verdicts, ["failed", "finished"], evaluated_at=5.0, up=0)
    assert (report["status"], report["state"]) == ("critical", "failed")
    assert report["states"] == {
        "running": 0,
        "stalled": 0,
        "lost": 0,
        "finished": 1,
        "failed": 1,
        "stopped": 0,
    }


def test_a_run_its_launcher_stopped_is_stopped_never_finished_nor_failed() -> None:
    assert run_ended(["stopped", "stopped"])
    assert run_state(["stopped", "stopped"]) == "stopped"
    # Some ranks finished before the others were stopped: the training did not complete.
    assert run_state(["finished", "stopped"]) == "stopped"
    # A failure is the fault, whatever else happened (torchrun stops the survivors of it).
    assert run_state(["failed", "stopped", "stopped"]) == "failed"
    # The next elastic generation reports: active again.
    assert run_state(["running", "stopped"]) == "active"
    report = health_report("r", [], ["stopped", "finished"], evaluated_at=5.0, up=0)
    assert (report["status"], report["state"]) == ("ok", "stopped")
    assert report["states"]["stopped"] == 1


def _spike(rule: str) -> Verdict:
    return Verdict.model_validate(
        {
            "rule": rule,
            "status": "warning",
            "summary": f"{rule} at step 150",
            "evidence": {"ranks_affected": 1, "ranks": [{"rank": 2, "step": 150}]},
            "thresholds": {"window_s": 600.0},
        }
    )


def test_a_run_that_finished_normally_reads_its_spikes_as_history() -> None:
    # The audit's healthy run: 3 DDP ranks, the last one given the epoch's 1-sample
    # remainder, finished normally with grad_norm_spike and origin_outlier in the window.
    spikes = [_spike(rule) for rule in HISTORY_RULES]
    verdicts = [_verdict("lost_rank", "ok"), *spikes]
    report = health_report("r", verdicts, ["finished"] * 3, evaluated_at=5.0, up=0)
    assert (report["status"], report["state"]) == ("ok", "finished")
    for before, after in zip(spikes, report["verdicts"][1:], strict=True):
        assert after.status == "ok"
        assert after.summary == f"history, the run finished normally since: {before.summary}"
        assert after.evidence == {**before.evidence, "history": True, "was": "warning"}
        assert after.thresholds == before.thresholds
    # An exporter's JSON (the merge of several, or an older exporter's warning) alike, and
    # a verdict already read as history stays as it is.
    dumped = [v.model_dump() for v in report["verdicts"]] + [spikes[0].model_dump()]
    again = health_report("r", dumped, ["finished"] * 3, evaluated_at=5.0, up=0)
    assert again["status"] == "ok"
    assert again["verdicts"][:-1] == dumped[:-1]
    assert again["verdicts"][-1]["summary"] == report["verdicts"][1].summary


def test_lasting_faults_and_unfinished_runs_keep_their_warnings() -> None:
    spikes = [_spike(rule) for rule in HISTORY_RULES]
    # A fault that outlives the run (the weights took an inf/NaN update, replicas diverged,
    # a device's transient fault, steps skipped) says how it ended: it stays.
    for rule in ("nonfinite_update_applied", "replica_divergence", "transient_fault",
                 "skip_storm", "scale_collapse"):  # fmt: skip
        report = health_report(
            "r", [*spikes, _verdict(rule, "warning")], ["finished"], evaluated_at=5.0, up=0
        )
        assert report["status"] == "warning", rule
        assert [v.status for v in report["verdicts"]] == ["ok"] * len(spikes) + ["warning"]
    # A failed run's spike may be what killed it; a live run's may still grow into a fault.
    for states in (["finished", "failed"], ["running", "finished"]):
        report = health_report("r", spikes, states, evaluated_at=5.0, up=1)
        assert report["verdicts"] == spikes, states
        assert report["status"] == "warning", states


def test_an_elastic_run_that_shrank_and_finished_reads_its_spikes_as_history() -> None:
    # World 8 -> 7: the old generation's rank 7 stays stopped (until its retention) while
    # the new generation of ranks 0-6 finished. The training completed.
    spikes = [_spike(rule) for rule in HISTORY_RULES]
    states = ["finished"] * 7 + ["stopped"]
    assert finished_normally(states)
    report = health_report("r", spikes, states, evaluated_at=5.0, up=0)
    assert report["status"] == "ok"
    assert all(v.evidence["history"] for v in report["verdicts"])
    # A preemption stopped every rank: not completed, the spikes still warn.
    assert not finished_normally(["stopped"] * 8)
    stopped = health_report("r", spikes, ["stopped"] * 8, evaluated_at=5.0, up=0)
    assert stopped["status"] == "warning"


def test_history_judged_by_one_exporter_warns_again_for_a_run_that_did_not_finish() -> None:
    # Node A's ranks finished and its exporter read its spike as history; node B's rank
    # failed (or still runs): the whole run did not finish normally, and the merge's
    # roll-up brings the warning back as it was.
    spike = _spike("loss_spike")
    judged_by_a = as_history(spike.model_dump())
    for states in (["finished", "finished", "failed"], ["finished", "running"]):
        report = health_report("r", [judged_by_a], states, evaluated_at=5.0, up=1)
        assert report["status"] == "warning", states
        assert report["verdicts"] == [spike.model_dump()], states
    # An older exporter's history carries no "was": it was a warning.
    older = {**judged_by_a, "evidence": {k: v for k, v in judged_by_a["evidence"].items()
                                         if k != "was"}}  # fmt: skip
    report = health_report("r", [older], ["running"], evaluated_at=5.0, up=1)
    assert report["verdicts"][0]["status"] == "warning"
