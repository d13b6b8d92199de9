"""The store's cardinality limits, pruning and snapshots."""

from __future__ import annotations

import dataclasses

import pytest

from ampscope.exporter.state.ranks import HELD_OVERHEAD_BYTES
from ampscope.exporter.state.store import LimitExceeded, Store, StoreLimits
from exporter.factory import batch, record, stats, steps, totals


def _store(**overrides: int) -> Store:
    limits = {"max_runs": 2, "max_ranks_per_run": 2, "max_series": 1000, "history_length": 16}
    limits.update(overrides)
    return Store(StoreLimits(window_s=600.0, **limits))


def test_limits_reject_whole_batches_and_name_the_limit() -> None:
    store = _store()
    store.ingest(batch(*steps(1, 2, run="a")), now=1.0)
    store.ingest(batch(*steps(1, 2, run="b")), now=1.0)
    with pytest.raises(LimitExceeded) as exc:
        store.ingest(batch(record(1, run="c")), now=1.0)
    assert (exc.value.limit, exc.value.value) == ("max_runs", 2)
    store.ingest(batch(record(1, run="a", rank=1)), now=1.0)
    with pytest.raises(LimitExceeded) as exc:
        store.ingest(batch(record(1, run="a", rank=2)), now=1.0)
    assert exc.value.limit == "max_ranks_per_run"
    assert store.runs() == ["a", "b"]
    assert store.counts() == (2, 3, 3 * 19)
    # Known ranks keep reporting at the limit.
    store.ingest(batch(record(3, run="a")), now=2.0)
    assert store.counts()[1] == 3


def test_series_limit_counts_devices_and_params() -> None:
    store = _store(max_series=41)
    store.ingest(batch(record(1, run="a")), now=1.0)  # 19 series
    wide = totals(2, local={f"cuda:{i}": 0 for i in range(4)}, params={"w": 1})
    store.ingest(batch(record(2, run="a", total=wide)), now=1.0)  # grows to 23
    assert store.counts()[2] == 23
    with pytest.raises(LimitExceeded) as exc:
        store.ingest(batch(record(1, run="b")), now=1.0)  # would be 42
    assert exc.value.limit == "max_series"
    assert store.runs() == ["a"]


def test_prune_drops_silent_ranks_then_empty_runs() -> None:
    store = _store()
    store.ingest(batch(record(1, run="a", rank=0)), now=0.0)
    store.ingest(batch(record(1, run="a", rank=1)), now=3000.0)
    store.ingest(batch(record(1, run="b", rank=0)), now=0.0)
    assert store.prune(now=3600.0, retention_s=3600.0) == 0  # exactly at retention: kept
    assert store.prune(now=3601.0, retention_s=3600.0) == 2
    assert store.runs() == ["a"]
    assert [snap.identity.rank for snap in store.ranks("a") or []] == [1]
    assert store.counts() == (1, 1, 19)
    # A dropped run frees its slot for a new one.
    store.ingest(batch(record(1, run="c")), now=3601.0)
    assert store.runs() == ["a", "c"]


def test_snapshots_are_copies_and_unknowns_are_none() -> None:
    store = _store()
    store.ingest(batch(*steps(1, 3, run="a")), now=5.0)
    snap = store.rank("a", 0)
    assert snap is not None
    store.ingest(batch(*steps(4, 5, run="a")), now=6.0)
    assert [r.step for r in snap.history] == [1, 2, 3]
    assert snap.last_report == 5.0
    assert store.rank("a", 7) is None
    assert store.rank("zzz", 0) is None
    assert store.ranks("zzz") is None
    ((run, rank, latest),) = store.latest()
    assert (run, rank, latest.newest.step, latest.history) == ("a", 0, 5, ())


def test_latest_is_the_snapshot_without_history_and_keeps_the_spikes() -> None:
    store = _store()
    flat = [record(s, stats=stats(2.0 + 0.01 * (s % 3), grad_norm=1.0)) for s in range(1, 61)]
    store.ingest(batch(*flat, record(61, stats=stats(9.0, grad_norm=1.0))), now=5.0)
    full = store.rank("run-a", 0)
    ((_, _, latest),) = store.latest()
    assert full is not None
    assert len(full.spikes) == 1
    (spike,) = latest.spikes
    assert (spike.kind, spike.step, spike.value) == ("loss", 61, 9.0)
    assert latest.spike_counts == full.spike_counts
    assert (latest.history, latest.samples) == ((), ())
    # Everything else is the full snapshot's.
    assert latest == dataclasses.replace(full, history=(), samples=())


def test_limits_validate() -> None:
    with pytest.raises(ValueError, match="max_runs"):
        StoreLimits(max_runs=0, max_ranks_per_run=1, max_series=1, history_length=1, window_s=1)


def test_max_ranks_counts_ranks_of_every_run() -> None:
    store = _store(max_runs=4, max_ranks=3)
    for run, rank in (("a", 0), ("a", 1), ("b", 0)):
        store.ingest(batch(record(1, run=run, rank=rank)), now=1.0)
    with pytest.raises(LimitExceeded) as exc:
        store.ingest(batch(record(1, run="c")), now=1.0)
    assert exc.value.limit == "max_ranks"
    assert store.prune(now=10_000.0, retention_s=60.0) == 3
    store.ingest(batch(record(1, run="c")), now=10_000.0)  # pruning frees the count


def _held(store: Store) -> dict[tuple[str, int], list[int]]:
    return {
        (run, rank): [held.step for held in snap.history]
        for run in store.runs()
        for rank, snap in enumerate(store.ranks(run) or [])
    }


def test_history_byte_budget_drops_the_oldest_history_of_any_rank_first() -> None:
    one = len(record(1).model_dump_json()) + 49 + HELD_OVERHEAD_BYTES  # 49: a str's header
    store = _store(history_length=1000, history_bytes=42 * one)
    store.ingest(batch(*steps(1, 20, rank=0)), now=1.0)  # rank 0's records: T0+1..T0+20
    store.ingest(batch(*steps(101, 120, rank=1)), now=2.0)  # rank 1's: T0+101..T0+120
    assert store.history_bytes() <= 42 * one
    store.ingest(batch(*steps(121, 125, rank=1)), now=3.0)  # over budget: evict to 7/8
    held = _held(store)
    assert store.history_bytes() <= 42 * one * 7 / 8
    # Rank 0's history is the oldest, so it went first; rank 1 kept all of its own.
    assert held[("run-a", 1)] == list(range(101, 126))
    assert held[("run-a", 0)][-1] == 20
    assert held[("run-a", 0)][0] > 1
    # The accounting is exact: what the store counts is what the ranks hold.
    snaps = store.ranks("run-a") or []
    assert store.history_bytes() == sum(h.nbytes for s in snaps for h in s.history)
    store.prune(now=10_000.0, retention_s=60.0)
    assert store.history_bytes() == 0


def test_window_samples_are_bounded_however_fast_a_rank_posts() -> None:
    store = _store(history_length=4)
    for step in range(1, 2001):  # one batch every 0.1 s for 200 s
        store.ingest(batch(record(step)), now=step / 10)
    (snap,) = store.ranks("run-a") or []
    # At least window_s / SAMPLES_PER_WINDOW = 10 s apart, except the newest.
    gaps = [b.received - a.received for a, b in zip(snap.samples, snap.samples[1:], strict=False)]
    assert min(gaps[:-1]) >= 10.0
    assert len(snap.samples) <= 200 / 10 + 2
    assert snap.samples[-1].received == 200.0
    assert snap.samples[-1].counts.steps == 2000
