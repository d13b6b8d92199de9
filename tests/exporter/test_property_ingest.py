"""Property: whatever validation accepts, /metrics and the health API can always serve.

Hypothesis generates schema-valid batches that reach every bound of the schema (counts
up to 2**53, scales from 0 through the largest finite float, label and parameter names
at their longest, the loss scaler's weather up to its totals), ingests them into one
exporter app, and after each example checks that /metrics answers 200 with text
``promtool check metrics`` accepts, that every run's health answers 200, and that no
exposed weather series exceeds its total's.

A second property sends one rank's records with weather within its totals and beyond them
(above a count, or naming a device the totals lack): the exporter refuses exactly the
batches holding one beyond, counts them as ``invalid``, and exposes the newest accepted
record's totals and weather, label set for label set.
"""

from __future__ import annotations

import itertools
import json
import string
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from support import need_tool, promtool_check_metrics

from ampscope.exporter.app import create_app
from ampscope.exporter.settings import Settings
from ampscope.reporter.schema import (
    MAX_COUNT,
    MAX_LABEL_LENGTH,
    MAX_PARAM_NAME_LENGTH,
    MAX_TIME,
    SCALE_ALIGN_STEPS,
    AlignedScale,
    Identity,
    IngestBatch,
    NonfiniteParam,
    OptimizerDetail,
    OriginGroup,
    RankTotals,
    Setup,
    StepRecord,
)
from exporter.factory import FakeClock

_LABEL_CHARS = string.ascii_letters + string.digits + "_.:/@+=-"
_RUN_FIRST = string.ascii_letters + string.digits + "_"

counts = st.one_of(st.integers(0, MAX_COUNT), st.sampled_from([0, 1, MAX_COUNT - 1, MAX_COUNT]))
scales = st.one_of(
    st.floats(min_value=0.0, allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, 5e-324, 1.0, 65536.0, 1.7976931348623157e308]),
)
labels = st.one_of(
    st.sampled_from(["cuda:0", "cuda:1", "cpu", "n/a@x+y=z"]),
    st.text(_LABEL_CHARS, min_size=1, max_size=MAX_LABEL_LENGTH),
    st.just("d" * MAX_LABEL_LENGTH),
)
run_ids = st.one_of(
    st.sampled_from(["run-a", "run-b"]),
    st.builds(
        lambda head, tail: head + tail,
        st.sampled_from(_RUN_FIRST),
        st.text(_LABEL_CHARS.replace("/", ""), max_size=MAX_LABEL_LENGTH - 1),
    ),
)
param_names = st.one_of(
    st.sampled_from(["layers.0.w", "layers.1.w", "group0.param3"]),
    st.text(
        st.characters(blacklist_categories=("Cs", "Zs", "Cc"), blacklist_characters='"\\'),
        min_size=1,
        max_size=MAX_PARAM_NAME_LENGTH,
    ).filter(lambda name: not any(ch.isspace() for ch in name)),
)
params = st.lists(
    st.builds(NonfiniteParam, name=param_names, count=counts),
    max_size=6,
    unique_by=lambda p: p.name,
)
devices = st.dictionaries(labels, counts, max_size=4)
aligned = st.none() | st.builds(
    AlignedScale,
    step=st.integers(1, MAX_COUNT // SCALE_ALIGN_STEPS).map(lambda n: n * SCALE_ALIGN_STEPS),
    scale=scales,
)
plain_totals = st.builds(
    RankTotals,
    steps=counts,
    skipped_steps=counts,
    backoffs=counts,
    growths=counts,
    found_inf_local=devices,
    found_inf_origin=devices,
    nonfinite_params=params,
    min_scale=st.none() | scales,
    max_scale=st.none() | scales,
    aligned_scale=aligned,
)
WEATHER_OF = {
    "ampscope_weather_skipped_steps_total": "ampscope_skipped_steps_total",
    "ampscope_weather_found_inf_total": "ampscope_found_inf_total",
    "ampscope_weather_found_inf_origin_total": "ampscope_found_inf_origin_total",
}
"""Each weather family and the family of the totals it is part of (same label sets)."""


counts_within_bound = st.sampled_from([0, 1, MAX_COUNT])
"""A count for a device the totals lack: any value is beyond them."""


@st.composite
def weather_within(draw: st.DrawFn, whole: RankTotals) -> dict[str, Any]:
    """A ``RankTotals.weather`` (as JSON) within ``whole``: any count from 0 to its total's,
    for any subset of the totals' devices."""

    def part(counts: dict[str, int]) -> dict[str, int]:
        devices = draw(st.lists(st.sampled_from(sorted(counts)), unique=True)) if counts else []
        return {device: draw(st.integers(0, counts[device])) for device in devices}

    return {
        "skipped_steps": draw(st.integers(0, whole.skipped_steps)),
        "found_inf_local": part(whole.found_inf_local),
        "found_inf_origin": part(whole.found_inf_origin),
    }


@st.composite
def weather_beyond(draw: st.DrawFn, whole: RankTotals) -> tuple[dict[str, Any], str]:
    """A weather beyond ``whole`` in exactly one way, and the field the refusal names: a
    count above its total's, or a device its totals' map lacks (for origin, a device of the
    local map too: each count is held against the map of its own name)."""
    weather = draw(weather_within(whole))
    ways = ["skipped_steps"] if whole.skipped_steps < MAX_COUNT else []
    for field in ("found_inf_local", "found_inf_origin"):
        counts = getattr(whole, field)
        ways.append(f"{field}:absent")
        if any(n < MAX_COUNT for n in counts.values()):
            ways.append(f"{field}:above")
    way = draw(st.sampled_from(ways))
    if way == "skipped_steps":
        weather["skipped_steps"] = draw(st.integers(whole.skipped_steps + 1, MAX_COUNT))
        return weather, "skipped_steps"
    field, how = way.split(":")
    counts = getattr(whole, field)
    if how == "above":
        device = draw(st.sampled_from(sorted(d for d, n in counts.items() if n < MAX_COUNT)))
        weather[field][device] = draw(st.integers(counts[device] + 1, MAX_COUNT))
    else:
        other = whole.found_inf_local if field == "found_inf_origin" else whole.found_inf_origin
        elsewhere = sorted(set(other) - set(counts))
        of_other: bool = draw(st.booleans())
        if elsewhere and of_other:
            device = draw(st.sampled_from(elsewhere))
        else:
            device = draw(labels.filter(lambda d: d not in counts))
        weather[field][device] = draw(counts_within_bound)
    return weather, field


@st.composite
def totals(draw: st.DrawFn) -> RankTotals:
    """Totals of any bound, with no weather (an older reporter) or weather within them."""
    whole = draw(plain_totals)
    if draw(st.booleans()):
        return whole
    return RankTotals.model_validate({**dict(whole), "weather": draw(weather_within(whole))})


optimizers = st.lists(
    st.builds(
        OptimizerDetail, index=counts, name=labels, found_inf=st.booleans(), fused=st.booleans()
    ),
    max_size=3,
)


@st.composite
def setups(draw: st.DrawFn, identity: Identity) -> Setup:
    """A setup naming no origin group (an older reporter) or any group that holds the rank."""
    if draw(st.booleans()):
        return Setup()
    group = OriginGroup(
        first=draw(st.integers(0, identity.rank)),
        size=draw(st.integers(1, identity.world_size)),
    )
    return Setup(mode="watch", policy="skip", origin_group=group)


@st.composite
def batches(draw: st.DrawFn) -> IngestBatch:
    identity = Identity(
        run=draw(run_ids),
        node=draw(labels),
        rank=draw(st.integers(0, 999_999)),
        local_rank=draw(st.integers(0, 999_999)),
        world_size=draw(st.integers(1, 1_000_000)),
    )
    records = [
        StepRecord(
            identity=identity,
            step=draw(st.integers(1, MAX_COUNT)),
            time=draw(st.floats(0.0, MAX_TIME)),
            found_inf_local=draw(st.dictionaries(labels, st.booleans(), max_size=3)),
            found_inf_origin=draw(st.dictionaries(labels, st.booleans(), max_size=3)),
            found_inf_global=draw(st.booleans()),
            skipped=draw(st.booleans()),
            scale_before=draw(scales),
            scale_after=draw(scales),
            growth_tracker=draw(counts),
            event=draw(st.sampled_from(["growth", "backoff", "none", "manual"])),
            optimizers=draw(optimizers),
            nonfinite_params=draw(params),
            totals=draw(totals()),
            setup=draw(setups(identity)),
        )
        for _ in range(draw(st.integers(1, 3)))
    ]
    return IngestBatch(schema_version=1, records=records, dropped_records=draw(counts))


@pytest.fixture(scope="module")
def exporter() -> Iterator[TestClient]:
    # The clock sits at the schema's latest time, so no generated time is refused as
    # post-dated and every batch reaches the store.
    app = create_app(Settings(max_series=2_000_000), clock=FakeClock(MAX_TIME))
    with TestClient(app) as client:
        yield client


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(sequence=st.lists(batches(), min_size=1, max_size=3))
def test_any_valid_batch_leaves_metrics_and_health_servable(
    exporter: TestClient, sequence: list[IngestBatch]
) -> None:
    need_tool("promtool")  # skips before any work when it is missing
    for batch in sequence:
        response = exporter.post(
            "/api/v1/ingest",
            content=batch.model_dump_json(),
            headers={"Content-Type": "application/json"},
        )
        # 409: a generated batch may change a live rank's identity; 429: per-rank limits.
        assert response.status_code in (200, 409, 429), response.text
    metrics = exporter.get("/metrics")
    assert metrics.status_code == 200
    promtool_check_metrics(metrics.text)
    _assert_weather_within_totals(_samples(metrics.text))
    assert "ampscope_exporter_unrenderable_ranks 0.0" in metrics.text
    listing = exporter.get("/api/v1/runs")
    assert listing.status_code == 200
    # Every run /metrics shows is reachable through the JSON API, health included.
    for run in listing.json():
        assert f'run="{run["run"]}"' in metrics.text
        assert exporter.get(f"/api/v1/runs/{run['run']}/ranks").status_code == 200
        health = exporter.get(f"/api/v1/runs/{run['run']}/health")
        assert health.status_code == 200, health.text


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _samples(text: str) -> Samples:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _assert_weather_within_totals(samples: Samples) -> None:
    """Every weather sample has its total's label set, with a value at least its own."""
    for (name, labels_), value in samples.items():
        if name in WEATHER_OF:
            whole = samples.get((WEATHER_OF[name], labels_))
            assert whole is not None, (name, labels_)
            assert value <= whole, (name, labels_, value, whole)


@st.composite
def weathered_records(draw: st.DrawFn) -> list[tuple[dict[str, Any], str | None]]:
    """One rank's records, steps and times rising, as JSON: each with weather within its
    totals (``None``) or beyond them (the field the refusal names)."""
    records = []
    for step in range(1, draw(st.integers(1, 6)) + 1):
        whole = draw(plain_totals)
        beyond = draw(st.booleans())
        weather, field = (
            draw(weather_beyond(whole)) if beyond else (draw(weather_within(whole)), None)
        )
        record = StepRecord(
            identity=Identity(run="weather", node="n0", rank=0, local_rank=0, world_size=1),
            step=step,
            time=1_700_000_000.0 + step,
            found_inf_local={},
            found_inf_origin={},
            found_inf_global=False,
            skipped=False,
            scale_before=1.0,
            scale_after=1.0,
            growth_tracker=0,
            event="none",
            optimizers=[],
            nonfinite_params=[],
            totals=whole,
        ).model_dump(mode="json")
        record["totals"]["weather"] = weather
        records.append((record, field))
    return records


_runs = itertools.count()


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    records=weathered_records(),
    per_batch=st.integers(1, 3),
)
def test_weather_within_totals_is_exposed_and_beyond_them_refused(
    weather_exporter: TestClient,
    records: list[tuple[dict[str, Any], str | None]],
    per_batch: int,
) -> None:
    run = f"weather-{next(_runs)}"  # one exporter for all examples: a run each
    invalid = ("ampscope_exporter_ingest_rejections_total", (("reason", "invalid"),))
    rejected = _samples(weather_exporter.get("/metrics").text)[invalid]
    newest: dict[str, Any] | None = None
    refused = 0
    for at in range(0, len(records), per_batch):
        batch = records[at : at + per_batch]
        for record, _ in batch:
            record["identity"]["run"] = run
        body = {"schema_version": 1, "records": [r for r, _ in batch], "dropped_records": 0}
        response = weather_exporter.post("/api/v1/ingest", content=json.dumps(body))
        beyond = [(i, field) for i, (_, field) in enumerate(batch) if field is not None]
        if not beyond:
            assert response.status_code == 200, response.text
            newest = batch[-1][0]
            continue
        # The whole batch is refused, its first record beyond its totals named.
        refused += 1
        assert response.status_code == 422, response.text
        answer = response.json()
        index, field = beyond[0]
        assert answer["error"] == "invalid"
        assert answer["errors"][0]["loc"] == ["records", index, "totals"]
        assert f"Value error, weather.{field}" in answer["detail"]

    samples = _samples(weather_exporter.get("/metrics").text)
    _assert_weather_within_totals(samples)
    assert samples[invalid] == rejected + refused
    mine = {
        (name, labels_): value
        for (name, labels_), value in samples.items()
        if ("run", run) in labels_ and (name in WEATHER_OF or name in WEATHER_OF.values())
    }
    if newest is None:
        assert mine == {}  # nothing accepted: the rank does not exist
        return
    rank: tuple[tuple[str, str], ...] = (
        ("local_rank", "0"),
        ("node", "n0"),
        ("rank", "0"),
        ("run", run),
    )
    whole, weather = newest["totals"], newest["totals"]["weather"]
    expected: dict[tuple[str, tuple[tuple[str, str], ...]], int] = {
        ("ampscope_skipped_steps_total", rank): whole["skipped_steps"],
        ("ampscope_weather_skipped_steps_total", rank): weather["skipped_steps"],
    }
    for field, total, part in (
        ("found_inf_local", "ampscope_found_inf_total", "ampscope_weather_found_inf_total"),
        (
            "found_inf_origin",
            "ampscope_found_inf_origin_total",
            "ampscope_weather_found_inf_origin_total",
        ),
    ):
        for device, count in whole[field].items():
            labels_ = tuple(sorted([*rank, ("device", str(device))]))
            expected[(total, labels_)] = count
            expected[(part, labels_)] = weather[field].get(device, 0)
    assert mine == {key: float(value) for key, value in expected.items()}


@pytest.fixture(scope="module")
def weather_exporter() -> Iterator[TestClient]:
    app = create_app(
        Settings(max_runs=100_000, max_ranks=100_000, max_series=2_000_000),
        clock=FakeClock(MAX_TIME),
    )
    with TestClient(app) as client:
        yield client
