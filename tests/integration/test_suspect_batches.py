"""Bad data on one rank: the exporter names the ids of the batch behind each flagged step.

Four real ranks (gloo, CPU, DDP) train a small linear regression, each iteration 16
samples whose ids each rank notes in two calls (``note_batch``), each rank's
``GradWatch`` (``skip``, origin tracking on) reporting to a real exporter process. Rank 2's
data holds one NaN sample at step 12 and one batch of inputs scaled x30 at step 35. The
exporter must list exactly those (step, rank 2) pairs with rank 2's ids for the step (plus
the gradient-norm spike, which every rank sees at step 35), put the ids into the verdicts'
evidence, and ``ampscope status RUN --suspect-batches`` must print the same as JSON lines.
"""

from __future__ import annotations

import json
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from support import DEADLOCK_GUARD_S, run_distributed, wait_until

# ``ampscope status`` run as a user runs it, shared with the status tests.
sys.path.insert(0, str(Path(__file__).parents[1] / "status"))
from status_cli import run_status

pytestmark = pytest.mark.distributed

RANKS = 4
STEPS = 36
BAD_RANK = 2
NAN_STEP, NAN_SAMPLE = 12, 3
SPIKE_STEP = 35
RUN = "bad-data"


def sample_ids(rank: int, step: int) -> list[int]:
    """The ids of the 16 samples (two micro-batches) rank ``rank`` trains on at ``step``."""
    return [rank * 100_000 + step * 100 + i for i in range(16)]


def _rank(rank: int, world_size: int, url: str) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import ampscope
    from ampscope.reporter.http import HttpReporter

    torch.set_num_threads(1)
    torch.manual_seed(0)
    teacher = torch.nn.Linear(16, 1).requires_grad_(False)
    torch.manual_seed(1)
    model = DistributedDataParallel(torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    watch = ampscope.GradWatch("skip", reporter=HttpReporter(url, flush_interval=0.05), run_id=RUN)
    watch.attach(model, track_origin=True)
    data = torch.Generator().manual_seed(100 + rank)
    for step in range(1, STEPS + 1):
        ids = sample_ids(rank, step)
        x = torch.randn(16, 16, generator=data)
        y = teacher(x) + 0.1 * torch.randn(16, 1, generator=data)
        if rank == BAD_RANK and step == NAN_STEP:
            x[NAN_SAMPLE] = float("nan")
        if rank == BAD_RANK and step == SPIKE_STEP:
            x = x * 30.0
        # Two notes for one iteration add up (as two micro-batches' would).
        watch.note_batch(ids[:8])
        watch.note_batch(ids[8:])
        loss = torch.nn.functional.mse_loss(model(x), y)
        watch.scale(loss).backward()
        watch.step(optimizer)
        watch.update()
        optimizer.zero_grad()
    watch.close()


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=DEADLOCK_GUARD_S) as response:
        return json.loads(response.read())


def _finished(url: str) -> bool:
    if not any(r["run"] == RUN for r in _get(f"{url}/api/v1/runs")):
        return False
    ranks = _get(f"{url}/api/v1/runs/{RUN}/ranks")
    return len(ranks) == RANKS and all(r["step"] == STEPS for r in ranks)


def test_the_exporter_names_the_bad_batches_and_status_prints_them(exporter: str) -> None:
    results: list[Any] = []
    ranks = threading.Thread(
        target=lambda: results.extend(
            run_distributed(
                _rank, RANKS, args=(exporter,), env={"AMPSCOPE_NODE": "node0"}, timeout=300
            )
        ),
        daemon=True,
    )
    ranks.start()
    ranks.join(300)
    assert len(results) == RANKS, "the ranks failed (run_distributed reported why)"
    wait_until(lambda: _finished(exporter), f"all ranks at step {STEPS}")

    suspects = _get(f"{exporter}/api/v1/runs/{RUN}/suspect-batches")
    by_pair = {(s["step"], s["rank"]): s for s in suspects}
    nan = by_pair[(NAN_STEP, BAD_RANK)]
    assert nan["reasons"] == ["nonfinite_origin"]
    assert nan["batch_ids"] == sample_ids(BAD_RANK, NAN_STEP), "both notes, in order"
    assert sample_ids(BAD_RANK, NAN_STEP)[NAN_SAMPLE] in nan["batch_ids"]
    spike = by_pair[(SPIKE_STEP, BAD_RANK)]
    assert set(spike["reasons"]) == {"loss_spike", "grad_norm_spike", "origin_outlier"}
    assert spike["batch_ids"] == sample_ids(BAD_RANK, SPIKE_STEP)
    # The whole model's gradient norm spiked on every rank; nothing else was flagged.
    others = {pair: s["reasons"] for pair, s in by_pair.items() if pair[1] != BAD_RANK}
    assert others == {(SPIKE_STEP, r): ["grad_norm_spike"] for r in (0, 1, 3)}
    assert len(suspects) == 5

    verdicts = {v["rule"]: v for v in _get(f"{exporter}/api/v1/runs/{RUN}/health")["verdicts"]}
    for rule in ("loss_spike", "origin_outlier"):
        (entry,) = verdicts[rule]["evidence"]["ranks"]
        assert (entry["rank"], entry["step"]) == (BAD_RANK, SPIKE_STEP)
        assert entry["batch_ids"] == sample_ids(BAD_RANK, SPIKE_STEP)
    (step_entry,) = verdicts["grad_norm_spike"]["evidence"]["steps"]
    assert step_entry["batches"] == [
        {"rank": r, "batch_ids": sample_ids(r, SPIKE_STEP)} for r in range(RANKS)
    ]

    cli = run_status(RUN, "--suspect-batches", url=exporter)
    assert cli.returncode == 0, cli.stderr
    assert [json.loads(line) for line in cli.stdout.splitlines()] == suspects
    missing = run_status("no-such-run", "--suspect-batches", url=exporter)
    assert missing.returncode == 4
    assert "holds no run 'no-such-run'" in missing.stderr
    prom = run_status(RUN, "--suspect-batches", "--prometheus", "http://127.0.0.1:1", url=exporter)
    assert prom.returncode == 3
    assert "the batch ids live in each node's exporter" in prom.stderr
