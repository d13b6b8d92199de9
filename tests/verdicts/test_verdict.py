"""Statuses, their order and the rules' report order: one definition read everywhere."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ampscope.verdicts.verdict import FP8_RULES, RULES, SEVERITY, Verdict, in_report_order, worst


def test_severity_orders_the_statuses_as_exit_statuses() -> None:
    assert SEVERITY == {"ok": 0, "warning": 1, "critical": 2}
    assert worst(["ok", "critical", "warning"]) == "critical"
    assert worst(["warning", "ok"]) == "warning"
    assert worst([]) == "ok"


def test_report_order_puts_rules_this_version_does_not_know_last() -> None:
    assert RULES[:3] == ("scale_collapse", "skip_storm", "scale_desync")
    assert len(set(RULES)) == len(RULES) == 20
    # A rank's end comes right after the liveness rules: read before what led to it.
    assert RULES[5:8] == ("stalled_rank", "stopped_rank", "rank_failed")
    assert RULES[-3:] == FP8_RULES  # listed after the rules every run reports
    given = ["newer_rule", "lost_rank", "scale_collapse", "lost_rank"]
    assert in_report_order(given) == ["scale_collapse", "lost_rank", "newer_rule"]


def test_the_verdict_model_takes_only_known_rules_and_statuses() -> None:
    fine = {"rule": "lost_rank", "status": "ok", "summary": "", "evidence": {}, "thresholds": {}}
    assert Verdict.model_validate(fine).rule == "lost_rank"
    for bad in ({"rule": "no_such_rule"}, {"status": "fine"}):
        with pytest.raises(ValidationError):
            Verdict.model_validate({**fine, **bad})
