"""parse_batch: large bodies validated record by record accept and reject exactly what
IngestBatch.model_validate_json does, and let other threads run meanwhile."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from pydantic import ValidationError

from ampscope.reporter.schema import IngestBatch
from ampscope.service import parse
from ampscope.service.parse import SPLIT_ABOVE_BYTES, parse_batch, split_batch
from service.factory import body, steps

PAD = b" " * (SPLIT_ABOVE_BYTES + 1)
"""Trailing whitespace: keeps a document the same while pushing it onto the split path."""


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
    raw = body(*steps(1, 30))
    docs += [
        raw[:-5],  # truncated: not JSON
        raw.replace(b'"step":', b'"step" : ', 3).replace(b",", b" ,\n", 10),
        b'{"records": [], "records": []}',
        b"[1, 2]",
        b'{"schema_version": 1, "records": [' + raw[raw.index(b"[") + 1 : -30] + b", NaN]}",
        b"\xff\xfe not utf-8",
    ]
    return docs


@pytest.mark.parametrize("doc", _mutations())
def test_split_path_decides_exactly_like_one_call(doc: dict[str, Any] | bytes) -> None:
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    expected = _outcome(IngestBatch.model_validate_json, raw + PAD)
    assert _outcome(parse_batch, raw + PAD) == expected
    # and the small path is the one call itself
    assert _outcome(parse_batch, raw) == _outcome(IngestBatch.model_validate_json, raw)


def test_split_path_is_taken_for_large_bodies(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = body(*steps(1, 30)) + PAD
    calls: list[int] = []
    monkeypatch.setattr(parse, "split_batch", lambda text: calls.append(1) or split_batch(text))
    assert len(parse_batch(raw).records) == 30
    assert calls == [1]


def test_split_batch_members_and_records() -> None:
    members, records = split_batch(' { "a" : [1, {"b": 2}] , "records" : [ {"x": 1} , [2] ] } ')
    assert members == {"a": '[1, {"b": 2}]', "records": "[]"}
    assert records == ['{"x": 1}', "[2]"]


def test_other_threads_run_while_a_large_batch_is_validated() -> None:
    # 1500 records of ~1 KB: one call would hold the GIL for the whole validation.
    raw = body(*steps(1, 1500, run="big"))
    assert len(raw) > SPLIT_ABOVE_BYTES
    ticks: list[float] = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    started = time.perf_counter()
    batch = parse_batch(raw)
    finished = time.perf_counter()
    done.set()
    ticker.join()
    assert len(batch.records) == 1500
    during = [t for t in ticks if started < t < finished]
    # Records are validated between switch intervals: the ticker kept ticking.
    assert len(during) >= 5, (len(during), finished - started)
