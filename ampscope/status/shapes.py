"""The shape of every answer ``ampscope status`` reads, checked before anything reads it.

As ``promtool`` and ``kubectl`` do with the answers of other programs: an exporter's JSON API
(``/api/v1/runs``, a run's ``/ranks`` and ``/health``) and a Prometheus-compatible query API
(``/api/v1/query``) answer JSON of a known shape, and an answer of another shape (``{}``
where a list of runs belongs, a number sent as a string, a missing key, a label that is not
there) raises ``Malformed`` naming the first fault and where it is, instead of a traceback
deep inside the tables or the merge.

Only what ``ampscope status`` reads is checked, and only its type: keys it does not read may
be absent or anything, and words it only shows (a rule's name, a rank's state) may be new
ones, so an older ``ampscope status`` still reads a newer exporter. Words it decides on (a
verdict's status) must be known. Standard library only; costs O(size of the answer).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

Check = Callable[[Any, str], None]
"""Checks a value found at a path (``[0].totals.steps``); raises ``_Fault``."""

STATUSES = ("ok", "warning", "critical")


class Malformed(Exception):
    """An answer of the wrong shape: ``where`` names the request, ``what`` the first fault."""

    def __init__(self, where: str, what: str) -> None:
        super().__init__(f"{where} answered JSON of the wrong shape: {what}")
        self.where = where
        self.what = what


class _Fault(Exception):
    def __init__(self, at: str, message: str) -> None:
        super().__init__(f"{at or 'the answer'}: {message}")


_JSON_TYPES = (
    (bool, "a boolean"),
    (int, "a number"),
    (float, "a number"),
    (str, "a string"),
    (list, "an array"),
    (dict, "an object"),
)


def describe(value: Any) -> str:
    """``value`` as the answer held it, in JSON words and short: ``an object ({})``."""
    if value is None:
        return "null"
    kind = next((name for type_, name in _JSON_TYPES if isinstance(value, type_)), "a value")
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(value)
    return f"{kind} ({text if len(text) <= 40 else text[:37] + '...'})"


def _expected(what: str, value: Any, at: str) -> _Fault:
    return _Fault(at, f"expected {what}, got {describe(value)}")


def integer(value: Any, at: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _expected("an integer", value, at)


def number(value: Any, at: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _expected("a number", value, at)


def string(value: Any, at: str) -> None:
    if not isinstance(value, str):
        raise _expected("a string", value, at)


def boolean(value: Any, at: str) -> None:
    if not isinstance(value, bool):
        raise _expected("true or false", value, at)


def anything(value: Any, at: str) -> None:
    """Any JSON value: kept as it is, never read."""


def one_of(*words: str) -> Check:
    def check(value: Any, at: str) -> None:
        if value not in words:
            raise _expected(" or ".join(map(json.dumps, words)), value, at)

    return check


def nullable(check: Check) -> Check:
    def checked(value: Any, at: str) -> None:
        if value is not None:
            check(value, at)

    return checked


def array(item: Check, what: str = "an array") -> Check:
    def check(value: Any, at: str) -> None:
        if not isinstance(value, list):
            raise _expected(what, value, at)
        for index, element in enumerate(value):
            item(element, f"{at}[{index}]")

    return check


def mapping(item: Check, what: str = "an object") -> Check:
    """An object whose every value passes ``item`` (its keys are JSON's strings)."""

    def check(value: Any, at: str) -> None:
        if not isinstance(value, dict):
            raise _expected(what, value, at)
        for key, element in value.items():
            item(element, f"{at}.{key}")

    return check


def obj(required: Mapping[str, Check], optional: Mapping[str, Check] | None = None,
        what: str = "an object") -> Check:  # fmt: skip
    """An object with ``required`` keys and, when present, ``optional`` ones; others may be
    anything."""

    def check(value: Any, at: str) -> None:
        if not isinstance(value, dict):
            raise _expected(what, value, at)
        for key, item in required.items():
            if key not in value:
                raise _Fault(at, f"the key {key!r} is missing")
            item(value[key], f"{at}.{key}" if at else key)
        for key, item in (optional or {}).items():
            if key in value:
                item(value[key], f"{at}.{key}" if at else key)

    return check


# ---- an exporter's JSON API (ampscope.exporter.api.models), as far as status reads it ----

RUN_SUMMARY = obj(
    {
        "run": string,
        "ranks": integer,
        "up": integer,
        "stale": integer,
        "states": mapping(integer),
        "world_size": integer,
        "newest_step": integer,
        "last_report_time": number,
    },
    what="a run's summary (an object)",
)
RUNS = array(RUN_SUMMARY, "a list of runs")

_ALIGNED = obj({}, {"step": integer, "scale": number})
_TOTALS = obj(
    {
        "steps": integer,
        "skipped_steps": integer,
        "backoffs": integer,
        "found_inf_local": mapping(integer),
        "found_inf_origin": mapping(integer),
    },
    {"nonfinite_applied": integer, "aligned_scale": nullable(_ALIGNED)},
)
_SETUP = obj({"mode": string, "policy": string}, {"grad_dtype": nullable(string)})
_FAILURE = obj(
    {"exception": string, "step": integer},
    {"kind": string, "message": nullable(string), "origin_ranks": nullable(array(integer))},
    what="a rank's failure (an object)",
)
RANK_VIEW = obj(
    {
        "run": string,
        "node": string,
        "rank": integer,
        "world_size": integer,
        "step": integer,
        "scale": number,
        "totals": _TOTALS,
        "last_report_time": number,
        "seconds_since_report": number,
    },
    {
        "local_world_size": nullable(integer),
        "setup": nullable(_SETUP),
        "state": nullable(string),
        "failure": nullable(_FAILURE),
        "up": boolean,
    },
    what="a rank (an object)",
)
RANKS = array(RANK_VIEW, "a list of ranks")

_VERDICT = obj(
    {"rule": string, "status": one_of(*STATUSES), "summary": string, "evidence": mapping(anything)},
    {"thresholds": nullable(mapping(number))},
    what="a verdict (an object)",
)
HEALTH = obj(
    {
        "run": string,
        "status": one_of(*STATUSES),
        "evaluated_at": number,
        "ranks": integer,
        "up": integer,
        "verdicts": array(_VERDICT, "a list of verdicts"),
    },
    {"state": string, "states": mapping(integer)},
    what="a health report (an object)",
)


def _batch_id(value: Any, at: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise _expected("an integer or a string", value, at)


SUSPECT_BATCH = obj(
    {"step": integer, "rank": integer, "reasons": array(string), "batch_ids": array(_batch_id)},
    {"batch_ids_left_out": integer},
)
SUSPECT_BATCHES = array(SUSPECT_BATCH, "a list of suspect batches")
"""``/api/v1/runs/{run}/suspect-batches``."""


def check(document: Any, shape: Check, where: str, at: str = "") -> Any:
    """``document`` (found at path ``at`` of the answer) when it has ``shape``.

    Raises:
        Malformed: naming ``where`` (the request) and the first fault.
    """
    try:
        shape(document, at)
    except _Fault as exc:
        raise Malformed(where, str(exc)) from None
    return document


# ---- a Prometheus-compatible /api/v1/query (an instant vector) ----


def _sample_value(value: Any, at: str) -> None:
    # [<unix time>, "<value>"]: the value is a string, "NaN" and "+Inf" included.
    if not (isinstance(value, list) and len(value) == 2):
        raise _expected("[time, value]", value, at)
    number(value[0], f"{at}[0]")
    if not isinstance(value[1], str):
        raise _expected("a number as a string", value[1], f"{at}[1]")
    try:
        float(value[1])
    except ValueError:
        raise _expected("a number as a string", value[1], f"{at}[1]") from None


_SAMPLE = obj({"metric": mapping(string), "value": _sample_value}, what="a sample (an object)")
QUERY_ANSWER = obj({"status": string}, {"error": string, "errorType": string})
VECTOR = obj(
    {"resultType": one_of("vector"), "result": array(_SAMPLE, "a list of samples")},
    what="a query's data (an object)",
)


def check_finite(samples: Iterable[Mapping[str, Any]], where: str) -> None:
    """Every sample's value is a finite number: where a count, a step or a scale is read,
    ``NaN`` or ``1e400`` (``+Inf`` once parsed) is a malformed answer, not a number to use.

    Raises:
        Malformed: naming ``where`` and the first sample at fault.
    """
    for index, sample in enumerate(samples):
        value = float(sample["value"][1])
        if not math.isfinite(value):
            name = sample["metric"].get("__name__", "a series")
            raise Malformed(
                where,
                f"data.result[{index}].value[1]: {name} is {sample['value'][1]!r}, "
                "not a finite number",
            )


_SERIES_LABELS = ("run", "rank", "node")
_FAMILY_LABELS: dict[str, tuple[str, ...]] = {
    "ampscope_rank_info": ("local_rank",),
    "ampscope_found_inf_total": ("device",),
    "ampscope_found_inf_origin_total": ("device",),
    "ampscope_rank_state": ("state",),
}
_INTEGER_LABELS = ("rank", "local_rank", "world_size")


def check_series(samples: Iterable[Mapping[str, Any]], where: str) -> None:
    """Every sample names its run, rank and node (and what its family adds: a device, a
    state), with integers where ranks and sizes go.

    Raises:
        Malformed: naming ``where`` and the first series at fault.
    """
    for index, sample in enumerate(samples):
        labels = sample["metric"]
        needed = _SERIES_LABELS + _FAMILY_LABELS.get(labels.get("__name__", ""), ())
        at = f"data.result[{index}].metric"
        for label in needed:
            if label not in labels:
                series = labels.get("__name__", "a series")
                raise Malformed(where, f"{at}: {series} has no {label!r} label")
        for label in _INTEGER_LABELS:
            text = labels.get(label)
            if text is None or (label == "world_size" and not text):  # empty: read as 1
                continue
            try:
                int(text)
            except ValueError:
                raise Malformed(
                    where, f"{at}.{label}: expected an integer, got {describe(text)}"
                ) from None
