"""The cached /metrics renderer: byte-equal to the collector's, re-rendering only what changed."""

from __future__ import annotations

import gzip

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ampscope.exporter.api.routes.metrics import accepts_gzip
from ampscope.reporter.schema import Heartbeat, Identity, RankPause
from exporter.conftest import MakeClient
from exporter.factory import T0, body, record, stats, totals, watch

URL = "/api/v1/ingest"


def _post(client: TestClient, *records, dropped: int = 0) -> None:
    response = client.post(URL, content=body(*records, dropped=dropped))
    assert response.status_code == 200, response.text


def _rich(steps: int, aligned: tuple[int, float] | None = None) -> object:
    return totals(
        steps,
        skipped=3,
        backoffs=3,
        growths=1,
        local={"cuda:0": 2, "cuda:1": 1, "cuda:10": 0},
        origin={"cuda:1": 1},
        params={"layers.0.attn.wo.weight": 4096, "blocks.0.ff[1].w{a=b,c}": 7, "z": 1},
        aligned=aligned,
    )


def _reference(client: TestClient) -> bytes:
    """What prometheus_client makes of the StoreCollector for the same state."""
    registry = client.app.state.registry  # type: ignore[attr-defined]
    return generate_latest(registry)


def _scrape(client: TestClient) -> bytes:
    response = client.get("/metrics", headers={"Accept-Encoding": "identity"})
    assert response.status_code == 200
    assert "content-encoding" not in response.headers
    return response.content


def test_bytes_equal_the_collectors_through_changes(make_client: MakeClient) -> None:
    client, clock = make_client(stale_after_s=60)
    assert _scrape(client) == _reference(client)  # no ranks at all
    _post(client, record(1, scale=0.5))
    for rank in range(4):
        _post(
            client,
            record(
                12 + rank,
                rank=rank,
                node=f"node{rank % 2}",
                scale=2.0**-20 * (rank + 1),
                growth_tracker=rank,
                total=_rich(12 + rank, (10, 1e21) if rank % 2 else None),
            ),
            dropped=rank * 5,
        )
    assert _scrape(client) == _reference(client)
    # Watch ranks: an info line with eight labels beyond the rank's, and no scale lines.
    _post(client, watch(9, rank=4, policy="skip", grad_dtype="torch.bfloat16"))
    _post(
        client,
        watch(9, rank=5, grad_dtype=None, total=totals(9, applied=2, first_applied=(8, None))),
    )
    text = _scrape(client)
    assert text == _reference(client)
    assert (
        b'ampscope_rank_info{device="node0:4",grad_dtype="torch.bfloat16",hostname="",job_id="",'
        b'local_rank="4",mode="watch",node="node0",pci_bus_id="",policy="skip",rank="4",'
        b'run="run-a",world_size="2"} 1.0\n' in text
    )
    assert b'ampscope_loss_scale{local_rank="4"' not in text
    _post(client, record(13, time=T0 + 200, total=totals(13)), dropped=1)  # rank 0 restarts
    _post(client, record(20, run="run-b", rank=1, scale=123456789.0), dropped=2)
    clock.advance(61)  # every rank is down now
    _post(client, record(21, run="run-b", rank=1, scale=1e-7))  # ...but this one
    assert _scrape(client) == _reference(client)


def test_a_pause_is_rendered_per_scrape_as_the_collector_does(make_client: MakeClient) -> None:
    # A heartbeat alone starts or ends a pause: no new record, so no cached line may hold it.
    client, clock = make_client()
    for rank in range(2):
        _post(client, record(5, rank=rank, time=T0))
    before = _scrape(client)
    clock.advance(30)
    beat = Heartbeat(
        schema_version=1,
        identity=Identity(run="run-a", node="node0", rank=1, local_rank=1, world_size=2),
        time=T0 + 30,
        step=5,
        final=False,
        dropped_records=0,
        pause=RankPause(reason="checkpoint", seconds=20.0),
    )
    response = client.post("/api/v1/heartbeat", content=beat.model_dump_json().encode())
    assert response.status_code == 200, response.text
    text = _scrape(client)
    assert text == _reference(client)
    (family,) = [
        f
        for f in text_string_to_metric_families(text.decode())
        if f.name == "ampscope_rank_pause_start_timestamp_seconds"
    ]
    assert [(s.labels["rank"], s.labels["reason"], s.value) for s in family.samples] == [
        ("1", "checkpoint", T0 + 10.0)
    ]
    assert b"ampscope_rank_pause_start_timestamp_seconds{" not in before
    ended = beat.model_copy(update={"pause": None, "time": T0 + 40})
    response = client.post("/api/v1/heartbeat", content=ended.model_dump_json().encode())
    assert response.status_code == 200, response.text
    assert b"ampscope_rank_pause_start_timestamp_seconds{" not in _scrape(client)
    assert _scrape(client) == _reference(client)


def test_spike_counts_found_later_refresh_the_cached_lines(make_client: MakeClient) -> None:
    client, _ = make_client()
    for rank in range(3):
        _post(client, *(record(s, rank=rank, world_size=3, stats=stats(2.0, 1.0, 1.0))
                        for s in range(1, 6)))  # fmt: skip
    _post(client, record(6, rank=2, world_size=3, stats=stats(2.0, 1.0, 50.0)))
    _post(client, record(6, rank=0, world_size=3, stats=stats(2.0, 1.0, 1.0)))
    before = _scrape(client)
    assert before == _reference(client)
    marker = b'ampscope_spikes_total{kind="origin_outlier",local_rank="2",node="node0",rank="2"'
    assert marker + b',run="run-a"} 0.0' in before
    # Rank 1's record of step 6 makes rank 2 the outlier: its lines change though its own
    # newest record, report time and drop count did not.
    _post(client, record(6, rank=1, world_size=3, stats=stats(2.0, 1.0, 1.1)))
    after = _scrape(client)
    assert after == _reference(client)
    assert marker + b',run="run-a"} 1.0' in after
    assert b'ampscope_grad_norm_origin{local_rank="2",node="node0",rank="2",run="run-a"} 50.0' in (
        after
    )


def test_only_changed_ranks_are_rendered_again(make_client: MakeClient) -> None:
    client, clock = make_client(stale_after_s=60)
    for rank in range(3):
        _post(client, record(5, rank=rank, total=_rich(5)))
    exposition = client.app.state.exposition  # type: ignore[attr-defined]
    first = _scrape(client)
    assert exposition.rendered_ranks == 3
    assert _scrape(client) == first
    assert exposition.rendered_ranks == 3  # nothing changed: nothing rendered
    _post(client, record(6, rank=1, total=_rich(6)))
    assert b'ampscope_last_step{local_rank="1",node="node0",rank="1",run="run-a"} 6.0' in (
        _scrape(client)
    )
    assert exposition.rendered_ranks == 4
    # The clock alone moves ampscope_rank_up without re-rendering any rank.
    clock.advance(61)
    down = _scrape(client)
    assert exposition.rendered_ranks == 4
    assert down.count(b"ampscope_rank_up{") == 3
    assert b'ampscope_rank_up{local_rank="1",node="node0",rank="1",run="run-a"} 0.0' in down
    assert down == _reference(client)
    # A duplicate changes nothing; a new step brings the rank back up.
    _post(client, record(6, rank=1, total=_rich(6)))
    assert _scrape(client) == _reference(client)
    assert exposition.rendered_ranks == 4
    _post(client, record(7, rank=1, total=_rich(7)))
    up_again = _scrape(client)
    assert exposition.rendered_ranks == 5
    assert up_again == _reference(client)
    assert b'ampscope_rank_up{local_rank="1",node="node0",rank="1",run="run-a"} 1.0' in up_again


def test_pruned_ranks_leave_the_cache(make_client: MakeClient) -> None:
    client, clock = make_client(retention_s=100, stale_after_s=60)
    _post(client, record(5, rank=0))
    _post(client, record(5, rank=1))
    _scrape(client)
    clock.advance(50)
    _post(client, record(6, rank=1))
    clock.advance(60)
    client.app.state.store.prune(clock(), 100)  # type: ignore[attr-defined]
    text = _scrape(client)
    assert b'rank="0"' not in text
    assert text == _reference(client)


def test_gzip_when_the_client_accepts_it(make_client: MakeClient) -> None:
    client, _ = make_client()
    for rank in range(8):
        _post(client, record(5, rank=rank, total=_rich(5)))
    plain = _scrape(client)
    # httpx would decode transparently; read the raw bytes to see what went over the wire.
    with client.stream("GET", "/metrics", headers={"Accept-Encoding": "gzip"}) as response:
        raw = b"".join(response.iter_raw())
        assert response.headers["content-encoding"] == "gzip"
        assert response.headers["vary"] == "Accept-Encoding"
        assert response.headers["content-type"] == CONTENT_TYPE_LATEST
    assert gzip.decompress(raw) == plain
    assert len(raw) < len(plain) / 4


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, False),
        ("", False),
        ("identity", False),
        ("gzip", True),
        ("deflate, gzip;q=1.0, *;q=0.5", True),
        ("GZIP", True),
        ("gzip;q=0", False),
        ("br, *", True),
        ("gzip;q=bogus", False),
        ("x-gzip2", False),
    ],
)
def test_accept_encoding(header: str | None, expected: bool) -> None:
    assert accepts_gzip(header) is expected
