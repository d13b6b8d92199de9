"""The exporter's spikes: each rank's windows, the run's origin board, the three verdicts."""

from __future__ import annotations

import random

import pytest

from ampscope.exporter.health import evaluate
from ampscope.exporter.state.ranks import RankSnapshot, RankState
from ampscope.exporter.state.spike_windows import OriginBoard, SpikeCounts
from ampscope.exporter.state.store import Store, StoreLimits
from ampscope.reporter.schema import OriginGroup, RankFailure, Setup, StepRecord
from ampscope.verdicts.thresholds import Thresholds
from exporter.factory import T0, batch, record, stats, totals

T = Thresholds()


def _noisy(n: int, seed: int = 0, level: float = 2.0) -> list[float]:
    """A noisy but stable loss: 2 +- 2.5%."""
    rng = random.Random(seed)
    return [rng.gauss(level, level * 0.025) for _ in range(n)]


def _records(values: list[float | None], rank: int = 0, **kw: object) -> list[StepRecord]:
    return [
        record(i + 1, rank=rank, stats=None if v is None else stats(v, **kw))  # type: ignore[arg-type]
        for i, v in enumerate(values)
    ]


def _state(records: list[StepRecord], now: float = T0) -> RankState:
    state = RankState(history_length=1024)
    state.apply_batch(records, 0, now)
    return state


def _verdict(ranks: list[RankSnapshot], rule: str, now: float) -> dict:
    (verdict,) = [v for v in evaluate("run-a", ranks, now, T).verdicts if v.rule == rule]
    return verdict.model_dump()


def test_a_noisy_stable_series_has_no_spike() -> None:
    state = _state(_records(_noisy(500)))
    assert state.spikes.counts == SpikeCounts()
    snap = state.snapshot()
    for rule in ("loss_spike", "grad_norm_spike", "origin_outlier"):
        assert _verdict([snap], rule, T0)["status"] == "ok"


def test_a_loss_spike_is_found_with_its_baseline() -> None:
    values: list[float | None] = list(_noisy(60))
    values[40] = None  # an overflow iteration: neither judged nor part of the window
    values.append(9.0)  # step 61
    records = _records(values)
    top = {"layers.3.wo.weight": 7.5, "layers.3.wi.weight": 1.0}
    records[-1] = record(61, stats=stats(9.0, grad_norm=2.0, top=top))
    state = _state(records)
    assert state.spikes.counts == SpikeCounts(loss=1)
    (spike,) = state.spikes.recent
    finite = [v for v in values[:60] if v is not None]  # the window: 59 values, no overflow
    assert spike.step == 61
    assert spike.value == 9.0
    assert spike.mean == pytest.approx(sum(finite) / 59)
    assert spike.median == pytest.approx(sorted(finite)[29])
    assert spike.top_params == (("layers.3.wo.weight", 7.5), ("layers.3.wi.weight", 1.0))

    v = _verdict([state.snapshot()], "loss_spike", T0)
    assert v["status"] == "warning"
    assert v["summary"].startswith("loss spiked on rank 0 (node node0) at step 61: 9 against")
    assert "largest parameter gradient: layers.3.wo.weight (7.5)" in v["summary"]
    (hit,) = v["evidence"]["ranks"]
    assert (hit["rank"], hit["step"], hit["value"], hit["spikes"]) == (0, 61, 9.0, 1)
    assert hit["mean"] == pytest.approx(spike.mean)
    assert v["thresholds"]["sigmas"] == 6.0
    assert v["thresholds"]["window_s"] == 600.0


def test_the_verdict_fires_within_its_window_only_and_a_finished_run_reads_it_as_history() -> None:
    state = _state(_records([*_noisy(30), 50.0]))
    # Later clean steps, received 500 s and 700 s after the spike.
    state.apply_batch(_records([*_noisy(30), 50.0, *_noisy(5, seed=1)])[31:33], 0, T0 + 500)
    assert _verdict([state.snapshot()], "loss_spike", T0 + 599)["status"] == "warning"
    assert _verdict([state.snapshot()], "loss_spike", T0 + 601)["status"] == "ok"

    finished = _state(_records([*_noisy(30), 50.0]))
    finished.finished_at = T0 + 10
    snap = finished.snapshot()
    # Evaluated as of its end, however long it is then held; the run went on from the spike
    # and finished normally: history, the run ok (an epilogue's `ampscope status` exits 0).
    v = _verdict([snap], "loss_spike", T0 + 3000)
    assert v["status"] == "ok"
    assert v["summary"].startswith(
        "history, the run finished normally since: loss spiked on rank 0 (node node0) at step 31"
    )
    assert v["evidence"]["history"] is True
    assert v["evidence"]["ranks"][0]["step"] == 31
    assert evaluate("run-a", [snap], T0 + 3000, T).status == "ok"

    # A run that failed keeps it: the spike may be what killed it.
    failed = _state(_records([*_noisy(30), 50.0]))
    failed.finished_at = T0 + 10
    failed.failure = RankFailure(
        kind="exception", exception="RuntimeError", message="boom", step=31, seen_by="uncaught"
    )
    assert _verdict([failed.snapshot()], "loss_spike", T0 + 3000)["status"] == "warning"


def test_a_restart_starts_the_windows_and_counts_afresh() -> None:
    state = _state(_records([*_noisy(30), 50.0]))
    assert state.spikes.counts.loss == 1
    restarted = record(1, time=T0 + 1000, stats=stats(2.0), total=totals(1))
    state.apply_batch([restarted], 0, T0 + 1000)
    assert state.restarts == 1
    assert state.spikes.counts == SpikeCounts()
    # 19 values are not a window yet (min_window 20): no spike, however large.
    later = [record(s, time=T0 + 1000 + s, stats=stats(2.0), total=totals(s)) for s in range(2, 20)]
    state.apply_batch([*later, record(20, time=T0 + 1020, stats=stats(99.0))], 0, T0 + 1020)
    assert state.spikes.counts == SpikeCounts()


def test_grad_norm_spike_names_the_step_once_for_every_rank() -> None:
    norms = [*_noisy(40, level=1.0), 30.0]
    ranks = [
        _state([record(i + 1, rank=r, stats=stats(2.0, grad_norm=v)) for i, v in enumerate(norms)])
        for r in range(4)
    ]
    for state in ranks:
        assert state.spikes.counts == SpikeCounts(grad_norm=1)
    v = _verdict([s.snapshot() for s in ranks], "grad_norm_spike", T0)
    assert v["status"] == "warning"
    assert v["summary"].startswith("gradient norm spiked at step 41: 30 against a baseline mean")
    assert "seen by 4 rank(s); 1 spike iteration(s) within 600 s" in v["summary"]
    (step,) = v["evidence"]["steps"]
    assert (step["step"], step["value"], step["ranks"]) == (41, 30.0, [0, 1, 2, 3])
    assert v["evidence"]["spikes"] == 1
    assert _verdict([s.snapshot() for s in ranks], "loss_spike", T0)["status"] == "ok"


def test_the_origin_board_compares_ranks_at_equal_steps_whatever_their_order() -> None:
    board = OriginBoard(factor=10.0)
    # The outlier arrives first: nothing to compare it with yet.
    assert board.observe(2, 50, 40.0) == []
    (found,) = board.observe(0, 50, 1.0)  # two ranks: 40 > 10 x 1
    assert (found.rank, found.step, found.median, found.compared) == (2, 50, 1.0, 1)
    assert board.observe(0, 50, 1.0) == []  # rank 2 at step 50 counts once
    assert board.observe(1, 50, 3.0) == []
    assert board.observe(3, 50, 2.0) == []
    # No outlier when the norms are close, and none against a median of zero.
    assert [board.observe(r, 51, v) for r, v in enumerate([1.0, 9.0, 1.5])] == [[], [], []]
    # With three ranks or more, a step waits for three: one low rank cannot make another
    # look like an outlier.
    assert board.observe(0, 60, 0.01, ranks=4) == []
    assert board.observe(1, 60, 1.0, ranks=4) == []
    assert board.observe(2, 60, 1.1, ranks=4) == []
    assert board.observe(0, 52, 0.0) == []
    assert board.observe(1, 52, 5.0) == []
    # None (an overflow, or no origin tracking) is no norm.
    assert board.observe(0, 53, None) == []


def test_the_origin_board_is_bounded_and_forgets_ranks() -> None:
    board = OriginBoard(factor=10.0, steps=4)
    for step in range(1, 9):
        board.observe(0, step, 1.0)
    assert board.observe(1, 2, 50.0) == []  # step 2 fell out of the ring: no peers left
    (hit,) = board.observe(1, 8, 50.0)
    assert (hit.rank, hit.step, hit.value, hit.median, hit.compared) == (1, 8, 50.0, 1.0, 1)
    board.forget(0)
    assert board.observe(1, 7, 50.0) == []  # rank 0's norms are gone


def test_a_job_resumed_from_an_older_checkpoint_is_compared_again() -> None:
    """Every rank restarts (forgotten) and reports steps below those the full board held:
    the emptied steps go, so the resumed steps are compared at once."""
    board = OriginBoard(factor=10.0, steps=4)
    for step in range(301, 311):
        for rank in range(4):
            board.observe(rank, step, 1.0, ranks=4)
    for rank in range(4):
        board.forget(rank)
    for rank in range(3):
        assert board.observe(rank, 101, 1.0, ranks=4) == []
    (hit,) = board.observe(3, 101, 10.0, ranks=4)  # exactly the factor: an outlier
    assert (hit.rank, hit.step, hit.median, hit.compared) == (3, 101, 1.0, 3)


def test_the_origin_board_compares_only_ranks_of_one_origin_group() -> None:
    """Pipeline stages (groups of one) whose norms differ x20 are never compared; two
    data-parallel replicas are; ranks that name no group (older reporters) are compared
    with each other as before, and never with grouped ones."""
    board = OriginBoard(factor=10.0)
    stages = [OriginGroup(first=r, size=1) for r in range(4)]
    for step in range(1, 21):
        for rank, norm in enumerate([0.09, 0.08, 0.14, 1.8]):
            assert board.observe(rank, step, norm, ranks=4, group=stages[rank]) == []
    # Two stages of two replicas each: only the replica of the head stage stands out. (A
    # group's first step here only tells the exporter its members: not judged.)
    pair_a, pair_b = OriginGroup(first=0, size=2), OriginGroup(first=2, size=2)
    for rank, norm in enumerate([0.1, 0.1, 2.0, 40.0]):
        assert board.observe(rank, 29, norm, ranks=4, group=[pair_a, pair_b][rank // 2]) == []
    assert board.observe(0, 30, 0.1, ranks=4, group=pair_a) == []
    assert board.observe(1, 30, 0.1, ranks=4, group=pair_a) == []
    assert board.observe(2, 30, 2.0, ranks=4, group=pair_b) == []  # x20 another group's
    (hit,) = board.observe(3, 30, 40.0, ranks=4, group=pair_b)
    assert (hit.rank, hit.step, hit.median, hit.compared) == (3, 30, 2.0, 1)
    # A group of three judges a step once three of its members reported it.
    trio = OriginGroup(first=0, size=3)
    for rank in range(3):
        assert board.observe(rank, 39, 1.0, ranks=4, group=trio) == []
    assert board.observe(0, 40, 0.01, ranks=4, group=trio) == []
    assert board.observe(1, 40, 1.0, ranks=4, group=trio) == []
    assert board.observe(2, 40, 1.1, ranks=4, group=trio) == []
    # A group spread over nodes, three of its eight members here: once known, a step waits
    # for the three (no early judgement of two).
    wide = OriginGroup(first=0, size=8)
    for rank in (0, 4, 5):
        assert board.observe(rank, 49, 1.0, ranks=4, group=wide) == []
    assert board.observe(0, 50, 1.0, ranks=4, group=wide) == []
    assert board.observe(4, 50, 12.0, ranks=4, group=wide) == []
    (hit,) = board.observe(5, 50, 1.2, ranks=4, group=wide)
    assert (hit.rank, hit.compared) == (4, 2)
    # Two of a group's four members on this node (the others on another): judged as a pair,
    # once both are known here; a group with one member here never is.
    split, alone = OriginGroup(first=8, size=4), OriginGroup(first=12, size=4)
    for step, norms in ((70, (1.0, 1.0, 1.0)), (71, (1.0, 30.0, 0.01))):
        assert board.observe(8, step, norms[0], ranks=4, group=split) == []
        found = board.observe(9, step, norms[1], ranks=4, group=split)
        assert board.observe(12, step, norms[2], ranks=4, group=alone) == []
    (hit,) = found
    assert (hit.rank, hit.step, hit.compared) == (9, 71, 1)
    # Older reporters: no group, compared with each other only.
    assert board.observe(0, 60, 1.0) == []
    assert board.observe(1, 60, 30.0, group=OriginGroup(first=1, size=1)) == []
    (hit,) = board.observe(2, 60, 30.0)
    assert (hit.rank, hit.median, hit.compared) == (2, 1.0, 1)


def test_a_rank_forgotten_leaves_its_group() -> None:
    board = OriginBoard(factor=10.0)
    pair = OriginGroup(first=0, size=2)
    board.observe(0, 1, 1.0, group=pair)
    board.forget(0)
    assert board.observe(1, 1, 50.0, group=pair) == []  # rank 0's norm is gone


def _store() -> Store:
    return Store(
        StoreLimits(
            max_runs=4, max_ranks_per_run=16, max_series=10_000, history_length=256, window_s=600.0
        )
    )


def _origin_run(store: Store, outlier_at: int, now: float = T0) -> None:
    """Four ranks of 60 steps; rank 2's own gradients are x20 the others' at ``outlier_at``."""
    rng = random.Random(3)
    for rank in (2, 0, 1, 3):  # the outlier's records arrive first
        records = [
            record(
                s,
                rank=rank,
                world_size=4,
                stats=stats(
                    2.0,
                    grad_norm=1.0,
                    origin=(20.0 if (rank, s) == (2, outlier_at) else rng.uniform(0.9, 1.1)),
                    top={"emb.weight": 19.0} if (rank, s) == (2, outlier_at) else None,
                ),
            )
            for s in range(1, 61)
        ]
        store.ingest(batch(*records), now)


def test_the_store_names_the_origin_outlier_once() -> None:
    store = _store()
    _origin_run(store, outlier_at=45)
    ranks = store.ranks("run-a")
    assert ranks is not None
    assert [snap.spike_counts.origin_outlier for snap in ranks] == [0, 0, 1, 0]
    (event,) = ranks[2].spikes
    # Judged once three ranks reported the step: the outlier's, then two others.
    assert (event.step, event.value, event.compared) == (45, 20.0, 2)
    assert event.top_params == (("emb.weight", 19.0),)
    v = _verdict(ranks, "origin_outlier", T0)
    assert v["status"] == "warning"
    ratio = 20.0 / event.median
    assert v["summary"].startswith(
        f"rank 2's own gradients were x{ratio:.3g} the median of the other ranks at step 45"
    )
    assert v["evidence"]["ranks"][0]["ratio"] == pytest.approx(ratio)
    assert v["thresholds"] == {"factor": 10.0, "window_s": 600.0}


def test_pipeline_stages_are_not_origin_outliers_but_a_replica_is() -> None:
    """Four ranks, two pipeline stages of two data-parallel replicas: the head stage's own
    norms are x20 the first stage's at every step (its parameters differ), and rank 3's
    are x20 its replica's at step 45. Only (45, rank 3) is an outlier and a suspect batch."""
    store = _store()
    for rank in range(4):
        group = OriginGroup(first=0 if rank < 2 else 2, size=2)
        records = [
            record(
                s,
                rank=rank,
                world_size=4,
                local_world_size=4,
                setup=Setup(mode="watch", policy="skip", origin_group=group),
                stats=stats(
                    2.0,
                    grad_norm=1.0,
                    origin=(0.1 if rank < 2 else 2.0) * (20 if (rank, s) == (3, 45) else 1),
                ),
            )
            for s in range(1, 61)
        ]
        store.ingest(batch(*records), T0)
    ranks = store.ranks("run-a")
    assert ranks is not None
    assert [snap.spike_counts.origin_outlier for snap in ranks] == [0, 0, 0, 1]
    (event,) = ranks[3].spikes
    assert (event.step, event.value, event.median, event.compared) == (45, 40.0, 2.0, 1)
    suspects = store.suspect_batches("run-a")
    assert suspects is not None
    assert [(s["step"], s["rank"], s["reasons"]) for s in suspects] == [(45, 3, ["origin_outlier"])]


def test_a_rank_that_repeats_is_named_with_its_count() -> None:
    store = _store()
    _origin_run(store, outlier_at=20)
    # The same rank again, at a later step.
    for rank in range(4):
        value = 30.0 if rank == 2 else 1.0
        store.ingest(batch(record(61, rank=rank, world_size=4, stats=stats(2.0, 1.0, value))), T0)
    ranks = store.ranks("run-a")
    assert ranks is not None
    v = _verdict(ranks, "origin_outlier", T0)
    assert (
        "rank 2's own gradients were x30 the median of the other ranks at step 61" in v["summary"]
    )
    assert "it stood out at 2 steps: its GPU or its data shard" in v["summary"]


def test_settings_carry_the_spike_thresholds_to_the_store() -> None:
    from ampscope.exporter.settings import Settings

    settings = Settings(spike_sigmas=3.0, spike_min_window=5, origin_outlier_factor=4.0)
    t = settings.thresholds()
    assert (t.spike_sigmas, t.spike_min_window, t.origin_outlier_factor) == (3.0, 5, 4.0)
    assert t.spike_rule().sigmas == 3.0
    with pytest.raises(ValueError, match="spike_min_window"):
        Settings(spike_min_window=200)
    with pytest.raises(ValueError, match="origin_outlier_factor"):
        Thresholds(origin_outlier_factor=1.0)


def test_settings_build_the_store_with_their_limits_and_spike_thresholds() -> None:
    from ampscope.exporter.settings import Settings

    settings = Settings(max_runs=3, spike_min_window=5, origin_outlier_factor=4.0)
    store = settings.store()
    assert (store.limits.max_runs, store.limits.window_s) == (3, settings.window_s)
    # A loss x5 after six steady values, and rank 2's own gradients x5 its peers': both
    # spikes under these settings, neither under the defaults (20 values, x10).
    for rank in range(4):
        records = [
            record(s, rank=rank, world_size=4, stats=stats(2.0, 1.0, 1.0 + 0.01 * rank))
            for s in range(1, 7)
        ]
        spike = rank == 2
        records.append(
            record(
                7,
                rank=rank,
                world_size=4,
                stats=stats(10.0 if spike else 2.0, 1.0, 5.0 if spike else 1.0),
            )
        )
        store.ingest(batch(*records), T0)
    ranks = store.ranks("run-a")
    assert ranks is not None
    assert [(s.spike_counts.loss, s.spike_counts.origin_outlier) for s in ranks] == [
        (0, 0),
        (0, 0),
        (1, 1),
        (0, 0),
    ]
