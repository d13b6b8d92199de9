"""``Setup.origin_group``: the data-parallel group a rank's origin norm is compared within.

Optional (reporters that predate it send none), strict like every field, bounded like a rank
and a world size, and consistent with the record's identity: the group holds the rank and
fits in the world."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest
from exporter.factory import record

from ampscope.reporter.schema import IngestBatch, OriginGroup, Setup, StepRecord


def _json(group: Any, rank: int = 3, world_size: int = 4) -> dict[str, Any]:
    data = record(1, rank=rank, world_size=world_size).model_dump(mode="json")
    data["setup"] = {"mode": "watch", "policy": "skip", "grad_dtype": None, "origin_group": group}
    return data


def test_a_group_round_trips_through_json() -> None:
    sent = record(1, rank=3, world_size=4, setup=Setup(origin_group=OriginGroup(first=2, size=2)))
    batch = IngestBatch(schema_version=1, records=[sent], dropped_records=0)
    (got,) = IngestBatch.model_validate_json(batch.model_dump_json()).records
    assert got == sent
    assert got.setup.origin_group == OriginGroup(first=2, size=2)


def test_an_older_reporters_setup_has_no_group_and_none_is_not_sent() -> None:
    data = record(1).model_dump(mode="json")
    # Without a group the JSON is what it was before the field: an older exporter takes it.
    assert data["setup"] == {"mode": "scaler", "policy": "skip", "grad_dtype": None}
    assert StepRecord.model_validate(data).setup.origin_group is None
    del data["setup"]  # no setup at all: the defaults
    assert StepRecord.model_validate(data).setup.origin_group is None


@pytest.mark.parametrize(
    ("group", "why"),
    [
        ({"first": "2", "size": 2}, "int_type"),  # strict: no coercion
        ({"first": 2.0, "size": 2}, "int_type"),
        ({"first": -1, "size": 2}, "greater_than_equal"),
        ({"first": 1_000_000, "size": 1}, "less_than"),
        ({"first": 0, "size": 0}, "greater_than_equal"),
        ({"first": 0, "size": 1_000_001}, "less_than_equal"),
        ({"first": 0, "size": 2, "ranks": [0, 1]}, "extra_forbidden"),
        ({"first": 0}, "missing"),
    ],
)
def test_malformed_groups_are_refused(group: dict[str, Any], why: str) -> None:
    with pytest.raises(pydantic.ValidationError) as refused:
        StepRecord.model_validate(_json(group))
    assert why in {error["type"] for error in refused.value.errors()}


@pytest.mark.parametrize(
    ("group", "rank", "world_size"),
    [
        ({"first": 4, "size": 1}, 3, 8),  # starts above the rank
        ({"first": 0, "size": 8}, 3, 4),  # larger than the world
    ],
)
def test_a_group_that_cannot_hold_the_rank_is_refused(
    group: dict[str, Any], rank: int, world_size: int
) -> None:
    with pytest.raises(pydantic.ValidationError, match="cannot hold rank"):
        StepRecord.model_validate(_json(group, rank=rank, world_size=world_size))
    assert StepRecord.model_validate(_json({"first": 0, "size": world_size}, rank, world_size))
