"""``ampscope status --prometheus`` against VictoriaMetrics, for ranks restarted with the same
run id (a torchrun restart, a Slurm requeue, a resume from a checkpoint): same labels, so
the collapse window holds the dead process's scale and the new one's.

Both ranks grew to 2**24, and both processes restarted 7.5 minutes ago. Rank 0 resumed from
an older checkpoint at 2**14 and trains cleanly there: no collapse, as the exporter, which
starts its window again at a new process, says. Rank 1's new process trained cleanly at
2**16, then overflowed down to 128: a collapse by 512 within its own process, which
``scale_collapse`` names. Samples are imported with timestamps through VictoriaMetrics'
Prometheus import endpoint, one exporter (``instance``) a rank.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from support import need_tool

from ampscope.status import prometheus
from ampscope.status.prometheus.api import PrometheusClient
from bench.servers import victoria_metrics
from bench.victoria import VictoriaClient

RUN = "vm-restart"
SCRAPE_S = 15
SCRAPES = 60
RESTART = 30
"""The scrape at which both ranks' processes are new (counters from zero)."""


def _scale(rank: int, scrape: int) -> tuple[float, float]:
    """(scale, clean scale) of ``rank`` at ``scrape``."""
    if scrape < RESTART:
        return 2.0**24, 2.0**24
    if rank == 0:
        return 2.0**14, 2.0**14
    # Rank 1 overflows from scrape 45 on: the clean scale stays where it trained cleanly.
    return (2.0**16 if scrape < 45 else 128.0), 2.0**16


def _exposition(rank: int, scrape: int, at: float) -> str:
    labels = f'run="{RUN}",node="n{rank}",rank="{rank}",local_rank="0"'
    ms = int(at * 1000)
    steps = 4000 + 4 * scrape if scrape < RESTART else 4 * (scrape - RESTART) + 1
    scale, clean = _scale(rank, scrape)
    faults = 0 if rank == 0 or scrape < 45 else scrape - 44
    lines = [
        f'ampscope_rank_info{{{labels},mode="scaler",policy="skip",world_size="2"}} 1 {ms}',
        f"ampscope_last_step{{{labels}}} {steps} {ms}",
        f"ampscope_steps_total{{{labels}}} {steps} {ms}",
        f"ampscope_skipped_steps_total{{{labels}}} {faults} {ms}",
        f"ampscope_loss_scale{{{labels}}} {scale} {ms}",
        f"ampscope_loss_scale_clean{{{labels}}} {clean} {ms}",
        f'ampscope_faults_total{{{labels},kind="nonfinite_loss"}} {faults} {ms}',
        f"ampscope_last_report_timestamp_seconds{{{labels}}} {at} {ms}",
        f"ampscope_rank_up{{{labels}}} 1 {ms}",
        f'ampscope_rank_state{{{labels},state="running"}} 1 {ms}',
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
            start = newest - SCRAPES * SCRAPE_S
            for rank in (0, 1):
                body = "".join(
                    _exposition(rank, scrape, start + scrape * SCRAPE_S)
                    for scrape in range(SCRAPES + 1)
                )
                client.import_prometheus(body.encode(), {"job": "ampscope", "instance": f"n{rank}"})
            client.flush()
            yield client.url, newest
        finally:
            client.close()


def test_a_restart_is_no_collapse_a_collapse_after_it_is_victoria(
    victoria: tuple[str, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, newest = victoria
    from ampscope.status.prometheus import health

    monkeypatch.setattr(health, "time", SimpleNamespace(time=lambda: newest))
    answer = prometheus.fetch(PrometheusClient(url), RUN)
    (collapse,) = [v for v in answer["health"]["verdicts"] if v["rule"] == "scale_collapse"]
    assert collapse["status"] == "critical", collapse
    (hit,) = collapse["evidence"]["ranks"]
    assert (hit["rank"], hit["scale"], hit["window_peak_scale"]) == (1, 128.0, 2.0**16)
    assert hit["reasons"] == ["fell"]
