"""A healthy GAN with a GradScaler for D and one for G in each process reads as two healthy
runs on a real exporter: never one series mixing both scalers.

Two real ranks (gloo, CPU; DDP) train a small GAN in fp16 autocast (two D iterations per G
one), each process with two
``ampscope.GradScaler`` s open at once (D's at scale 1024, G's at 4096, origin tracking on),
both given the same run id, reporting through real ``HttpReporter`` s to a real exporter
process. Mixed into one series (as before ampscope gave the second one its own run id), each
rank read G's records (step k, after D's step 2k) as restarts and its scale flipped between
the two scalers'. Now the exporter must show run
``gan`` (D's) and ``gan.2`` (G's), each with both ranks at the last step, no restart, its own
scaler's scale in the API and on /metrics, and no verdict other than ok.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from support import DEADLOCK_GUARD_S, free_port, run_distributed, wait_until

from ampscope.demo.exporter import ExporterProcess

pytestmark = pytest.mark.distributed

RANKS = 2
STEPS = 40
RUN = "gan"
SCALES = {RUN: 1024.0, f"{RUN}.2": 4096.0}
"""Each run's scaler's scale: no overflow in this GAN, so it stays the initial one."""
CRITIC_STEPS = 2
"""D's iterations per G's (WGAN's ``n_critic``): D's scaler counts twice G's steps."""
STEPS_OF = {RUN: CRITIC_STEPS * STEPS, f"{RUN}.2": STEPS}


def _rank(rank: int, world_size: int, url: str) -> list[str]:
    """One rank of the GAN; returns the run ids its two scalers reported under."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import ampscope
    from ampscope.reporter.http import HttpReporter

    torch.set_num_threads(1)
    torch.manual_seed(0)
    generator = DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    )
    critic = DistributedDataParallel(nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 1)))
    g_opt = torch.optim.Adam(generator.parameters(), 1e-3, betas=(0.5, 0.999))
    d_opt = torch.optim.Adam(critic.parameters(), 1e-3, betas=(0.5, 0.999))
    d_scaler, g_scaler = (
        ampscope.GradScaler(
            "cpu",
            init_scale=SCALES[run],
            reporter=HttpReporter(url, flush_interval=0.05),
            run_id=RUN,
        )
        for run in SCALES
    )
    d_scaler.attach(critic, track_origin=True)
    g_scaler.attach(generator, track_origin=True)
    data = torch.Generator().manual_seed(rank)
    bce = nn.BCEWithLogitsLoss()
    for _ in range(STEPS):
        for _ in range(CRITIC_STEPS):
            real = torch.randn(32, 2, generator=data) * 0.5 + 2
            noise = torch.randn(32, 8, generator=data)
            with torch.autocast("cpu", dtype=torch.float16):
                fake = generator(noise)
                d_loss = bce(critic(real).float(), torch.ones(32, 1)) + bce(
                    critic(fake.detach()).float(), torch.zeros(32, 1)
                )
            d_scaler.scale(d_loss).backward()
            d_scaler.step(d_opt)
            d_scaler.update()
            d_opt.zero_grad()
        g_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            g_loss = bce(critic(generator(noise)).float(), torch.ones(32, 1))
        g_scaler.scale(g_loss).backward()
        g_scaler.step(g_opt)
        g_scaler.update()
        g_opt.zero_grad()
        d_opt.zero_grad()
    runs = [s.telemetry.snapshot().last.identity.run for s in (d_scaler, g_scaler)]  # type: ignore[union-attr]
    dist.barrier()
    d_scaler.close()
    g_scaler.close()
    return runs


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=DEADLOCK_GUARD_S) as response:
        body = response.read()
    return body.decode() if url.endswith("/metrics") else json.loads(body)


def _finished(url: str, run: str) -> bool:
    if not any(r["run"] == run for r in _get(f"{url}/api/v1/runs")):
        return False
    ranks = _get(f"{url}/api/v1/runs/{run}/ranks")
    return len(ranks) == RANKS and all(r["state"] == "finished" for r in ranks)


def _scales_on_metrics(url: str) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    scales = {}
    for family in text_string_to_metric_families(_get(f"{url}/metrics")):
        for sample in family.samples:
            if sample.name == "ampscope_loss_scale" and sample.labels["run"] in SCALES:
                scales[(sample.labels["run"], sample.labels["rank"])] = sample.value
    return scales


@pytest.fixture(scope="module")
def exporter() -> Iterator[str]:
    process = ExporterProcess(free_port())
    process.start()
    try:
        yield process.url
    finally:
        process.stop()


def test_two_scalers_in_one_process_read_as_two_healthy_runs(exporter: str) -> None:
    results = run_distributed(_rank, RANKS, args=(exporter,), env={"AMPSCOPE_NODE": "node0"})
    for run, scale in SCALES.items():
        wait_until(lambda run=run: _finished(exporter, run), f"run {run} finished")
        ranks = _get(f"{exporter}/api/v1/runs/{run}/ranks")
        assert sorted(r["rank"] for r in ranks) == list(range(RANKS))
        for rank in ranks:
            assert rank["step"] == STEPS_OF[run]
            assert rank["totals"]["steps"] == STEPS_OF[run]
            assert rank["restarts"] == 0
            assert rank["scale"] == scale
        verdicts = _get(f"{exporter}/api/v1/runs/{run}/health")["verdicts"]
        assert {v["rule"] for v in verdicts} >= {"scale_desync", "origin_outlier"}
        assert [v for v in verdicts if v["status"] != "ok"] == []
    # Two scrapes: each run's series is its own scaler's, the same every time.
    expected = {(run, str(rank)): scale for run, scale in SCALES.items() for rank in range(RANKS)}
    assert _scales_on_metrics(exporter) == expected
    assert _scales_on_metrics(exporter) == expected
    assert results == [list(SCALES)] * RANKS  # every rank derived the same ids, in order
