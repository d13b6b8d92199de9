"""The JSON query API: runs, ranks, history pages, health verdicts, 404s, staleness."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient
from support import DEADLOCK_GUARD_S

from ampscope.verdicts.verdict import FP8_RULES, RULES
from exporter.conftest import MakeClient
from exporter.factory import T0, body, record, steps, totals, watch

URL = "/api/v1/ingest"


def _post(client: TestClient, *records) -> None:
    response = client.post(URL, content=body(*records))
    assert response.status_code == 200, response.text


def test_runs_ranks_and_one_rank(make_client: MakeClient) -> None:
    client, clock = make_client()
    _post(client, *steps(1, 5, rank=0, node="n0"))
    clock.advance(30)
    _post(
        client,
        *steps(1, 7, rank=1, node="n1"),
        record(
            8,
            rank=1,
            node="n1",
            scale=32768.0,
            skipped=True,
            total=totals(8, skipped=1, backoffs=1),
        ),
    )
    _post(client, record(1, run="other"))
    clock.advance(40)  # rank 0 silent for 70 s: lost; rank 1 for 40 s: up
    runs = client.get("/api/v1/runs").json()
    assert runs == [
        {
            "run": "other",
            "ranks": 1,
            "up": 1,
            "stale": 0,
            "states": {
                "running": 1,
                "stalled": 0,
                "lost": 0,
                "finished": 0,
                "failed": 0,
                "stopped": 0,
            },
            "world_size": 2,
            "newest_step": 1,
            "last_report_time": T0 + 30,
        },
        {
            "run": "run-a",
            "ranks": 2,
            "up": 1,
            "stale": 1,
            "states": {
                "running": 1,
                "stalled": 0,
                "lost": 1,
                "finished": 0,
                "failed": 0,
                "stopped": 0,
            },
            "world_size": 2,
            "newest_step": 8,
            "last_report_time": T0 + 30,
        },
    ]
    ranks = client.get("/api/v1/runs/run-a/ranks").json()
    assert [(r["rank"], r["node"], r["step"], r["up"], r["state"]) for r in ranks] == [
        (0, "n0", 5, False, "lost"),
        (1, "n1", 8, True, "running"),
    ]
    one = client.get("/api/v1/runs/run-a/ranks/1").json()
    assert one["scale"] == 32768.0
    assert one["last_event"] == "backoff"
    assert one["last_skipped"] is True
    assert one["totals"]["skipped_steps"] == 1
    assert one["seconds_since_report"] == 40
    assert one["step_time"] == T0 + 8


def test_not_found_answers(client: TestClient) -> None:
    _post(client, record(1))
    for path in (
        "/api/v1/runs/nope/ranks",
        "/api/v1/runs/nope/health",
        "/api/v1/runs/nope/ranks/0",
        "/api/v1/runs/nope/suspect-batches",
    ):
        response = client.get(path)
        assert response.status_code == 404, path
        assert "unknown run 'nope'" in response.json()["detail"]
    response = client.get("/api/v1/runs/run-a/ranks/5/history")
    assert response.status_code == 404
    assert response.json() == {"error": "not_found", "detail": "run 'run-a' has no rank 5"}
    assert client.get("/api/v1/runs/run-a/ranks/-1").status_code == 422


def test_history_pages_and_caps(make_client: MakeClient) -> None:
    client, _ = make_client(history_length=50, history_limit_max=20)
    _post(client, *steps(1, 60))
    url = "/api/v1/runs/run-a/ranks/0/history"
    # Without since_step: the newest records (oldest first), and nothing after them.
    page = client.get(url, params={"limit": 1000}).json()
    assert (page["oldest_held_step"], page["newest_held_step"], page["capacity"]) == (11, 60, 50)
    assert [r["step"] for r in page["records"]] == list(range(41, 61))  # capped at 20
    assert page["next_since_step"] is None
    assert [r["step"] for r in client.get(url, params={"limit": 3}).json()["records"]] == [
        58,
        59,
        60,
    ]
    # Paging forwards from the oldest held record.
    page = client.get(url, params={"since_step": 0, "limit": 1000}).json()
    assert [r["step"] for r in page["records"]] == list(range(11, 31))  # capped at 20
    assert page["next_since_step"] == 30
    page = client.get(url, params={"since_step": 30, "limit": 20}).json()
    assert [r["step"] for r in page["records"]] == list(range(31, 51))
    page = client.get(url, params={"since_step": 50, "limit": 20}).json()
    assert [r["step"] for r in page["records"]] == list(range(51, 61))
    assert page["next_since_step"] is None
    assert page["records"][0]["identity"]["run"] == "run-a"
    assert client.get(url, params={"limit": 0}).status_code == 422


def test_health_endpoint_reports_a_collapse(client: TestClient) -> None:
    _post(client, record(1, scale=65536.0), record(2, scale=128.0, scale_before=65536.0))
    report = client.get("/api/v1/runs/run-a/health").json()
    assert report["status"] == "critical"
    verdicts = {v["rule"]: v for v in report["verdicts"]}
    # A run without FP8 layers is not judged by the FP8 rules.
    assert list(verdicts) == [r for r in RULES if r not in FP8_RULES]
    assert verdicts["scale_collapse"]["status"] == "critical"
    assert verdicts["scale_collapse"]["evidence"]["ranks"][0]["fall_factor"] == 512.0
    assert verdicts["skip_storm"]["status"] == "ok"


def test_a_watch_run_says_what_it_runs_and_that_it_applied_inf(client: TestClient) -> None:
    broken = totals(6, local={"cuda:0": 2}, applied=2, first_applied=(5, True))
    for rank in (0, 1):
        _post(
            client,
            *[watch(s, rank=rank, grad_dtype="bfloat16") for s in range(1, 5)],
            watch(6, rank=rank, found_inf=True, total=broken),
        )
    ranks = client.get("/api/v1/runs/run-a/ranks").json()
    assert [r["setup"] for r in ranks] == [
        {"mode": "watch", "policy": "observe", "grad_dtype": "bfloat16"}
    ] * 2
    assert ranks[0]["totals"]["nonfinite_applied"] == 2
    assert ranks[0]["totals"]["first_nonfinite_applied"] == {"step": 5, "origin": True}
    report = client.get("/api/v1/runs/run-a/health").json()
    verdict = {v["rule"]: v for v in report["verdicts"]}["nonfinite_update_applied"]
    assert (report["status"], verdict["status"]) == ("critical", "critical")
    assert (verdict["evidence"]["first_step"], verdict["evidence"]["origin_ranks"]) == (5, [0, 1])
    # No scale in the web view's columns: a watch's 1.0 is not a loss scale.
    series = client.get("/api/v1/runs/run-a/series").json()
    assert series["steps"] == [1, 2, 3, 4, 6]
    assert series["scale"] == [[None] * 5, [None] * 5]
    # A reporter that predates the setup field is a scaler.
    _post(client, record(3, run="old"))
    (old,) = client.get("/api/v1/runs/old/ranks").json()
    assert old["setup"] == {"mode": "scaler", "policy": "skip", "grad_dtype": None}


def test_background_task_drops_expired_ranks(make_client: MakeClient) -> None:
    client, clock = make_client(stale_after_s=60, retention_s=600, prune_interval_s=0.02)
    _post(client, record(1, rank=0))
    clock.advance(500)
    _post(client, record(1, rank=1))
    clock.advance(101)  # rank 0 silent 601 s: past retention
    deadline = time.monotonic() + DEADLOCK_GUARD_S  # only a hang waits this long
    while len(client.get("/api/v1/runs/run-a/ranks").json()) > 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [r["rank"] for r in client.get("/api/v1/runs/run-a/ranks").json()] == [1]
    clock.advance(600)
    while client.get("/api/v1/runs").json() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.get("/api/v1/runs").json() == []
    assert client.get("/api/v1/runs/run-a/ranks").status_code == 404
    assert "ampscope_loss_scale{" not in client.get("/metrics").text


def test_liveness_and_openapi(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    spec = client.get("/openapi.json").json()
    ingest = spec["paths"]["/api/v1/ingest"]["post"]
    assert ingest["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/IngestBatch"
    )
    assert "IngestBatch" in spec["components"]["schemas"]
    assert {"400", "401", "413", "422", "429"} <= set(ingest["responses"])
    assert "/api/v1/runs/{run}/ranks/{rank}/history" in spec["paths"]
    heartbeat = spec["paths"]["/api/v1/heartbeat"]["post"]
    schema = heartbeat["requestBody"]["content"]["application/json"]["schema"]
    assert schema == {"$ref": "#/components/schemas/Heartbeat"}
    assert spec["components"]["schemas"]["Heartbeat"]["properties"]["final"]["type"] == "boolean"
    assert client.get("/docs").status_code == 200
    schemas = spec["components"]["schemas"]
    assert schemas["RankView"]["properties"]["setup"]["$ref"] == "#/components/schemas/Setup"
    assert "nonfinite_update_applied" in schemas["Verdict"]["properties"]["rule"]["enum"]


def test_suspect_batches_and_the_evidence_name_the_ids(client: TestClient) -> None:
    from ampscope.reporter.schema import BatchIds

    flagged = watch(
        3, found_inf=True, total=totals(3, applied=1, first_applied=(3, None)),
        batch=BatchIds(ids=[30, "doc-31"], left_out=2),
    )  # fmt: skip
    _post(client, watch(1, batch=BatchIds(ids=[10])), watch(2), flagged)
    assert client.get("/api/v1/runs/run-a/suspect-batches").json() == [
        {
            "step": 3,
            "rank": 0,
            "reasons": ["nonfinite_update_applied"],
            "batch_ids": [30, "doc-31"],
            "batch_ids_left_out": 2,
        }
    ]
    verdicts = client.get("/api/v1/runs/run-a/health").json()["verdicts"]
    applied = next(v for v in verdicts if v["rule"] == "nonfinite_update_applied")
    assert applied["evidence"]["ranks"][0]["batch_ids"] == [30, "doc-31"]
