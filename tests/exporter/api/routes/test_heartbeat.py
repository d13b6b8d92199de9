"""POST /api/v1/heartbeat: keeps an idle rank from being lost, marks a rank finished, and
shows in the API and on /metrics as the rank's state."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from support import DEADLOCK_GUARD_S

from ampscope.exporter.api.routes.heartbeat import MAX_HEARTBEAT_BYTES
from ampscope.exporter.metrics.catalogue import RANK_LABELS
from ampscope.reporter.schema import (
    MAX_FAILURE_MESSAGE,
    MAX_FAILURE_ORIGIN_RANKS,
    MAX_LABEL_LENGTH,
    Heartbeat,
    Identity,
    RankFailure,
    RankPause,
)
from exporter.conftest import MakeClient
from exporter.factory import T0, body, record

URL = "/api/v1/heartbeat"


def _beat(
    *,
    rank: int = 0,
    step: int = 1,
    final: bool = False,
    time: float = T0 + 1,
    node: str = "node0",
    local_rank: int | None = None,
    world_size: int = 2,
    failure: RankFailure | None = None,
    stop_signal: int | None = None,
    pause: RankPause | None = None,
) -> bytes:
    local = rank if local_rank is None else local_rank
    return (
        Heartbeat(
            schema_version=1,
            identity=Identity(
                run="run-a", node=node, rank=rank, local_rank=local, world_size=world_size
            ),
            time=time,
            step=step,
            final=final,
            dropped_records=0,
            failure=failure,
            stop_signal=stop_signal,
            pause=pause,
        )
        .model_dump_json()
        .encode()
    )


def _states(client: TestClient) -> dict[str, dict[str, float]]:
    """{rank: {state: value}} of ampscope_rank_state on one scrape."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        if family.name == "ampscope_rank_state":
            for sample in family.samples:
                out.setdefault(sample.labels["rank"], {})[sample.labels["state"]] = sample.value
    return out


def _pauses(client: TestClient) -> dict[tuple[str, str], float]:
    """{(rank, reason): pause start} of ampscope_rank_pause_start_timestamp_seconds."""
    return {
        (sample.labels["rank"], sample.labels["reason"]): sample.value
        for family in text_string_to_metric_families(client.get("/metrics").text)
        if family.name == "ampscope_rank_pause_start_timestamp_seconds"
        for sample in family.samples
    }


def _tracked_and_exposed(client: TestClient) -> tuple[float, int]:
    """ampscope_exporter_tracked_series and the per-rank samples of the same scrape."""
    tracked, exposed = -1.0, 0
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "ampscope_exporter_tracked_series":
                tracked = sample.value
            elif set(RANK_LABELS) <= set(sample.labels):
                exposed += 1
    return tracked, exposed


def _rejected(client: TestClient, reason: str) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        if family.name == "ampscope_exporter_ingest_rejections":
            for sample in family.samples:
                if sample.labels["reason"] == reason:
                    return sample.value
    raise AssertionError(f"no rejection count for {reason!r}")


def _state(client: TestClient, rank: int = 0) -> str:
    return str(client.get(f"/api/v1/runs/run-a/ranks/{rank}").json()["state"])


def test_heartbeats_move_a_rank_through_every_state(make_client: MakeClient) -> None:
    client, clock = make_client(stale_after_s=60, stall_after_s=120)
    assert client.post("/api/v1/ingest", content=body(record(1))).status_code == 200
    assert _state(client) == "running"
    assert _states(client) == {
        "0": {"running": 1, "stalled": 0, "lost": 0, "finished": 0, "failed": 0, "stopped": 0}
    }
    # Idle but beating every 50 s: never lost, stalled once no step for 120 s.
    for _ in range(3):
        clock.advance(50)
        answer = client.post(URL, content=_beat())
        assert answer.json() == {"applied": True, "heartbeat_interval_s": 15.0}
    assert _state(client) == "stalled"
    assert _states(client)["0"] == {
        "running": 0,
        "stalled": 1,
        "lost": 0,
        "finished": 0,
        "failed": 0,
        "stopped": 0,
    }
    clock.advance(61)
    assert _state(client) == "lost"
    assert client.get("/api/v1/runs/run-a/ranks/0").json()["up"] is False
    # A new step: running again; the final heartbeat: finished, for good.
    assert client.post("/api/v1/ingest", content=body(record(2, time=T0 + 300))).status_code == 200
    assert _state(client) == "running"
    assert client.post(URL, content=_beat(step=2, final=True)).json()["applied"] is True
    clock.advance(10_000)
    assert _state(client) == "finished"
    assert _states(client)["0"] == {
        "running": 0,
        "stalled": 0,
        "lost": 0,
        "finished": 1,
        "failed": 0,
        "stopped": 0,
    }
    report = client.get("/api/v1/runs/run-a/health").json()
    assert (report["status"], report["state"]) == ("ok", "finished")


def test_a_pause_shows_on_metrics_while_the_rank_holds_it(make_client: MakeClient) -> None:
    # Prometheus and the dashboard would otherwise see a running rank whose step stays flat.
    client, clock = make_client(stale_after_s=60, stall_after_s=120, pause_limit_s=600)
    assert client.post("/api/v1/ingest", content=body(record(1, time=T0))).status_code == 200
    assert _pauses(client) == {}
    clock.advance(50)
    save = RankPause(reason="checkpoint", seconds=40.0)
    assert client.post(URL, content=_beat(time=T0 + 50, pause=save)).json()["applied"] is True
    began = clock() - 40.0
    assert _pauses(client) == {("0", "checkpoint"): began}
    tracked, exposed = _tracked_and_exposed(client)
    assert tracked == exposed  # the limit on series counts the pause's
    # Past stall_after_s, still paused: running, and the series says why.
    for t in range(100, 601, 50):
        clock.advance(50)
        later = RankPause(reason="checkpoint", seconds=t - 10.0)
        assert client.post(URL, content=_beat(time=T0 + t, pause=later)).status_code == 200
    assert (_state(client), _pauses(client)) == ("running", {("0", "checkpoint"): began})
    # Past pause_limit_s: stalled, and the pause still shown beside it.
    clock.advance(50)
    late = RankPause(reason="checkpoint", seconds=640.0)
    assert client.post(URL, content=_beat(time=T0 + 650, pause=late)).status_code == 200
    assert (_state(client), _pauses(client)) == ("stalled", {("0", "checkpoint"): began})
    # The save returned: a heartbeat without a pause ends it.
    clock.advance(10)
    assert client.post(URL, content=_beat(time=T0 + 660)).status_code == 200
    assert _pauses(client) == {}
    tracked, exposed = _tracked_and_exposed(client)
    assert tracked == exposed
    # A pause the rank never ended (it began before a newer step, on the rank's clock) is a
    # leftover: not shown, as the lifecycle ignores it.
    clock.advance(10)
    step = body(record(2, time=T0 + 670))
    assert client.post("/api/v1/ingest", content=step).status_code == 200
    old = RankPause(reason="eval", seconds=600.0)
    assert client.post(URL, content=_beat(step=2, time=T0 + 680, pause=old)).status_code == 200
    assert (_state(client), _pauses(client)) == ("running", {})
    # A paused rank's goodbye: no pause on a finished rank.
    fresh = RankPause(reason="checkpoint", seconds=1.0)
    assert client.post(URL, content=_beat(step=2, time=T0 + 690, pause=fresh)).status_code == 200
    assert set(_pauses(client)) == {("0", "checkpoint")}
    assert client.post(URL, content=_beat(step=2, time=T0 + 691, final=True)).status_code == 200
    assert (_state(client), _pauses(client)) == ("finished", {})


def test_heartbeat_of_an_unknown_rank_creates_nothing(client: TestClient) -> None:
    answer = client.post(URL, content=_beat(rank=3))
    assert answer.status_code == 200
    assert answer.json()["applied"] is False
    assert client.get("/api/v1/runs").json() == []


def test_heartbeat_is_validated_strictly_and_needs_the_token(make_client: MakeClient) -> None:
    client, _ = make_client(token="secret")
    auth = {"Authorization": "Bearer secret"}
    assert client.post(URL, content=_beat()).status_code == 401
    bad = _beat().replace(b'"final":false', b'"final":"no"')
    answer = client.post(URL, content=bad, headers=auth)
    assert answer.status_code == 422
    assert "final" in answer.json()["detail"]
    assert client.post(URL, content=b"{", headers=auth).status_code == 400
    assert client.post(URL, content=b" " * 20_000, headers=auth).status_code == 413


def test_finished_ranks_are_dropped_after_finished_retention(make_client: MakeClient) -> None:
    import time

    client, clock = make_client(
        retention_s=100_000, finished_retention_s=600, prune_interval_s=0.02
    )
    client.post("/api/v1/ingest", content=body(record(1, rank=0), record(2, rank=0)))
    client.post("/api/v1/ingest", content=body(record(1, rank=1)))
    client.post(URL, content=_beat(rank=0, step=2, final=True))
    clock.advance(601)
    deadline = time.monotonic() + DEADLOCK_GUARD_S  # only a hang waits this long
    while len(client.get("/api/v1/runs/run-a/ranks").json()) > 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    # The finished rank is gone; the silent one (lost) stays until --retention.
    assert [r["rank"] for r in client.get("/api/v1/runs/run-a/ranks").json()] == [1]


def test_an_oversized_heartbeat_names_its_own_limit(client: TestClient) -> None:
    response = client.post(URL, content=b" " * 17000 + _beat())
    assert response.status_code == 413
    error = response.json()
    assert error["error"] == "too_large"
    assert error["limit"] == "heartbeat_bytes"
    assert error["value"] == 16384
    assert "a heartbeat is a few hundred bytes" in error["detail"]
    assert "records per batch" not in error["detail"]


def test_a_heartbeat_naming_another_identity_is_refused_as_a_record_would_be(
    make_client: MakeClient,
) -> None:
    client, clock = make_client(stale_after_s=60)
    assert client.post("/api/v1/ingest", content=body(record(1), record(2))).status_code == 200
    # Another job reusing the run id: same (run, rank), another node, local rank or world
    # size. Its beats must neither keep the silent rank alive nor finish it.
    changes: list[dict[str, Any]] = [{"node": "other"}, {"local_rank": 5}, {"world_size": 64}]
    for change in changes:
        clock.advance(20)
        for final in (False, True):
            answer = client.post(URL, content=_beat(step=9, final=final, **change))
            assert answer.status_code == 409
            error = answer.json()
            assert error["error"] == "identity_conflict"
            assert "the live rank is node 'node0', local_rank 0, world_size 2" in error["detail"]
    assert _rejected(client, "identity_conflict") == 6
    clock.advance(1)
    rank = client.get("/api/v1/runs/run-a/ranks/0").json()
    assert (rank["state"], rank["seconds_since_report"], rank["step"]) == ("lost", 61.0, 2)
    # The genuine rank's beat still applies.
    answer = client.post(URL, content=_beat(step=2))
    assert (answer.status_code, answer.json()["applied"]) == (200, True)
    assert _state(client) == "running"
    # After a restart onto another node, a late beat of the dead process is merely not
    # applied (as its records are ignored), and the new process's beats apply.
    restart = record(1, time=T0 + 55, node="other")
    assert client.post("/api/v1/ingest", content=body(restart)).status_code == 200
    assert client.post(URL, content=_beat(step=2, time=T0 + 50)).json()["applied"] is False
    answer = client.post(URL, content=_beat(step=1, time=T0 + 56, node="other", final=True))
    assert answer.json()["applied"] is True
    assert _state(client) == "finished"
    assert _rejected(client, "identity_conflict") == 6


def _failure(**overrides: Any) -> RankFailure:
    fields: dict[str, Any] = {
        "kind": "nonfinite_gradients",
        "exception": "NonFiniteGradientsError",
        "message": "ampscope: non-finite gradients at step 2: policy 'raise' stops",
        "step": 2,
        "origin_ranks": [0],
        "seen_by": "uncaught",
    }
    fields.update(overrides)
    return RankFailure(**fields)


def _failure_info(client: TestClient) -> list[dict[str, str]]:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        if family.name == "ampscope_rank_failure_info":
            return [dict(sample.labels) for sample in family.samples if sample.value == 1]
    raise AssertionError("no ampscope_rank_failure_info family")


def test_a_final_heartbeat_with_a_failure_shows_the_rank_failed_everywhere(
    make_client: MakeClient,
) -> None:
    client, clock = make_client(stale_after_s=60)
    body_ = body(record(1), record(2))
    assert client.post("/api/v1/ingest", content=body_).status_code == 200
    other = body(record(1, rank=1), record(2, rank=1))
    assert client.post("/api/v1/ingest", content=other).status_code == 200
    series = _tracked_series(client)
    assert _failure_info(client) == []
    beat = _beat(step=2, final=True, failure=_failure())
    assert client.post(URL, content=beat).json()["applied"] is True
    clock.advance(10_000)  # ended: never lost
    view = client.get("/api/v1/runs/run-a/ranks/0").json()
    assert view["state"] == "failed"
    assert view["failure"] == _failure().model_dump()
    assert client.get("/api/v1/runs/run-a/ranks/1").json()["failure"] is None
    assert _states(client)["0"] == {
        "running": 0,
        "stalled": 0,
        "lost": 0,
        "finished": 0,
        "failed": 1,
        "stopped": 0,
    }
    assert _failure_info(client) == [
        {
            "run": "run-a",
            "node": "node0",
            "rank": "0",
            "local_rank": "0",
            "exception": "NonFiniteGradientsError",
            "kind": "nonfinite_gradients",
            "origin": "yes",
        }
    ]
    assert _tracked_series(client) == series + 1  # the failure info, counted
    report = client.get("/api/v1/runs/run-a/health").json()
    verdicts = {v["rule"]: v for v in report["verdicts"]}
    assert report["status"] == "critical"
    assert report["state"] == "active"  # rank 1 was never heard from again: lost
    assert verdicts["rank_failed"]["status"] == "critical"
    assert verdicts["rank_failed"]["evidence"]["origin_ranks"] == [0]
    summary = client.get("/api/v1/runs").json()[0]
    assert summary["states"] == {
        "running": 0,
        "stalled": 0,
        "lost": 1,
        "finished": 0,
        "failed": 1,
        "stopped": 0,
    }
    # Rank 1 failed too, after its last step, on another exception; origin unknown.
    boom = _failure(kind="exception", exception="RuntimeError", message="boom", origin_ranks=None)
    assert client.post(URL, content=_beat(rank=1, step=2, final=True, failure=boom)).json()[
        "applied"
    ]
    assert [i["origin"] for i in _failure_info(client)] == ["yes", "unknown"]
    report = client.get("/api/v1/runs/run-a/health").json()
    assert (report["status"], report["state"]) == ("critical", "failed")
    # A new process of rank 0 (an elastic restart): running, its failure info gone.
    restarted = body(record(1, time=T0 + 9_000))
    assert client.post("/api/v1/ingest", content=restarted).status_code == 200
    assert client.get("/api/v1/runs/run-a/ranks/0").json()["failure"] is None
    assert [i["rank"] for i in _failure_info(client)] == ["1"]
    assert _tracked_series(client) == series + 1


def test_a_rank_stopped_by_sigterm_reads_stopped_everywhere_and_comes_back_running(
    make_client: MakeClient,
) -> None:
    client, clock = make_client(stale_after_s=60)
    for rank in (0, 1):
        batch = body(record(1, rank=rank), record(2, rank=rank))
        assert client.post("/api/v1/ingest", content=batch).status_code == 200
    for rank in (0, 1):  # torchrun stopped both workers (SIGTERM) to restart them
        beat = _beat(rank=rank, step=2, final=True, stop_signal=15)
        assert client.post(URL, content=beat).json()["applied"] is True
    clock.advance(3600)  # far past the stale TTL: said goodbye, never lost
    view = client.get("/api/v1/runs/run-a/ranks/0").json()
    assert (view["state"], view["stop_signal"], view["up"]) == ("stopped", 15, False)
    assert _states(client)["0"] == {
        "running": 0,
        "stalled": 0,
        "lost": 0,
        "finished": 0,
        "failed": 0,
        "stopped": 1,
    }
    report = client.get("/api/v1/runs/run-a/health").json()
    verdicts = {v["rule"]: v for v in report["verdicts"]}
    assert (report["status"], report["state"]) == ("ok", "stopped")
    assert verdicts["lost_rank"]["status"] == "ok"
    # The next generation: rank 0 again, a new process from step 1: running, signal gone.
    restarted = body(record(1, time=T0 + 3700))
    assert client.post("/api/v1/ingest", content=restarted).status_code == 200
    view = client.get("/api/v1/runs/run-a/ranks/0").json()
    assert (view["state"], view["stop_signal"], view["restarts"]) == ("running", None, 1)
    assert client.get("/api/v1/runs/run-a/health").json()["state"] == "active"


def test_only_a_final_heartbeat_may_carry_a_stop_signal(client: TestClient) -> None:
    assert client.post("/api/v1/ingest", content=body(record(1))).status_code == 200
    bad = _beat(step=1, final=True, stop_signal=15).replace(b'"final":true', b'"final":false')
    answer = client.post(URL, content=bad)
    assert answer.status_code == 422
    assert "only a final heartbeat carries a stop_signal" in answer.json()["detail"]
    assert client.get("/api/v1/runs/run-a/ranks/0").json()["state"] == "running"


def test_only_a_final_heartbeat_may_carry_a_failure(client: TestClient) -> None:
    assert client.post("/api/v1/ingest", content=body(record(1))).status_code == 200
    bad = _beat(step=1, final=True, failure=_failure()).replace(b'"final":true', b'"final":false')
    answer = client.post(URL, content=bad)
    assert answer.status_code == 422
    assert "only a final heartbeat carries a failure" in answer.json()["detail"]
    assert client.get("/api/v1/runs/run-a/ranks/0").json()["state"] == "running"


def test_the_largest_valid_failure_fits_the_heartbeat_bound(client: TestClient) -> None:
    assert client.post("/api/v1/ingest", content=body(record(1))).status_code == 200
    # Every character of the message escaped to six bytes, the longest class name, and as
    # many origin ranks as allowed, each of six digits.
    largest = _failure(
        message="\x00" * MAX_FAILURE_MESSAGE,
        exception="E" * MAX_LABEL_LENGTH,
        origin_ranks=list(range(999_999 - MAX_FAILURE_ORIGIN_RANKS + 1, 1_000_000)),
    )
    beat = _beat(step=1, final=True, failure=largest)
    assert len(beat) < MAX_HEARTBEAT_BYTES
    assert client.post(URL, content=beat).json()["applied"] is True
    assert client.get("/api/v1/runs/run-a/ranks/0").json()["failure"]["message"] == largest.message


def _tracked_series(client: TestClient) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        if family.name == "ampscope_exporter_tracked_series":
            return family.samples[0].value
    raise AssertionError("no ampscope_exporter_tracked_series")
