"""``ampscope status --prometheus`` against VictoriaMetrics, for a rank whose series are gone:
the hour's read of its families (``seen_query``) brings back each of them, not only its
info series, so the gone rank keeps the step, counters, last report and final state
VictoriaMetrics last held.

VictoriaMetrics' ``or`` matches series without their names (``on (__name__)`` too): families
named apart by ``__name__`` alone would collapse into the first. Samples are imported with
timestamps through its Prometheus import endpoint: rank 0 reports until now, rank 1's last
scrape is ten minutes old, its last state ``finished``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from support import need_tool

from ampscope.status import prometheus
from ampscope.status.prometheus.api import PrometheusClient
from bench.servers import victoria_metrics
from bench.victoria import VictoriaClient

RUN = "vm-gone"
SCRAPE_S = 15
STATES = ("running", "finished")


def _exposition(rank: int, step: int, at: float) -> str:
    labels = f'run="{RUN}",node="n{rank}",rank="{rank}",local_rank="0"'
    ms = int(at * 1000)
    finished = rank == 1 and step >= 40
    lines = [
        f'ampscope_rank_info{{{labels},mode="scaler",policy="skip",world_size="2"}} 1 {ms}',
        f"ampscope_last_step{{{labels}}} {step} {ms}",
        f"ampscope_steps_total{{{labels}}} {step + 1} {ms}",
        f"ampscope_skipped_steps_total{{{labels}}} 3 {ms}",
        f"ampscope_last_report_timestamp_seconds{{{labels}}} {at} {ms}",
        f"ampscope_rank_up{{{labels}}} 1 {ms}",
        *(
            f'ampscope_rank_state{{{labels},state="{state}"}} '
            f"{int((state == 'finished') == finished)} {ms}"
            for state in STATES
        ),
    ]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def victoria(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, float]]:
    """(VictoriaMetrics URL, the newest scrape's time)."""
    path = need_tool("victoria-metrics")
    with victoria_metrics(path, tmp_path_factory.mktemp("victoria")) as server:
        client = VictoriaClient(server.host, server.port)
        try:
            newest = float(int(time.time()) // SCRAPE_S * SCRAPE_S)
            start = newest - 80 * SCRAPE_S
            for rank, last in ((0, 80), (1, 40)):  # rank 1's last scrape: 10 minutes ago
                body = "".join(
                    _exposition(rank, step, start + step * SCRAPE_S) for step in range(last + 1)
                )
                client.import_prometheus(body.encode(), {"job": "ampscope", "instance": f"n{rank}"})
            client.flush()
            yield client.url, newest
        finally:
            client.close()


def test_a_gone_rank_keeps_every_family_victoria_last_held(
    victoria: tuple[str, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, newest = victoria
    from types import SimpleNamespace

    from ampscope.status.prometheus import health

    monkeypatch.setattr(health, "time", SimpleNamespace(time=lambda: newest))
    answer = prometheus.fetch(PrometheusClient(url), RUN)
    ranks = {view["rank"]: view for view in answer["ranks"]}
    assert ranks[0]["state"] == "running"
    gone = ranks[1]
    assert (gone["state"], gone["up"], gone["step"]) == ("finished", False, 40)
    assert gone["totals"]["steps"] == 41
    assert gone["totals"]["skipped_steps"] == 3
    assert gone["last_report_time"] == newest - 40 * SCRAPE_S
