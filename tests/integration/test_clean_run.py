"""A clean run with real training fires no spike verdict; one bad batch then does.

Four ranks train their own replica of a small MLP in bf16 on CPU (AdamW, a realizable
teacher-student regression with label noise), in lockstep in one process (each with its own rank
identity, data shard and ``GradWatch``), for 300 iterations with a noisy but stable loss,
reporting through the real ``HttpReporter`` to a real exporter process. The exporter must find
no spike: ``loss_spike``, ``grad_norm_spike`` and ``origin_outlier`` stay ok and
``ampscope_spikes_total`` stays 0. Then rank 2 alone gets one batch with its inputs multiplied
by 30: the same exporter names it (a loss spike on rank 2, rank 2's own gradients the outlier),
so the quiet part is a judgement, not an unarmed detector.

Until the scalers fill ``StepRecord.stats`` (the rank side of #24), the stats come from this
training loop: the loss it computes and ``clip_grad_norm_``'s return value, set on each record
by a thin sink in front of the reporter. Without cross-rank reduction, a rank's own gradient
norm (``grad_norm_origin``) is its whole gradient norm.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from support import DEADLOCK_GUARD_S, free_port

from ampscope.demo.exporter import ExporterProcess
from ampscope.reporter.schema import StepRecord, StepStats

RUN = "clean-run"
RANKS = 4
STEPS = 300
BAD_RANK = 2
BAD_FACTOR = 30.0


class LoopStats:
    """A sink that sets each record's stats from what the training loop measured, then
    hands it to the reporter. Records are emitted after their update(), by which time the
    loop noted the step."""

    def __init__(self, reporter: Any) -> None:
        self._reporter = reporter
        self._lock = threading.Lock()
        self._by_step: dict[int, StepStats] = {}

    def note(self, step: int, loss: float, grad_norm: float) -> None:
        with self._lock:
            self._by_step[step] = StepStats(
                loss=loss, grad_norm=grad_norm, grad_norm_origin=grad_norm
            )

    def emit(self, record: StepRecord) -> None:
        with self._lock:
            stats = self._by_step.pop(record.step)
        self._reporter.emit(record.model_copy(update={"stats": stats}))

    def flush(self, timeout: float) -> bool:
        return bool(self._reporter.flush(timeout))

    def close(self, timeout: float) -> None:
        self._reporter.close(timeout)


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=DEADLOCK_GUARD_S) as response:
        body = response.read()
    return body.decode() if url.endswith("/metrics") else json.loads(body)


def _until_step(url: str, step: int) -> None:
    deadline = time.monotonic() + DEADLOCK_GUARD_S
    while True:
        ranks = _get(f"{url}/api/v1/runs/{RUN}/ranks") if _has_run(url) else []
        if len(ranks) == RANKS and all(r["step"] == step for r in ranks):
            return
        assert time.monotonic() < deadline, ranks
        time.sleep(0.1)


def _has_run(url: str) -> bool:
    return any(r["run"] == RUN for r in _get(f"{url}/api/v1/runs"))


def _verdicts(url: str) -> dict[str, dict[str, Any]]:
    return {v["rule"]: v for v in _get(f"{url}/api/v1/runs/{RUN}/health")["verdicts"]}


def _spike_counts(url: str) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    counts = {}
    for family in text_string_to_metric_families(_get(f"{url}/metrics")):
        for sample in family.samples:
            if sample.name == "ampscope_spikes_total":
                counts[(sample.labels["rank"], sample.labels["kind"])] = sample.value
    return counts


@pytest.fixture(scope="module")
def exporter() -> Iterator[str]:
    process = ExporterProcess(free_port())
    process.start()
    try:
        yield process.url
    finally:
        process.stop()


def test_a_clean_run_fires_no_spike_and_one_bad_batch_does(
    exporter: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    import ampscope
    from ampscope.reporter.http import HttpReporter

    def mlp() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    # The target is a network of the same shape: every batch is within the model's reach.
    # (A linear target under a tanh network makes rare batches the model cannot fit, whose
    # loss jumps 5x: real spikes, which the exporter rightly names.)
    torch.manual_seed(0)
    teacher = mlp().requires_grad_(False)
    ranks = []
    for rank in range(RANKS):
        model = mlp()
        sink = LoopStats(HttpReporter(exporter, flush_interval=0.05))
        ranks.append(
            {
                "model": model,
                "optimizer": torch.optim.AdamW(model.parameters(), lr=3e-3),
                "watch": ampscope.GradWatch("skip", reporter=sink, run_id=RUN),  # type: ignore[arg-type]
                "sink": sink,
                "data": torch.Generator().manual_seed(100 + rank),
            }
        )

    def train(rank: int, step: int, factor: float = 1.0) -> float:
        env = {"AMPSCOPE_NODE": "node0", "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(RANKS), "LOCAL_WORLD_SIZE": str(RANKS)}  # fmt: skip
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        r = ranks[rank]
        x = torch.randn(64, 16, generator=r["data"])
        y = teacher(x) + 0.1 * torch.randn(64, 1, generator=r["data"])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(r["model"](x * factor).float(), y)
        r["watch"].scale(loss).backward()
        r["watch"].unscale_(r["optimizer"])
        norm = torch.nn.utils.clip_grad_norm_(r["model"].parameters(), max_norm=1.0)
        r["sink"].note(step, loss.item(), norm.item())
        r["watch"].step(r["optimizer"])
        r["watch"].update()
        r["optimizer"].zero_grad()
        return loss.item()

    losses = [[train(rank, step) for rank in range(RANKS)] for step in range(1, STEPS + 1)]
    _until_step(exporter, STEPS)

    # The loss is noisy (batch to batch) but stable: no trend over the last 200 iterations.
    for rank in range(RANKS):
        tail = [row[rank] for row in losses[100:]]
        assert statistics.pstdev(tail) / statistics.fmean(tail) > 0.1  # noisy
        assert abs(sum(tail[:100]) - sum(tail[100:])) / sum(tail) < 0.1  # stable
    verdicts = _verdicts(exporter)
    for rule in ("loss_spike", "grad_norm_spike", "origin_outlier"):
        assert verdicts[rule]["status"] == "ok", verdicts[rule]
    counts = _spike_counts(exporter)
    assert len(counts) == RANKS * 3
    assert set(counts.values()) == {0.0}
    # The exporter held every step's stats: the windows were fed.
    series = _get(f"{exporter}/api/v1/runs/{RUN}/series?max_steps={STEPS}")
    for rank in range(RANKS):
        assert series["loss"][rank] == pytest.approx([row[rank] for row in losses])

    # One bad batch on rank 2: its loss and its own gradients jump, the others' do not.
    step = STEPS + 1
    for rank in range(RANKS):
        train(rank, step, BAD_FACTOR if rank == BAD_RANK else 1.0)
    _until_step(exporter, step)
    verdicts = _verdicts(exporter)
    loss = verdicts["loss_spike"]
    assert loss["status"] == "warning"
    assert [(r["rank"], r["step"]) for r in loss["evidence"]["ranks"]] == [(BAD_RANK, step)]
    outlier = verdicts["origin_outlier"]
    assert outlier["status"] == "warning"
    assert outlier["summary"].startswith(f"rank {BAD_RANK}'s own gradients were x")
    assert f"the median of the other ranks at step {step}" in outlier["summary"]
    counts = _spike_counts(exporter)
    assert counts[(str(BAD_RANK), "loss")] == 1
    assert counts[(str(BAD_RANK), "origin_outlier")] == 1
    assert sum(counts.values()) == 2 + counts[(str(BAD_RANK), "grad_norm")]
    for r in ranks:
        r["watch"].close()
