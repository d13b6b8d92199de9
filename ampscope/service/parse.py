"""Validating an ingest body without holding the GIL for seconds.

``IngestBatch.model_validate_json`` is one call into pydantic-core (Rust) that holds the
GIL throughout: about a CPU-second for a 7 MiB batch, during which no other thread, the
event loop included, runs, so a worker thread alone does not keep /healthz responsive.
Large bodies are therefore split into their records first and validated one record at
a time (about half a millisecond each), letting the interpreter switch threads between
records. Small bodies, and any body the splitter does not understand, take the one-call
path, so both paths accept exactly the same documents.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError
from pydantic_core import InitErrorDetails

from ampscope.reporter.schema import MAX_RECORDS_PER_BATCH, IngestBatch, StepRecord

SPLIT_ABOVE_BYTES = 256 * 1024
"""Bodies up to this size are validated in one call (a few milliseconds)."""

_WHITESPACE = " \t\n\r"
_decoder = json.JSONDecoder()


class _Unsplittable(Exception):
    """The body is not an object the splitter understands; use the one-call path."""


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def _value_end(text: str, pos: int) -> int:
    try:
        return int(_decoder.raw_decode(text, pos)[1])
    except ValueError:
        raise _Unsplittable from None


def split_batch(text: str) -> tuple[dict[str, str], list[str] | None]:
    """Split a batch's JSON into its top-level members' JSON texts and, when ``records``
    is an array, its elements' JSON texts (``None`` otherwise).

    Costs one C-level JSON scan per record, with the GIL free between records.

    Raises:
        _Unsplittable: not a JSON object, or a repeated member name.
    """
    members: dict[str, str] = {}
    records: list[str] | None = None
    pos = _skip(text, 0)
    if not text.startswith("{", pos):
        raise _Unsplittable
    pos = _skip(text, pos + 1)
    if text.startswith("}", pos):
        return members, records
    while True:
        if not text.startswith('"', pos):
            raise _Unsplittable
        end = _value_end(text, pos)
        key = json.loads(text[pos:end])
        pos = _skip(text, end)
        if key in members or not text.startswith(":", pos):
            raise _Unsplittable
        pos = _skip(text, pos + 1)
        start = pos
        if key == "records" and text.startswith("[", pos):
            records = []
            pos = _skip(text, pos + 1)
            if text.startswith("]", pos):
                pos += 1
            else:
                while True:
                    end = _value_end(text, pos)
                    records.append(text[pos:end])
                    if len(records) > MAX_RECORDS_PER_BATCH:
                        raise _Unsplittable  # too long: let the one-call path say so
                    pos = _skip(text, end)
                    if text.startswith("]", pos):
                        pos += 1
                        break
                    if not text.startswith(",", pos):
                        raise _Unsplittable
                    pos = _skip(text, pos + 1)
            members[key] = "[]"
        else:
            pos = _value_end(text, pos)
            members[key] = text[start:pos]
        pos = _skip(text, pos)
        if text.startswith("}", pos):
            break
        if not text.startswith(",", pos):
            raise _Unsplittable
        pos = _skip(text, pos + 1)
    if _skip(text, pos + 1) != len(text):
        raise _Unsplittable
    return members, records


def _errors(exc: ValidationError, prefix: tuple[int | str, ...]) -> list[InitErrorDetails]:
    return [
        {
            "type": error["type"],
            "loc": (*prefix, *error["loc"]),
            "input": error.get("input"),
            "ctx": error.get("ctx", {}),
        }
        for error in exc.errors(include_url=False)
    ]


def parse_batch(body: bytes) -> IngestBatch:
    """``IngestBatch.model_validate_json(body)``, in slices for large bodies.

    Raises:
        ValidationError: as ``IngestBatch.model_validate_json`` would: ``json_invalid``
            for a body that is not JSON, schema violations located in the batch otherwise.
    """
    if len(body) <= SPLIT_ABOVE_BYTES:
        return IngestBatch.model_validate_json(body)
    try:
        members, raw_records = split_batch(body.decode("utf-8"))
    except (_Unsplittable, UnicodeDecodeError):
        return IngestBatch.model_validate_json(body)
    errors: list[InitErrorDetails] = []
    records: list[StepRecord] = []
    for index, raw in enumerate(raw_records or ()):
        try:
            records.append(StepRecord.model_validate_json(raw))
        except ValidationError as exc:
            if any(e["type"] == "json_invalid" for e in exc.errors()):
                return IngestBatch.model_validate_json(body)  # the exact 400
            errors.extend(_errors(exc, ("records", index)))
    # The other members, validated in JSON mode as they were sent; one valid record
    # stands in for the array so its length rule does not fire spuriously.
    if raw_records:
        members["records"] = f"[{raw_records[0]}]"
    outer_text = "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in members.items()) + "}"
    outer: IngestBatch | None = None
    try:
        outer = IngestBatch.model_validate_json(outer_text)
    except ValidationError as exc:
        errors[:0] = [
            e for e in _errors(exc, ()) if not (raw_records and e["loc"][:1] == ("records",))
        ]
    if errors or outer is None:
        # In the order the one call reports them: by field, unknown members last.
        order = {name: i for i, name in enumerate(IngestBatch.model_fields)}
        errors.sort(key=lambda e: order.get(str(e["loc"][0]) if e["loc"] else "", len(order)))
        raise ValidationError.from_exception_data(IngestBatch.__name__, errors, input_type="json")
    # Python mode over validated records: runs the batch-level rules (one rank, length)
    # without validating any record again.
    values: dict[str, Any] = {name: getattr(outer, name) for name in IngestBatch.model_fields}
    values["records"] = records
    return IngestBatch.model_validate(values)
