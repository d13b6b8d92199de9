"""A run's roll-up: the worst verdict, finished only when every rank finished."""

from __future__ import annotations

from ampscope.verdicts.rollup import health_report, run_ended, run_state
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
