"""The ranks as Prometheus holds them: those gone within the last hour, and the thresholds
the exporters publish. Pure functions over query results, so hand-made samples drive them."""

from __future__ import annotations

from typing import Any

from ampscope.status.prometheus.ranks import (
    build_views,
    down_seen_query,
    exporters_down,
    gone_query,
    gone_ranks,
    narrowed,
    not_running,
    other_state_query,
    seen_query,
    state_query,
    thresholds_of,
    up_query,
    without_packed,
)
from ampscope.verdicts.thresholds import Thresholds

NOW = 1_700_000_000.0


def _sample(name: str, rank: int, value: float, **labels: str) -> dict[str, Any]:
    metric = {"__name__": name, "run": "r", "node": f"n{rank // 2}", "rank": str(rank),
              "local_rank": str(rank % 2), "instance": f"h{rank // 2}:9478", **labels}  # fmt: skip
    return {"metric": metric, "value": [NOW, str(value)]}


def _seen(
    rank: int, heard: float, step: int, finished: float | None = None, failed: bool = False
) -> list[dict]:
    samples = [
        _sample("ampscope_rank_info", rank, 1.0, mode="scaler", world_size="4"),
        _sample("ampscope_last_report_timestamp_seconds", rank, heard),
        _sample("ampscope_last_step", rank, step),
        _sample("ampscope_steps_total", rank, step),
    ]
    if finished is not None:
        samples.append(_sample("ampscope_rank_state", rank, finished, state="finished"))
    if failed:
        samples.append(_sample("ampscope_rank_state", rank, 1.0, state="failed"))
        samples.append(_sample("ampscope_rank_failure_info", rank, 1.0, kind="exception",
                               exception="RuntimeError", origin="yes"))  # fmt: skip
    return samples


def test_a_rank_gone_within_the_hour_is_lost_unless_it_had_finished() -> None:
    now = build_views(_seen(0, NOW - 1, 50), NOW)
    for view in now.values():
        view["up"], view["state"] = True, "running"
    seen = [*_seen(0, NOW - 1, 50), *_seen(2, NOW - 40, 31, finished=0.0),
            *_seen(3, NOW - 900, 60, finished=1.0)]  # fmt: skip
    gone = gone_ranks(seen, now, NOW)
    assert sorted(gone) == [("r", 2), ("r", 3)]  # rank 0 is there now
    lost, done = gone[("r", 2)], gone[("r", 3)]
    assert (lost["state"], lost["up"], lost["step"], lost["node"]) == ("lost", False, 31, "n1")
    assert lost["seconds_since_report"] == 40.0
    assert lost["totals"]["steps"] == 31
    assert (done["state"], done["up"]) == ("finished", False)


def test_a_rank_gone_after_it_failed_stays_failed_with_its_failure() -> None:
    seen = [*_seen(0, NOW - 1, 50), *_seen(1, NOW - 30, 12, failed=True)]
    gone = gone_ranks(seen, build_views(_seen(0, NOW - 1, 50), NOW), NOW)
    assert sorted(gone) == [("r", 1)]
    failed = gone[("r", 1)]
    assert (failed["state"], failed["up"], failed["step"]) == ("failed", False, 12)
    assert failed["failure"] == {
        "kind": "exception",
        "exception": "RuntimeError",
        "message": None,
        "step": 12,
        "origin_ranks": [1],
        "seen_by": None,
    }


def test_a_rank_gone_after_its_launcher_stopped_it_stays_stopped() -> None:
    # An elastic restart shrank the world: rank 3's last state was stopped (SIGTERM), and its
    # series went with its exporter's retention or its node. Not lost: it said goodbye.
    stopped = _sample("ampscope_rank_state", 3, 1.0, state="stopped")
    seen = [*_seen(0, NOW - 1, 50), *_seen(3, NOW - 600, 40), stopped]
    gone = gone_ranks(seen, build_views(_seen(0, NOW - 1, 50), NOW), NOW)
    assert sorted(gone) == [("r", 3)]
    assert (gone[("r", 3)]["state"], gone[("r", 3)]["up"]) == ("stopped", False)


def test_the_exporters_whose_scrape_fails_are_named_per_run() -> None:
    up = [
        {"metric": {"__name__": "up", "instance": "h0:9478", "job": "a"}, "value": [NOW, "1"]},
        {"metric": {"__name__": "up", "instance": "h1:9478", "job": "a"}, "value": [NOW, "0"]},
    ]
    seen = [*_seen(0, NOW, 5), *_seen(2, NOW - 9, 5)]
    assert exporters_down(up, seen) == {"r": ["h1:9478"]}
    assert exporters_down(up[:1], seen) == {}


def test_thresholds_are_the_ones_most_exporters_publish() -> None:
    def published(instance: str, **values: float) -> list[dict[str, Any]]:
        return [
            {"metric": {"threshold": name, "instance": instance}, "value": [NOW, str(value)]}
            for name, value in values.items()
        ]

    samples = [
        *published("a", stale_after_s=30, lost_critical_share=0.2, skip_storm_min_steps=4),
        *published("b", stale_after_s=30, lost_critical_share=0.5),
        *published("c", stale_after_s=90, lost_critical_share=0.5),
    ]
    t, source = thresholds_of(samples)
    assert source == "exporters"
    assert (t.stale_after_s, t.lost_critical_share) == (30.0, 0.5)
    assert t.skip_storm_min_steps == 4
    assert isinstance(t.skip_storm_min_steps, int)
    assert t.stall_after_s == Thresholds().stall_after_s  # published by none: the default
    # None published (older exporters), or nothing that holds together: the defaults.
    assert thresholds_of([]) == (Thresholds(), "defaults")
    assert thresholds_of(published("a", collapse_factor=0.5)) == (Thresholds(), "defaults")


def test_the_lookback_queries_restore_each_familys_name() -> None:
    query = seen_query('run="r"')
    assert query.startswith(
        'label_replace(label_replace(last_over_time(ampscope_rank_info{run="r"}[3600s]), '
        '"__name__", "ampscope_rank_info", "", ""), "family", "ampscope_rank_info", "", "") '
        "or "
    )
    assert 'ampscope_rank_state{state=~"finished|failed|stopped",run="r"}[3600s]' in query
    assert '"ampscope_rank_failure_info", "", "")' in query
    assert up_query("") == "up == 0"


def test_the_hours_range_reads_are_narrowed_to_the_gone_ranks_and_failing_exporters() -> None:
    """At scale the hour's range read of every rank's families cost more than the gauges:
    one family finds the gone ranks, then only theirs are read (and the failing exporters')."""
    gone = gone_query('run="r"')
    assert gone == (
        'label_replace(last_over_time(ampscope_rank_info{run="r"}[3600s]) unless on (run, rank) '
        'ampscope_rank_info{run="r"}, "__name__", "ampscope_rank_info", "", "")'
    )
    # Regex metacharacters in a run name match themselves; several runs give a superset.
    narrowed_to = narrowed("", [("a.b", 3), ("c", 12)])
    assert narrowed_to == 'run=~"a\\\\.b|c",rank=~"12|3"'
    assert 'ampscope_rank_info{run=~"a\\\\.b|c",rank=~"12|3"}[3600s]' in seen_query(narrowed_to)
    assert down_seen_query('run="r"', ["n1:9478", "n0:9478"]) == (
        'label_replace(last_over_time(ampscope_rank_info{run="r",instance=~"n0:9478|n1:9478"}'
        '[3600s]), "__name__", "ampscope_rank_info", "", "")'
    )


def test_only_the_ranks_not_running_have_their_other_states_read() -> None:
    """The first round reads one state series a rank (``running``'s); the ranks at 0 there
    are the only ones whose four other states the second round reads."""
    assert state_query('run="r"') == 'ampscope_rank_state{state="running",run="r"}'
    assert 'ampscope_rank_state{state!="running",run="r"} == 1' in other_state_query('run="r"')
    running = [
        _sample("ampscope_rank_state", 0, 1.0, state="running"),
        _sample("ampscope_rank_state", 1, 0.0, state="running"),
        _sample("ampscope_rank_state", 2, 1.0, state="running"),
        _sample("ampscope_rank_state", 3, 0.0, state="running"),
    ]
    assert not_running(running) == {("r", 1), ("r", 3)}
    # Rank 1 failed, rank 3 finished: the second round's answer completes the states.
    others = [
        _sample("ampscope_rank_state", 1, 1.0, state="failed"),
        _sample("ampscope_rank_state", 3, 1.0, state="finished"),
    ]
    info = [_sample("ampscope_rank_info", r, 1.0, mode="scaler", world_size="4") for r in range(4)]
    views = build_views(info + running + others, NOW)
    assert [views[("r", r)]["state"] for r in range(4)] == [
        "running",
        "failed",
        "running",
        "finished",
    ]


def test_the_separate_aligned_pair_is_read_only_for_scalers_without_the_packed_sample() -> None:
    """A watch has no aligned scale; a scaler with the packed sample needs no separate pair:
    only a scaler without it (an exporter that predates it, or no aligned step yet) is
    named, by (run, rank)."""
    samples = [
        _sample("ampscope_rank_info", 0, 1.0, mode="scaler", world_size="4"),
        _sample("ampscope_loss_scale_aligned_packed", 0, 10.5),
        _sample("ampscope_rank_info", 1, 1.0, mode="scaler", world_size="4"),
        _sample("ampscope_rank_info", 2, 1.0, mode="watch", world_size="4"),
        _sample("ampscope_rank_info", 3, 1.0, world_size="4"),  # predates the mode: a scaler
    ]
    assert without_packed(samples) == {("r", 1), ("r", 3)}
    assert without_packed(samples[:2]) == set()
