"""The batch ids of each (step, rank) a verdict names join its evidence."""

from __future__ import annotations

from ampscope.verdicts import spikes
from ampscope.verdicts.batches import attach, named_pairs, with_batch_ids
from ampscope.verdicts.thresholds import Thresholds


def _facts(rank: int, step: int) -> spikes.SpikeFacts:
    detail = spikes.SpikeDetail(step=step, value=9.0, median=1.0, mean=1.0, stdev=0.1)
    return spikes.SpikeFacts(rank=rank, node="n0", spikes=1, newest=detail)


def test_per_rank_and_per_step_evidence_get_their_ids() -> None:
    t = Thresholds()
    loss = spikes.loss_spike([_facts(2, 30)], t)
    norm = spikes.grad_norm_spike([_facts(0, 30), _facts(1, 30)], t)
    quiet = spikes.origin_outlier([], t)
    assert named_pairs([loss, norm, quiet]) == {(30, 2), (30, 0), (30, 1)}
    ids = {(30, 2): [7, "doc"], (30, 0): [1]}
    loss2, norm2, quiet2 = with_batch_ids([loss, norm, quiet], ids)
    assert loss2.evidence["ranks"][0]["batch_ids"] == [7, "doc"]
    assert norm2.evidence["steps"][0]["batches"] == [{"rank": 0, "batch_ids": [1]}]
    assert quiet2 == quiet
    assert "batch_ids" not in loss.evidence["ranks"][0], "the input is unchanged"


def test_the_lookup_is_asked_only_for_named_pairs() -> None:
    asked: list[set[tuple[int, int]]] = []

    def lookup(pairs: set[tuple[int, int]]) -> dict[tuple[int, int], list[int | str]]:
        asked.append(pairs)
        return {}

    quiet = [spikes.loss_spike([], Thresholds())]
    assert attach(quiet, lookup) == quiet
    assert asked == []
    attach([spikes.origin_outlier([_facts(3, 4)], Thresholds())], lookup)
    assert asked == [{(4, 3)}]
