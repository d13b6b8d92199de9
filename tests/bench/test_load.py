"""The load generator's own robustness: a pusher that fails stops the run, never hangs it."""

from __future__ import annotations

import threading
from typing import Any

from support import DEADLOCK_GUARD_S

from bench.load import push_concurrently
from bench.payloads import SimulatedRank


def test_a_request_that_cannot_be_built_fails_the_push_instead_of_hanging_it() -> None:
    # A body builder that raises (a catalogue family the simulated rank lacked did, at the
    # start barrier every other pusher and the clock then waited at forever).
    ranks = [SimulatedRank(run="bench", rank=r, world_size=4, devices=1, top_k=1) for r in range(4)]

    def build(rank: SimulatedRank) -> Any:
        if rank.rank == 2:
            raise KeyError("a family the simulated rank does not have")
        return ("PUT", rank.push_path(), rank.exposition(), "text/plain")

    outcome: list[BaseException | None] = []

    def push() -> None:
        try:
            push_concurrently(
                host="127.0.0.1", port=9, ranks=ranks, requests_per_rank=2, make_request=build
            )
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=push, daemon=True)
    thread.start()
    thread.join(DEADLOCK_GUARD_S)  # only a hang gets here
    assert not thread.is_alive(), "push_concurrently hung on a pusher that failed"
    (raised,) = outcome
    assert isinstance(raised, KeyError)
