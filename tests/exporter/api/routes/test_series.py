"""``/api/v1/runs/{run}/series``: every rank's held steps as columns, exact and compact."""

from __future__ import annotations

from fastapi.testclient import TestClient

from exporter.conftest import MakeClient
from exporter.factory import body, record, totals

URL = "/api/v1/ingest"


def _post(client: TestClient, *records) -> None:
    response = client.post(URL, content=body(*records))
    assert response.status_code == 200, response.text


def _overflow(step: int, rank: int, scale: float, origin: bool):
    """A skipped step whose local shards on cuda:0 held inf; origin on cuda:0 when ``origin``."""
    devices = {"cuda:0": 1, "cuda:1": 0}
    return record(
        step,
        rank=rank,
        scale=scale,
        skipped=True,
        total=totals(
            step,
            skipped=1,
            backoffs=1,
            local=devices,
            origin={"cuda:0": int(origin), "cuda:1": 0},
        ),
    ).model_copy(
        update={
            "found_inf_local": {"cuda:0": True, "cuda:1": False},
            "found_inf_origin": {"cuda:0": origin, "cuda:1": False},
        }
    )


def test_columns_align_ranks_on_the_union_of_steps(client: TestClient) -> None:
    # Rank 0 holds steps 1-4, rank 1 steps 2-5; both skip step 3, only rank 1 produced it.
    # Totals are cumulative, as a real rank sends them: after step 3 they carry its overflow
    # (a counter going down would be a restart).
    clean = {"local": {"cuda:0": 0, "cuda:1": 0}, "origin": {"cuda:0": 0, "cuda:1": 0}}

    def after_overflow(step: int, origin: int):
        return totals(
            step,
            skipped=1,
            backoffs=1,
            local={"cuda:0": 1, "cuda:1": 0},
            origin={"cuda:0": origin, "cuda:1": 0},
        )

    _post(
        client,
        record(1, rank=0, scale=8.0, total=totals(1, **clean)),
        record(2, rank=0, scale=8.0, total=totals(2, **clean)),
        _overflow(3, 0, 4.0, origin=False),
        record(4, rank=0, scale=4.0, total=after_overflow(4, origin=0)),
    )
    _post(
        client,
        record(2, rank=1, scale=8.0, total=totals(2, **clean)),
        _overflow(3, 1, 4.0, origin=True),
        record(4, rank=1, scale=4.0, total=after_overflow(4, origin=1)),
        record(5, rank=1, scale=2.0, total=after_overflow(5, origin=1)),
    )
    series = client.get("/api/v1/runs/run-a/series").json()
    assert series == {
        "run": "run-a",
        "ranks": [0, 1],
        "steps": [1, 2, 3, 4, 5],
        "scale": [[8.0, 8.0, 4.0, 4.0, None], [None, 8.0, 4.0, 4.0, 2.0]],
        "skipped": [[3], [3]],
        "backoffs": [[3], [3]],
        "found_inf_local": [
            {"rank": 0, "device": "cuda:0", "steps": [3]},
            {"rank": 0, "device": "cuda:1", "steps": []},
            {"rank": 1, "device": "cuda:0", "steps": [3]},
            {"rank": 1, "device": "cuda:1", "steps": []},
        ],
        "found_inf_origin": [
            {"rank": 0, "device": "cuda:0", "steps": []},
            {"rank": 0, "device": "cuda:1", "steps": []},
            {"rank": 1, "device": "cuda:0", "steps": [3]},
            {"rank": 1, "device": "cuda:1", "steps": []},
        ],
        # No stats reported: no loss or norm, no spikes.
        "loss": [[None] * 5, [None] * 5],
        "grad_norm": [[None] * 5, [None] * 5],
        "spikes": [],
        "oldest_held_step": 1,
        "truncated": False,
    }
    since = client.get("/api/v1/runs/run-a/series", params={"since_step": 3}).json()
    assert since["steps"] == [4, 5]
    assert since["scale"] == [[4.0, None], [4.0, 2.0]]
    assert since["skipped"] == [[], []]
    newest = client.get("/api/v1/runs/run-a/series", params={"max_steps": 2}).json()
    assert (newest["steps"], newest["truncated"]) == ([4, 5], True)
    assert newest["oldest_held_step"] == 1


def test_history_bound_and_errors(make_client: MakeClient) -> None:
    client, _ = make_client(history_length=3)
    _post(client, *[record(s, scale=2.0**s) for s in range(1, 7)])
    series = client.get("/api/v1/runs/run-a/series").json()
    assert series["steps"] == [4, 5, 6]
    assert series["scale"] == [[16.0, 32.0, 64.0]]
    assert series["oldest_held_step"] == 4
    missing = client.get("/api/v1/runs/nope/series")
    assert missing.status_code == 404
    assert missing.json()["error"] == "not_found"
    assert client.get("/api/v1/runs/run-a/series", params={"max_steps": 0}).status_code == 422
    assert client.get("/api/v1/runs/run-a/series", params={"max_steps": 8193}).status_code == 422


def test_documented_in_the_openapi(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    operation = spec["paths"]["/api/v1/runs/{run}/series"]["get"]
    assert {p["name"] for p in operation["parameters"]} == {"run", "since_step", "max_steps"}
    assert "RunSeries" in spec["components"]["schemas"]
    # The web pages are not API operations.
    assert not {"/", "/run", "/docs"} & set(spec["paths"])


def test_loss_grad_norm_and_spike_steps(client: TestClient) -> None:
    from exporter.factory import stats

    # Rank 0's loss spikes at step 25; rank 1 has no stats (stats=False); step 10 overflowed.
    losses = {s: 2.0 + 0.01 * (s % 3) for s in range(1, 26)}
    losses[25] = 30.0
    _post(
        client,
        *(
            record(s, stats=stats(None, None) if s == 10 else stats(losses[s], 1.5))
            for s in range(1, 26)
        ),
    )
    _post(client, *(record(s, rank=1) for s in range(1, 26)))
    got = client.get("/api/v1/runs/run-a/series").json()
    assert got["steps"] == list(range(1, 26))
    expected = [None if s == 10 else losses[s] for s in range(1, 26)]
    assert got["loss"] == [expected, [None] * 25]
    assert got["grad_norm"][0] == [None if s == 10 else 1.5 for s in range(1, 26)]
    assert got["spikes"] == [{"rank": 0, "kind": "loss", "steps": [25]}]
    # A poll after the spike's step still lists it (spikes come whole on every answer).
    polled = client.get("/api/v1/runs/run-a/series?since_step=25").json()
    assert polled["steps"] == []
    assert polled["spikes"] == got["spikes"]
