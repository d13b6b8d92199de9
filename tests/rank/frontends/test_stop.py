"""The words every rank stops with: built from the gathered reports alone."""

from __future__ import annotations

import json

import pytest

from ampscope.rank.frontends.stop import (
    MESSAGE_PARAMS,
    RankReport,
    build_error,
    decode,
    encode,
    gather,
    own_params,
    unknown,
)


def _reports() -> list[RankReport]:
    return [
        RankReport(rank=0, origin=False, local=True, params=(("w", 4),)),
        RankReport(rank=1, origin=True, local=True, params=(("w", 9), ("b", 4))),
        RankReport(rank=2, origin=True, local=False, params=()),
    ]


def test_the_message_names_origin_local_ranks_and_top_parameters() -> None:
    error = build_error(_reports(), 7, "policy 'raise'")
    assert error.step == 7
    assert error.origin_ranks == (1, 2)
    assert error.local_ranks == (0, 1)
    # Most elements first; ties by name, then rank.
    assert error.params == ((1, "w", 9), (1, "b", 4), (0, "w", 4))
    assert str(error) == (
        "ampscope: non-finite gradients at step 7: policy 'raise'. Origin rank(s): 1, 2. "
        "Local gradients held inf/NaN on rank(s) 0, 1. "
        "Top parameters: w (9 on rank 1), b (4 on rank 1), w (4 on rank 0)."
    )


def test_untracked_origin_and_a_clean_origin_are_told_apart() -> None:
    untracked = [RankReport(rank=0, origin=None, local=True, params=())]
    assert build_error(untracked, 1, "r").origin_ranks is None
    assert "Origin not tracked" in str(build_error(untracked, 1, "r"))
    clean = [RankReport(rank=0, origin=False, local=True, params=())]
    assert build_error(clean, 1, "r").origin_ranks == ()
    assert "No rank's own gradients" in str(build_error(clean, 1, "r"))


def test_one_process_gathers_its_own_report_and_names_at_most_the_top() -> None:
    report = RankReport(rank=0, origin=None, local=True, params=())
    assert gather(report, None) == ([report], True)
    counts = {f"p{i}": i for i in range(1, 10)}
    assert own_params(counts) == tuple((f"p{i}", i) for i in range(9, 9 - MESSAGE_PARAMS, -1))


def test_a_report_travels_as_json_and_comes_back_equal() -> None:
    rerun = RankReport(0, True, True, (), rerun="reproducible", batch_ids=(7, "doc-1"))
    for report in [*_reports(), unknown(3), RankReport(0, None, False, (("é.w", 1),)), rerun]:
        assert decode(encode(report)) == report
    assert json.loads(encode(_reports()[1])) == [
        1,
        True,
        True,
        [["w", 9], ["b", 4]],
        True,
        None,
        [],
    ]
    for bad in (
        b"",
        b"[1, 2]",
        b'["0", null, false, [], true, null, []]',
        b"[0, null, 1, [], true, null, []]",
        b'[0, null, false, [], true, "maybe", []]',
        b"[0, null, false, [], true, null, [1.5]]",
    ):
        with pytest.raises((ValueError, TypeError)):
            decode(bad)


def test_the_message_says_what_the_rerun_found_on_each_rank() -> None:
    reports = [
        RankReport(0, False, False, ()),
        RankReport(1, True, True, (), rerun="transient"),
        RankReport(2, True, True, (), rerun="reproducible", batch_ids=(203, 204)),
    ]
    error = build_error(reports, 9, "r")
    assert (error.reproduced_ranks, error.transient_ranks) == ((2,), (1,))
    message = str(error)
    assert (
        "Reproducible: the rerun from the same batch reproduced it on rank(s) 2: suspect the "
        "data or the numerics of step 9. Batch ids noted at step 9: rank 2: 203, 204."
    ) in message
    assert (
        "Transient on rank(s) 1: the rerun did not reproduce that rank's result: suspect its "
        "device."
    ) in message
    plain = build_error(reports[:1], 9, "r")
    assert (plain.reproduced_ranks, plain.transient_ranks) == ((), ())
    assert "rerun" not in str(plain)


def test_a_rank_alone_speaks_for_itself_only() -> None:
    clean = [RankReport(rank=2, origin=False, local=True, params=(("w", 1),))]
    error = build_error(clean, 4, "r", gathered=False)
    assert error.gathered is False
    assert (error.origin_ranks, error.local_ranks) == ((), (2,))
    assert str(error) == (
        "ampscope: non-finite gradients at step 4: r. This is rank 2's view only: the "
        "ranks' reports could not be gathered. Rank 2's own gradients held no inf/NaN "
        "before the reduction. Local gradients held inf/NaN on rank(s) 2. "
        "Top parameters: w (1 on rank 2)."
    )
    origin = [RankReport(rank=1, origin=True, local=True, params=())]
    assert "Origin rank(s): 1." in str(build_error(origin, 4, "r", gathered=False))


def test_a_rank_that_could_not_report_is_named_and_not_spoken_for() -> None:
    reports = [RankReport(rank=0, origin=False, local=False, params=()), unknown(1)]
    error = build_error(reports, 5, "r")
    assert (error.origin_ranks, error.local_ranks, error.gathered) == ((), (), True)
    assert str(error) == (
        "ampscope: non-finite gradients at step 5: r. Rank(s) 1 could not report (ampscope "
        "failed there). No reporting rank's own gradients held inf/NaN before the reduction."
    )
