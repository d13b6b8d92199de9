"""``ampscope status``'s tables of a bf16/fp32 watch run, from the API's real answers."""

from __future__ import annotations

from exporter.factory import FakeClock, body, record, totals, watch
from fastapi.testclient import TestClient

from ampscope.exporter.app import create_app
from ampscope.exporter.settings import Settings
from ampscope.reporter.schema import Heartbeat, RankPause
from ampscope.status import render
from ampscope.status.main import exit_status


def _answers(*records, beats: tuple[Heartbeat, ...] = ()) -> tuple[list, dict, dict]:
    """(GET /api/v1/runs, each run's /ranks, each run's /health) after posting ``records``
    one batch per rank, then ``beats``."""
    with TestClient(create_app(Settings(), clock=FakeClock())) as client:
        by_rank: dict[tuple[str, int], list] = {}
        for rec in records:
            by_rank.setdefault((rec.identity.run, rec.identity.rank), []).append(rec)
        for batch in by_rank.values():
            assert client.post("/api/v1/ingest", content=body(*batch)).status_code == 200
        for beat in beats:
            answer = client.post("/api/v1/heartbeat", content=beat.model_dump_json())
            assert answer.json()["applied"] is True
        runs = client.get("/api/v1/runs").json()
        ranks = {r["run"]: client.get(f"/api/v1/runs/{r['run']}/ranks").json() for r in runs}
        health = {r["run"]: client.get(f"/api/v1/runs/{r['run']}/health").json() for r in runs}
    return runs, ranks, health


def _broken(step: int, rank: int, origin: bool) -> object:
    return watch(
        step,
        run="bf16",
        rank=rank,
        found_inf=True,
        total=totals(step, local={"cuda:0": 2}, applied=2, first_applied=(step - 1, origin)),
    )


def test_a_watch_run_shows_its_mode_no_scale_and_the_applied_verdict() -> None:
    runs, ranks, health = _answers(
        *[watch(s, run="bf16", rank=r) for r in (0, 1) for s in range(1, 8)],
        _broken(9, 0, origin=False),
        _broken(9, 1, origin=True),
        *[record(s, run="fp16", scale=2.0**14) for s in range(1, 4)],
    )
    lines = render.runs_table(runs, ranks, health)
    assert lines[0].split()[5:7] == ["MODE", "SCALE"]
    # The states column says "2 running": one word more than its header.
    bf16, fp16 = lines[1].split(), lines[2].split()
    assert [bf16[0], bf16[1], *bf16[6:8]] == ["bf16", "CRITICAL", "watch/observe", "none"]
    assert [fp16[0], fp16[1], *fp16[6:8]] == ["fp16", "OK", "scaler", "2^14"]
    assert any("nonfinite_update_applied" in line and "since step 8" in line for line in lines)
    assert exit_status({"runs": runs, "ranks": ranks, "health": health}) == 2

    lines = render.run_table("bf16", ranks["bf16"], health["bf16"])
    assert lines[0] == (
        "run bf16: CRITICAL, 2/2 rank(s) up (2 running); no loss scale: bfloat16 watch, "
        "policy observe"
    )
    header = lines[2].split()
    assert header[4:6] == ["MODE", "SCALE"]
    assert header[-4:] == ["INF", "APPLIED", "LAST", "REPORT"]
    for line in lines[3:5]:
        cells = line.split()
        assert cells[4:8] == ["watch/observe", "none", "0/9", "-"]  # no scale, no backoffs
        assert cells[-3] == "2"  # updates applied on inf/NaN (then "0s ago")
    (verdict,) = [line for line in lines if "nonfinite_update_applied" in line]
    assert verdict.split()[0] == "CRIT"
    assert verdict.endswith("the weights hold inf/NaN since step 8; origin: rank(s) 1")


def test_a_scaler_run_reads_as_before() -> None:
    _, ranks, health = _answers(*[record(s, scale=2.0**16) for s in range(1, 4)])
    lines = render.run_table("run-a", ranks["run-a"], health["run-a"])
    assert lines[0].endswith("(1 running); loss scaler")  # a reporter without setup
    cells = lines[3].split()
    assert cells[4:8] == ["scaler", "2^16", "0/3", "0"]
    assert cells[-3] == "0"


def test_a_rank_its_launcher_stopped_reads_stopped_and_is_no_outlier() -> None:
    last = record(3, rank=1)
    goodbye = Heartbeat(
        schema_version=1,
        identity=last.identity,
        time=last.time + 1,
        step=3,
        final=True,
        dropped_records=0,
        stop_signal=15,
    )
    records = [record(s, rank=r) for r in (0, 1) for s in range(1, 4)]
    _, ranks, health = _answers(*records, beats=(goodbye,))
    assert health["run-a"]["status"] == "ok"
    lines = render.run_table("run-a", ranks["run-a"], health["run-a"])
    assert "(1 running, 1 stopped)" in lines[0]
    assert [line.split()[2] for line in lines[3:5]] == ["running", "stopped"]
    job = render.job_table("run-a", ranks["run-a"], health["run-a"], [], [])
    assert not any(line.startswith("RANK") for line in job)  # no outlier: said goodbye


def test_a_paused_rank_reads_running_and_paused_through_the_api_and_the_tables() -> None:
    from ampscope.status.merge import facts_of
    from ampscope.verdicts.liveness import stalled_rank
    from ampscope.verdicts.thresholds import Thresholds

    clock = FakeClock()
    with TestClient(create_app(Settings(), clock=clock)) as client:
        first = record(1)
        assert client.post("/api/v1/ingest", content=body(first)).status_code == 200
        clock.advance(690)  # a checkpoint save: past the stall limit, heard all along
        beat = Heartbeat(
            schema_version=1,
            identity=first.identity,
            time=first.time + 690,
            step=1,
            final=False,
            dropped_records=0,
            pause=RankPause(reason="checkpoint", seconds=689.0),
        )
        answer = client.post("/api/v1/heartbeat", content=beat.model_dump_json())
        assert answer.json()["applied"] is True
        clock.advance(10)
        ranks = client.get("/api/v1/runs/run-a/ranks").json()
        health = client.get("/api/v1/runs/run-a/health").json()
    (view,) = ranks
    assert (view["state"], view["pause"]) == ("running", {"reason": "checkpoint", "seconds": 699.0})
    lines = render.run_table("run-a", ranks, health)
    assert "running, paused (checkpoint) for 699 s" in lines[3]
    (verdict,) = [v for v in health["verdicts"] if v["rule"] == "stalled_rank"]
    assert verdict["status"] == "ok"
    # `ampscope status --url A --url B` judges the merged ranks again: the same words.
    again = stalled_rank(facts_of(ranks), Thresholds())
    assert again.summary == verdict["summary"]
    assert again.summary.endswith("rank 0 (node node0) paused (checkpoint) for 699 s")
