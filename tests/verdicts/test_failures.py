"""The ``rank_failed`` rule over failed ranks, as every caller builds them."""

from __future__ import annotations

from ampscope.verdicts.failures import FailedFacts, rank_failed


def _failed(
    rank: int,
    *,
    step: int = 5,
    kind: str = "nonfinite_gradients",
    exception: str = "NonFiniteGradientsError",
    message: str | None = "ampscope: non-finite gradients at step 5",
    origin: tuple[int, ...] | None = (1,),
) -> FailedFacts:
    return FailedFacts(
        rank=rank,
        node=f"n{rank // 4}",
        kind=kind,
        exception=exception,
        message=message,
        step=step,
        origin_ranks=origin,
    )


def test_no_failed_rank_is_ok() -> None:
    verdict = rank_failed([], 8)
    assert (verdict.status, verdict.summary, verdict.evidence) == (
        "ok",
        "no rank of 8 failed",
        {"failed": 0},
    )


def test_a_non_finite_stop_names_the_ranks_the_step_and_the_union_of_origins() -> None:
    # Each rank names what it knows: rank 0 only itself (its gather failed), rank 1 its own.
    verdict = rank_failed([_failed(1, origin=(1,)), _failed(0, origin=()), _failed(2)], 4)
    assert verdict.status == "critical"
    assert verdict.summary == (
        "3 of 4 rank(s) failed (rank(s) 0, 1, 2): training stopped on inf/NaN gradients at "
        "step 5 (NonFiniteGradientsError); origin rank(s) 1"
    )
    evidence = verdict.evidence
    assert (evidence["failed"], evidence["step"], evidence["kind"]) == (3, 5, "nonfinite_gradients")
    assert (evidence["origin_tracked"], evidence["origin_ranks"]) == (True, [1])
    assert [r["rank"] for r in evidence["ranks"]] == [0, 1, 2]
    assert evidence["ranks"][0]["message"] == "ampscope: non-finite gradients at step 5"


def test_origin_untracked_or_clean_is_said_as_such() -> None:
    untracked = rank_failed([_failed(0, origin=None)], 1)
    assert untracked.summary.endswith(
        "; origin not tracked (attach(model, track_origin=True) names it)"
    )
    assert (untracked.evidence["origin_tracked"], untracked.evidence["origin_ranks"]) == (
        False,
        [],
    )
    clean = rank_failed([_failed(0, origin=())], 1)
    assert clean.summary.endswith("; no rank's own gradients held inf/NaN before the reduction")


def test_another_exception_is_named_with_its_message_after_its_step() -> None:
    boom = _failed(
        3, step=7, kind="exception", exception="RuntimeError", message="CUDA error:\n  boom"
    )
    later = _failed(0, step=9, kind="exception", exception="KeyError", message="'x'")
    verdict = rank_failed([later, boom], 4)
    assert verdict.summary == (
        "2 of 4 rank(s) failed (rank(s) 0, 3): rank 3 (node n0) ended on RuntimeError after "
        "step 7: CUDA error: boom"
    )
    assert (verdict.evidence["step"], verdict.evidence["exception"]) == (7, "RuntimeError")
    assert "origin_ranks" not in verdict.evidence
    # From Prometheus no message is known: the summary says no more than it knows.
    quiet = rank_failed([_failed(2, kind="exception", exception="OSError", message=None)], 2)
    assert quiet.summary.endswith("rank 2 (node n0) ended on OSError after step 5")


def test_a_long_message_and_many_ranks_are_cut() -> None:
    many = [
        _failed(r, kind="exception", exception="RuntimeError", message="x" * 500) for r in range(20)
    ]
    verdict = rank_failed(many, 20)
    assert "(rank(s) 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15 and 4 more)" in (
        verdict.summary
    )
    assert verdict.summary.endswith(": " + "x" * 199 + "…")
    assert len(verdict.evidence["ranks"]) == 16
    assert verdict.evidence["ranks"][0]["message"] == "x" * 500
