"""``ampscope.integrations._batch``: reading a batch's ids, copying it without them."""

from __future__ import annotations

import pickle
from collections import UserDict
from types import MappingProxyType
from typing import Any

import pytest
import torch

from ampscope import GradWatch
from ampscope.integrations._batch import (
    BATCH_IDS_KEY,
    IdsAsList,
    carries_ids,
    check_key,
    note_ids,
    without_key,
)


def _noted(*batches: Any, key: str | None = BATCH_IDS_KEY) -> Any:
    watch = GradWatch(reporter=None)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    watch.attach(model)
    for batch in batches:
        note_ids(watch, batch, key)
    model(torch.ones(1, 2)).sum().backward()
    watch.step(optimizer)
    watch.update()
    watch.close()
    [record] = watch.telemetry.history()
    return record.batch


def test_note_ids_reads_lists_and_cpu_tensors_and_adds_micro_batches_up() -> None:
    batch = _noted({"sample_ids": [3, 4], "x": 0}, {"sample_ids": torch.tensor([5, 6])})
    assert (batch.ids, batch.left_out) == ([3, 4, 5, 6], 0)
    assert _noted({"doc": ["a", "b"]}, key="doc").ids == ["a", "b"]


def test_note_ids_never_reads_a_tensor_on_an_accelerator() -> None:
    # A meta tensor stands in for one on a GPU: reading it would wait for the device.
    batch = _noted({"sample_ids": torch.tensor([1, 2, 3], device="meta")})
    assert (batch.ids, batch.left_out) == ([], 3)


def test_note_ids_notes_nothing_without_the_key() -> None:
    assert _noted({"x": 1}, [1, 2], torch.ones(2), {"sample_ids": [1]}, key=None) is None
    note_ids(None, {"sample_ids": [1]})  # no front-end (an integration that swapped nothing)
    assert not carries_ids([("sample_ids", 1)], BATCH_IDS_KEY)


def test_without_key_copies_shallowly_and_keeps_the_type() -> None:
    x = torch.ones(2)
    batch = {"x": x, "sample_ids": [1]}
    copied = without_key(batch, "sample_ids")
    assert copied == {"x": x}
    assert copied["x"] is x
    assert batch == {"x": x, "sample_ids": [1]}  # the user's batch unchanged
    user = UserDict(batch)
    copied_user = without_key(user, "sample_ids")
    assert type(copied_user) is UserDict
    assert dict(copied_user) == {"x": x}
    assert "sample_ids" in user
    frozen = without_key(MappingProxyType(batch), "sample_ids")  # cannot copy: a dict
    assert frozen == {"x": x}


def test_ids_as_list_turns_the_collated_tensor_into_a_list() -> None:
    collate = IdsAsList(torch.utils.data.default_collate, "sample_ids")
    batch = collate([{"x": torch.ones(2), "sample_ids": 7}, {"x": torch.ones(2), "sample_ids": 8}])
    assert batch["sample_ids"] == [7, 8]
    assert batch["x"].shape == (2, 2)
    assert collate([torch.ones(2)]).shape == (1, 2)  # not a mapping: unchanged
    on_device = IdsAsList(lambda rows: {"sample_ids": torch.tensor(rows, device="meta")})
    assert on_device([1, 2])["sample_ids"].device.type == "meta"  # never read there
    assert pickle.loads(pickle.dumps(collate)).key == "sample_ids"  # for loader workers


def test_check_key() -> None:
    assert check_key("doc") == "doc"
    assert check_key(None) is None
    with pytest.raises(ValueError, match="batch_ids_key"):
        check_key("")
    with pytest.raises(TypeError, match="batch_ids_key"):
        check_key(3)  # type: ignore[arg-type]
