"""Property: whatever validation accepts, /metrics and the health API can always serve.

Hypothesis generates schema-valid batches that reach every bound of the schema (counts
up to 2**53, scales from 0 through the largest finite float, label and parameter names
at their longest), ingests them into one exporter app, and after each example checks
that /metrics answers 200 with text ``promtool check metrics`` accepts and that every
run's health answers 200.
"""

from __future__ import annotations

import string

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
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
    RankTotals,
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
totals = st.builds(
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
optimizers = st.lists(
    st.builds(
        OptimizerDetail, index=counts, name=labels, found_inf=st.booleans(), fused=st.booleans()
    ),
    max_size=3,
)


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
            totals=draw(totals),
        )
        for _ in range(draw(st.integers(1, 3)))
    ]
    return IngestBatch(schema_version=1, records=records, dropped_records=draw(counts))


@pytest.fixture(scope="module")
def exporter() -> TestClient:
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
    assert "ampscope_exporter_unrenderable_ranks 0.0" in metrics.text
    listing = exporter.get("/api/v1/runs")
    assert listing.status_code == 200
    # Every run /metrics shows is reachable through the JSON API, health included.
    for run in listing.json():
        assert f'run="{run["run"]}"' in metrics.text
        assert exporter.get(f"/api/v1/runs/{run['run']}/ranks").status_code == 200
        health = exporter.get(f"/api/v1/runs/{run['run']}/health")
        assert health.status_code == 200, health.text
