"""Validating an ingest body without holding the GIL for seconds, nor recursing without bound.

``IngestBatch.model_validate_json`` is one call into pydantic-core (Rust) that holds the
GIL throughout: about a CPU-second for a 7 MiB batch, during which no other thread, the
event loop included, runs, so a worker thread alone does not keep /healthz responsive.
Large bodies are therefore parsed once by pydantic-core's own JSON parser
(``pydantic_core.from_json``: a few tens of milliseconds for 7 MiB) and their records
validated one at a time (about a tenth of a millisecond each), letting the interpreter
switch threads between records. Small bodies, and any body whose records are not an
array in an object, take the one-call path; both paths use the same parser, so they
accept exactly the same documents.

Depth is bounded by that parser, which never recurses past ``MAX_JSON_DEPTH``: a deeper
body raises ``TooDeep`` on either path, whatever its size.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, from_json, to_json

from ampscope.reporter.schema import MAX_RECORDS_PER_BATCH, IngestBatch, StepRecord

SPLIT_ABOVE_BYTES = 256 * 1024
"""Bodies up to this size are validated in one call (a few milliseconds)."""

MAX_JSON_DEPTH = 200
"""How deep a body's arrays and objects may nest inside its outermost one. pydantic-core's
JSON parser (jiter) has this fixed recursion limit: ``[[…]]`` with 201 brackets parses,
202 do not. A valid batch nests 4 deep."""

_DEPTH_MESSAGE = "recursion limit exceeded"
"""How pydantic-core's parser words a body nested past ``MAX_JSON_DEPTH``
(``tests/exporter/http/test_parse.py`` fails if that changes)."""

Model = TypeVar("Model", bound=BaseModel)


class TooDeep(ValueError):
    """The body nests arrays or objects deeper than ``MAX_JSON_DEPTH``."""

    def __init__(self, where: str) -> None:
        super().__init__(
            f"body nests arrays or objects deeper than max_json_depth={MAX_JSON_DEPTH} ({where})"
        )


def _depth_error(message: str) -> TooDeep | None:
    if _DEPTH_MESSAGE not in message:
        return None
    _, _, where = message.partition(_DEPTH_MESSAGE)
    return TooDeep(where.strip() or "in the body")


def validate_json(model: type[Model], body: bytes | str) -> Model:
    """``model.model_validate_json(body)``, with a body nested too deep told apart.

    Raises:
        TooDeep: nested deeper than ``MAX_JSON_DEPTH``.
        ValidationError: any other invalid JSON (``json_invalid``) or schema violation.
    """
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        for error in exc.errors(include_url=False, include_input=False):
            if error["type"] == "json_invalid" and (deep := _depth_error(error["msg"])):
                raise deep from None
        raise


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
    """``IngestBatch.model_validate_json(body)``, record by record for large bodies.

    Call it from a worker thread: a large body costs one parse of the whole text (the
    GIL held a few tens of milliseconds per 7 MiB), then one validation per record with
    the GIL free between records.

    Raises:
        TooDeep: the body nests deeper than ``MAX_JSON_DEPTH``.
        ValidationError: as ``IngestBatch.model_validate_json`` would: ``json_invalid``
            for a body that is not JSON, schema violations located in the batch otherwise.
    """
    if len(body) <= SPLIT_ABOVE_BYTES:
        return validate_json(IngestBatch, body)
    try:
        document = from_json(body)
    except ValueError as exc:
        if deep := _depth_error(str(exc)):
            raise deep from None
        return validate_json(IngestBatch, body)  # the exact 400
    raw_records = document.get("records") if isinstance(document, dict) else None
    if not isinstance(raw_records, list) or len(raw_records) > MAX_RECORDS_PER_BATCH:
        return validate_json(IngestBatch, body)  # not a batch, or too long: as one call says
    errors: list[InitErrorDetails] = []
    records: list[StepRecord] = []
    for index, raw in enumerate(raw_records):
        # Python mode over the parser's values: the schema is strict and made of JSON's
        # own types (no dates, enums or tuples, which strict Python mode would refuse as
        # strings or lists), so it accepts and words errors as JSON mode does
        # (tests/exporter/http/test_parse.py holds both paths to the same outcomes), and costs
        # less than writing each record back to JSON text.
        try:
            records.append(StepRecord.model_validate(raw))
        except ValidationError as exc:
            errors.extend(_errors(exc, ("records", index)))
    # The other members, validated in JSON mode as the one call would; one record stands
    # in for the array so its length rule does not fire spuriously.
    document["records"] = raw_records[:1]
    outer: IngestBatch | None = None
    try:
        outer = IngestBatch.model_validate_json(to_json(document, inf_nan_mode="constants"))
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
