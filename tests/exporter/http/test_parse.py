"""parse_batch: large bodies validated record by record accept and reject exactly what
IngestBatch.model_validate_json does, and let other threads run meanwhile."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from pydantic import ValidationError

from ampscope.exporter.http import parse
from ampscope.exporter.http.parse import (
    MAX_JSON_DEPTH,
    SPLIT_ABOVE_BYTES,
    TooDeep,
    parse_batch,
    validate_json,
)
from ampscope.reporter.schema import Heartbeat, IngestBatch, StepRecord
from exporter.factory import body, steps

PAD = b" " * (SPLIT_ABOVE_BYTES + 1)
"""Trailing whitespace: keeps a document the same while pushing it onto the split path."""
DEADLOCK_GUARD_S = 30.0
"""Only a hang ever waits this long."""


def _outcome(parser: Any, raw: bytes) -> Any:
    try:
        return ("ok", parser(raw))
    except ValidationError as exc:
        return [(e["loc"], e["type"], e["msg"]) for e in exc.errors(include_url=False)]


def _valid() -> dict[str, Any]:
    return json.loads(body(*steps(1, 30), dropped=2))


def _mutations() -> list[dict[str, Any] | bytes]:
    docs: list[dict[str, Any] | bytes] = [_valid()]
    bad = _valid()
    bad["records"][5]["step"] = "x"
    bad["records"][7]["scale_after"] = -1.0
    bad["dropped_records"] = -3
    bad["unknown"] = 1
    docs.append(bad)
    mixed = _valid()
    mixed["records"][3]["identity"]["rank"] = 7
    docs.append(mixed)
    empty = _valid()
    empty["records"] = []
    docs.append(empty)
    missing = _valid()
    del missing["records"]
    docs.append(missing)
    not_list = _valid()
    not_list["records"] = {"a": 1}
    docs.append(not_list)
    first_bad = _valid()
    first_bad["records"][0]["identity"]["world_size"] = 0
    docs.append(first_bad)
    duplicate = _valid()
    duplicate["records"][4]["nonfinite_params"] = [{"name": "w", "count": 1}] * 2
    docs.append(duplicate)
    shapes = _valid()
    shapes["records"][3] = [2]
    shapes["records"][4]["identity"] = "node0"
    shapes["records"][5]["totals"]["found_inf_local"] = [1]
    shapes["records"][6]["found_inf_local"] = {"cuda:0": 1}
    shapes["records"][7]["step"] = True
    shapes["records"][8]["scale_after"] = 3
    shapes["records"][9]["step"] = 3.0
    docs.append(shapes)
    huge = _valid()
    huge["records"][6]["step"] = 2**64 + 1  # past 64 bits: must not round through a float
    huge["dropped_records"] = 2**70
    docs.append(huge)
    raw = body(*steps(1, 30))
    record_text = raw[raw.index(b"[") + 1 : raw.index(b'},{"identity"') + 1]
    docs += [
        raw[:-5],  # truncated: not JSON
        raw.replace(b'"step":', b'"step" : ', 3).replace(b",", b" ,\n", 10),
        b'{"records": [], "records": []}',
        b"[1, 2]",
        b'{"schema_version": 1, "records": [' + raw[raw.index(b"[") + 1 : -30] + b", NaN]}",
        b"\xff\xfe not utf-8",
        raw.replace(b'"scale_after":65536.0', b'"scale_after":1e400', 2),
        raw.replace(b'"step":', b'"step":1,"step":', 1),  # a repeated member: the last wins
        b'{"dropped_records": 0, "records": [' + record_text + b'], "records": []}',
        b'{"records": [' + record_text + b"], }",
        b'{"records": [' + b",".join([record_text] * 2049) + b"]}",
    ]
    return docs


@pytest.mark.parametrize("doc", _mutations())
def test_split_path_decides_exactly_like_one_call(doc: dict[str, Any] | bytes) -> None:
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    expected = _outcome(IngestBatch.model_validate_json, raw + PAD)
    assert _outcome(parse_batch, raw + PAD) == expected
    # and the small path is the one call itself
    assert _outcome(parse_batch, raw) == _outcome(IngestBatch.model_validate_json, raw)


def _deep(levels: int, *, kind: str) -> bytes:
    """A body of ``levels`` nested arrays or objects (outermost included)."""
    if kind == "array":
        return b"[" * levels + b"]" * levels
    return b'{"a":' * (levels - 1) + b"{}" + b"}" * (levels - 1)


@pytest.mark.parametrize("kind", ["array", "object"])
@pytest.mark.parametrize("pad", [b"", PAD], ids=["one-call", "split"])
def test_depth_is_bounded_on_both_paths(kind: str, pad: bytes) -> None:
    at_limit = _deep(MAX_JSON_DEPTH + 1, kind=kind) + pad
    with pytest.raises(ValidationError) as refused:  # parsed, then refused by the schema
        parse_batch(at_limit)
    assert all(e["type"] != "json_invalid" for e in refused.value.errors())
    for levels in (MAX_JSON_DEPTH + 2, 50_000):
        with pytest.raises(TooDeep, match=f"max_json_depth={MAX_JSON_DEPTH}"):
            parse_batch(_deep(levels, kind=kind) + pad)


@pytest.mark.parametrize("pad", [b"", PAD], ids=["one-call", "split"])
def test_a_deep_value_inside_a_record_is_too_deep(pad: bytes) -> None:
    doc = _valid()
    # The record sits 3 levels down; an unknown member nested inside it passes the limit.
    doc["records"][2]["extra"] = json.loads(_deep(MAX_JSON_DEPTH, kind="array"))
    with pytest.raises(TooDeep):
        parse_batch(json.dumps(doc).encode() + pad)
    doc["records"][2]["extra"] = json.loads(_deep(MAX_JSON_DEPTH - 3, kind="array"))
    with pytest.raises(ValidationError) as refused:  # within the limit: an unknown member
        parse_batch(json.dumps(doc).encode() + pad)
    assert [e["loc"] for e in refused.value.errors()] == [("records", 2, "extra")]


def test_validate_json_tells_a_deep_heartbeat_apart() -> None:
    with pytest.raises(TooDeep, match="line 1 column"):
        validate_json(Heartbeat, _deep(50_000, kind="object"))
    with pytest.raises(ValidationError):
        validate_json(Heartbeat, b"[1, 2]")


class _RecordSpy:
    """Stands in for ``StepRecord`` in ``parse``: records each per-record validation call
    and runs ``hook`` before it."""

    def __init__(self, hook: Any = None) -> None:
        self.inputs: list[Any] = []
        self.hook = hook

    def model_validate(self, data: Any) -> StepRecord:
        self.inputs.append(data)
        if self.hook is not None:
            self.hook(len(self.inputs))
        return StepRecord.model_validate(data)


def test_large_bodies_are_validated_one_record_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = body(*steps(1, 30)) + PAD
    spy = _RecordSpy()
    monkeypatch.setattr(parse, "StepRecord", spy)
    batch = parse_batch(raw)
    assert [r.step for r in batch.records] == list(range(1, 31))
    # Each call is handed one record, never the batch: the GIL is held one record at a time.
    assert [record["step"] for record in spy.inputs] == list(range(1, 31))


def test_other_threads_run_while_a_large_batch_is_validated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Deterministic: the validation of record 2 waits until another thread has run, so
    that thread provably runs inside the parse, between two records. How long another
    thread waits for the GIL is measured in bench/responsiveness.py (``--gil``)."""
    raw = body(*steps(1, 500, run="big"))
    assert len(raw) > SPLIT_ABOVE_BYTES
    in_parse = threading.Event()
    other_ran = threading.Event()
    order: list[str] = []

    def hook(call: int) -> None:
        if call == 2:
            in_parse.set()
            assert other_ran.wait(DEADLOCK_GUARD_S), "the other thread never ran"
        order.append(f"record {call}")

    def other() -> None:
        assert in_parse.wait(DEADLOCK_GUARD_S)
        order.append("other thread")
        other_ran.set()

    monkeypatch.setattr(parse, "StepRecord", _RecordSpy(hook))
    thread = threading.Thread(target=other)
    thread.start()
    batch = parse_batch(raw)
    thread.join(DEADLOCK_GUARD_S)
    assert len(batch.records) == 500
    assert order[:3] == ["record 1", "other thread", "record 2"]
    assert order[3:] == [f"record {n}" for n in range(3, 501)]
