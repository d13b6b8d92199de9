"""The batch ledger through the store: the ids behind each flagged (step, rank)."""

from __future__ import annotations

from ampscope.exporter.state.batches import BatchLedger
from ampscope.exporter.state.store import Store, StoreLimits
from ampscope.reporter.schema import BatchIds
from exporter.factory import batch, record, stats, totals, watch


def _store() -> Store:
    limits = StoreLimits(
        window_s=600.0, history_length=64, max_runs=4, max_ranks_per_run=8, max_series=10_000
    )
    return Store(limits, origin_factor=10.0)


def _ids(rank: int, step: int) -> BatchIds:
    return BatchIds(ids=[rank * 1000 + step, f"doc-{rank}-{step}"], left_out=rank)


def _rank_records(rank: int, last: int, **at: dict) -> list:
    """Steps 1..last of ``rank`` (world of 4 on one node), each with its ids and a steady
    loss, gradient norm and own norm; ``at[step]`` overrides a step's fields."""
    out = []
    for step in range(1, last + 1):
        fields = {
            "stats": stats(1.0 + 0.01 * (step % 5), origin=1.0 + 0.01 * (step % 3)),
            **at.get(str(step), {}),
        }
        origin = fields.pop("found_inf_origin", {})
        made = record(step, rank=rank, world_size=4, local_world_size=4, batch=_ids(rank, step),
                      **fields)  # fmt: skip
        out.append(made.model_copy(update={"found_inf_origin": origin}))
    return out


def test_each_flag_names_the_rank_and_its_ids() -> None:
    store = _store()
    spike = {"stats": stats(50.0, grad_norm=1.0, origin=40.0)}
    nan = {
        "skipped": True,
        "found_inf_origin": {"cpu": True},
        "stats": stats(None, None, None),
    }
    for rank in range(4):
        at = {"30": spike, "12": nan} if rank == 2 else {}
        store.ingest(batch(*_rank_records(rank, 30, **at)), now=1.0)
    # A rank without origin tracking that skipped: any rank's batch may be the cause.
    store.ingest(
        batch(record(1, run="plain", rank=0, skipped=True, batch=BatchIds(ids=[7]))), now=1.0
    )
    suspects = store.suspect_batches("run-a")
    assert suspects == [
        {
            "step": 12,
            "rank": 2,
            "reasons": ["nonfinite_origin"],
            "batch_ids": [2012, "doc-2-12"],
            "batch_ids_left_out": 2,
        },
        {
            "step": 30,
            "rank": 2,
            "reasons": ["loss_spike", "origin_outlier"],
            "batch_ids": [2030, "doc-2-30"],
            "batch_ids_left_out": 2,
        },
    ]
    assert store.suspect_batches("plain") == [
        {
            "step": 1,
            "rank": 0,
            "reasons": ["skipped_step"],
            "batch_ids": [7],
            "batch_ids_left_out": 0,
        }
    ]
    assert store.suspect_batches("unknown") is None
    assert store.batch_ids("run-a", [(30, 2), (5, 1), (99, 0)]) == {
        (30, 2): [2030, "doc-2-30"],
        (5, 1): [1005, "doc-1-5"],
    }


def test_an_outlier_found_late_takes_the_ids_its_rank_sent_earlier() -> None:
    store = _store()
    # Rank 3 stands out at step 4, but only once the others' step 4 arrives.
    store.ingest(batch(*_rank_records(3, 4, **{"4": {"stats": stats(1.0, origin=90.0)}})), 1.0)
    assert store.suspect_batches("run-a") == []
    for rank in range(3):
        store.ingest(batch(*_rank_records(rank, 4)), now=2.0)
    assert store.suspect_batches("run-a") == [
        {
            "step": 4,
            "rank": 3,
            "reasons": ["origin_outlier"],
            "batch_ids": [3004, "doc-3-4"],
            "batch_ids_left_out": 3,
        }
    ]


def test_the_first_update_on_nonfinite_gradients_is_flagged() -> None:
    store = _store()
    applied = watch(
        3, found_inf=True, total=totals(3, applied=1, first_applied=(3, None)),
        batch=BatchIds(ids=["a", "b"]),
    )  # fmt: skip
    store.ingest(batch(watch(1), watch(2), applied), now=1.0)
    rows = store.suspect_batches("run-a")
    assert rows is not None
    assert [(r["step"], r["reasons"], r["batch_ids"]) for r in rows] == [
        (3, ["nonfinite_update_applied"], ["a", "b"])
    ]


def test_the_ledger_is_bounded() -> None:
    ledger = BatchLedger(recent_steps=3, max_suspects=2)
    for step in range(1, 6):
        ledger.observe(0, record(step, batch=BatchIds(ids=[step])))
    assert ledger.ids_at(0, 2) is None, "older than the recent steps"
    assert ledger.ids_at(0, 5) == BatchIds(ids=[5])
    for step in (3, 4, 5):
        ledger.flag(0, step, "loss_spike")
    assert [(s.step, list(s.batch.ids)) for s in ledger.suspects()] == [(4, [4]), (5, [5])]
    assert ledger.dropped == 1
    ledger.forget(0)
    assert ledger.ids_at(0, 5) == BatchIds(ids=[5]), "a suspect keeps its ids"
    assert ledger.ids_at(0, 3) is None
