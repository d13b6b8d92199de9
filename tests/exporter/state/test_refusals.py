"""Refused requests summarised in the log by reason, at most once per interval: the injected
clock alone decides when a summary is due."""

from __future__ import annotations

import logging

import pytest

from ampscope.exporter.state.ingest_counters import IngestStats
from ampscope.exporter.state.refusals import RefusalLog
from exporter.factory import FakeClock


def _summaries(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage().split(" (the next")[0] for r in caplog.records]


def test_the_first_refusal_at_once_then_one_summary_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="test.refusals")
    clock = FakeClock()
    refusals = RefusalLog(logging.getLogger("test.refusals"), interval_s=60.0, clock=clock)
    stats = IngestStats(refusals)

    stats.rejected("token_wrong")
    assert _summaries(caplog) == [
        "refused 1 request(s) by reason: 1 token_wrong (ranks send another token than "
        "--token-file holds)"
    ]
    for reason in ("token_wrong", "invalid", "token_wrong", "busy"):
        stats.rejected(reason)
    clock.advance(59.9)
    refusals.flush()
    assert len(caplog.records) == 1  # within the interval: counted, not logged

    clock.advance(0.1)
    refusals.flush()  # the interval has passed: the summary, with no new refusal needed
    assert _summaries(caplog)[1] == (
        "refused 4 request(s) by reason: 2 token_wrong, 1 invalid, 1 busy (ranks send another "
        "token than --token-file holds; records that fail the schema: a reporter of another "
        "ampscope version?)"
    )
    refusals.flush()
    clock.advance(120.0)
    refusals.flush()
    assert len(caplog.records) == 2  # nothing pending: nothing to say

    stats.rejected("too_large")  # a quiet interval passed: logged at once again
    clock.advance(1.0)
    stats.rejected("too_large")
    assert _summaries(caplog)[2:] == ["refused 1 request(s) by reason: 1 too_large"]
    refusals.flush(final=True)  # shutdown: whatever is pending
    assert _summaries(caplog)[3:] == ["refused 1 request(s) by reason: 1 too_large"]
    assert refusals.summaries == 4
    assert stats.rejections()["too_large"] == 2  # the counters count every one


def test_without_a_refusal_log_the_counters_still_count() -> None:
    stats = IngestStats()
    stats.rejected("malformed")
    assert stats.rejections()["malformed"] == 1
