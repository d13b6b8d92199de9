"""note_batch(): the ids of each iteration, bounded, in the step's record."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import ListSink, Net, poison
from helpers import batch as index_batch

import ampscope
from ampscope.rank.telemetry.batches import BatchNotes, batch_ids
from ampscope.reporter.schema import MAX_BATCH_IDS, BatchIds, IngestBatch


def _train(front: ampscope.GradScaler | ampscope.GradWatch, notes: dict[int, list]) -> None:
    """Three iterations of two micro-batches each; ``notes[step]`` what each micro-batch
    notes."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (1, 2, 3):
        opt.zero_grad()
        for micro in notes.get(step, [None, None]):
            if micro is not None:
                front.note_batch(micro)
            front.scale(model(index_batch(step)) / 2).backward()
        if step == 2:
            poison(model.body.weight)
        front.step(opt)
        front.update()


@pytest.mark.parametrize("kind", ["scaler", "watch"])
def test_micro_batches_add_up_and_each_step_carries_its_own(kind: str) -> None:
    sink = ListSink()
    front: ampscope.GradScaler | ampscope.GradWatch = (
        ampscope.GradScaler("cpu", reporter=None, sinks=[sink])
        if kind == "scaler"
        else ampscope.GradWatch("skip", reporter=None, sinks=[sink])
    )
    _train(front, {1: [[0, 1], [2, 3]], 2: ["doc-a", torch.tensor([[7], [8]])]})
    front.close()
    batches = [r.batch for r in sink.records]
    assert batches[0] == BatchIds(ids=[0, 1, 2, 3], left_out=0)
    assert batches[1] == BatchIds(ids=["doc-a", 7, 8], left_out=0)
    assert sink.records[1].skipped, "the flagged step carries its ids"
    assert batches[2] is None, "nothing noted: no batch"
    # What the exporter will check: the records pass strict validation as JSON.
    records = ",".join(r.model_dump_json() for r in sink.records)
    body = f'{{"schema_version": 1, "records": [{records}], "dropped_records": 0}}'
    parsed = IngestBatch.model_validate_json(body)
    assert [r.batch for r in parsed.records] == batches


def test_ids_past_the_bound_and_invalid_ids_are_counted() -> None:
    notes = BatchNotes()
    notes.add(range(MAX_BATCH_IDS - 1))
    notes.add([np.int64(5), 6, 7])
    notes.add(torch.zeros(3, dtype=torch.int64, device="meta"))  # never read
    ids, left_out = notes.take() or ([], -1)
    assert ids[-1] == np.int64(5)
    assert len(ids) == MAX_BATCH_IDS
    assert left_out == 2 + 3
    assert notes.take() is None, "taking starts afresh"
    record_batch = batch_ids(([1, 2.5, True, "x" * 129, "ok\n", "fine", np.int64(9), 2**60], 1))
    assert record_batch.ids == [1, "fine", 9]
    assert record_batch.left_out == 6
    assert BatchIds.model_validate(record_batch.model_dump()) == record_batch


def test_a_front_end_without_telemetry_ignores_ids() -> None:
    scaler = ampscope.GradScaler("cpu", enabled=False, reporter=None)
    scaler.note_batch([1, 2])
    assert scaler.telemetry.batches.take() is None
