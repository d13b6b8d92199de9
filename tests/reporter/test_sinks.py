"""CallbackSink and JsonlSink."""

from __future__ import annotations

import threading

import pytest
from loopback_server import make_record

from ampscope.reporter.schema import StepRecord
from ampscope.reporter.sinks import CallbackSink, JsonlSink, Sink


def test_callback_sink_passes_records_and_closes_once():
    seen: list[StepRecord] = []
    closes: list[int] = []
    sink = CallbackSink(seen.append, on_close=lambda: closes.append(1))
    assert isinstance(sink, Sink)
    records = [make_record(step) for step in (1, 2, 3)]
    for record in records:
        sink.emit(record)
    sink.close(1)
    sink.close(1)
    assert seen == records
    assert closes == [1]


def test_callback_sink_needs_a_callable():
    with pytest.raises(TypeError, match="needs a callable"):
        CallbackSink("not callable")  # type: ignore[arg-type]


def test_jsonl_sink_appends_one_valid_line_per_record_from_many_threads(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text(make_record(99).model_dump_json() + "\n")  # existing content is kept
    sink = JsonlSink(path)
    assert isinstance(sink, Sink)

    def write(rank: int) -> None:
        for step in range(1, 51):
            sink.emit(make_record(step, rank=rank))

    threads = [threading.Thread(target=write, args=(rank,)) for rank in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sink.close(1)
    sink.close(1)  # idempotent

    lines = path.read_text().splitlines()
    assert len(lines) == 1 + 200
    parsed = [StepRecord.model_validate_json(line) for line in lines]
    assert parsed[0] == make_record(99)
    for rank in range(4):
        steps = [r.step for r in parsed[1:] if r.identity.rank == rank]
        assert steps == list(range(1, 51))  # each writer's order survives interleaving
    assert sink.written == 200
    with pytest.raises(ValueError, match="is closed"):
        sink.emit(make_record(1))


def test_jsonl_sink_fails_at_construction_on_a_bad_path(tmp_path):
    with pytest.raises(FileNotFoundError):
        JsonlSink(tmp_path / "missing-dir" / "records.jsonl")
