"""Faults, not weather: two real ranks (gloo, CPU) report to a real exporter process.

One launch runs the scenarios in sequence, each its own run on the same two devices:

- healthy, twice (``warmup-a``, ``warmup-b``): DDP under fp16 autocast with dropout, origin
  tracking and a rerun closure that does not restore the RNG, from ``init_scale`` 2**40
  with a short growth interval: real fp16 overflows of the warm-up, the scaler probing
  upward and at its edge. No fault, no rerun, no suspect batch, no device offence, no
  verdict (``scale_collapse`` included: 2**40 settling far lower is no collapse; nor
  ``skip_storm`` or ``inf_hotspot``: every skip and detection was weather);
- ``corrupt``: an fp32 model that never overflows by itself, with a rerun closure; rank 1's
  own gradients turn inf once, at a scale that trained cleanly (``overflow_at_clean_scale``):
  rerun, not reproduced, a ``transient`` fault of rank 1, its device's offence alone;
- ``corrupt-unrerun``: the same without a closure: ``overflow_at_clean_scale`` is counted,
  but the scale alone blames neither a device nor a batch (healthy gradients outgrow a
  scale too): no offence, no suspect batch;
- ``nan-loss``: one NaN sample on rank 0, rerun: reproduced, a fault of the data's
  (``reproducible``), no device's offence;
- ``watch``: a bf16 ``GradWatch`` under ``skip``; rank 1's gradients turn inf once: a
  fault without a loss scaler (``nonfinite_gradients``);
- ``observe``: the same under ``observe``: the inf update is applied, every later iteration
  is non-finite on both ranks; only the origin step is a fault, the rest consequences:
  rank 0, which did nothing wrong, has no offence.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from support import DEADLOCK_GUARD_S, free_port, get_json, run_distributed, wait_until

from ampscope.demo.exporter import ExporterProcess

pytestmark = pytest.mark.distributed

RANKS = 2
HEALTHY_STEPS = 60
FAULT_STEPS = 12
FAULT_RANK, FAULT_STEP = 1, 8
NAN_RANK, NAN_STEP = 0, 6
HEALTHY = ("warmup-a", "warmup-b")


def _ids(rank: int, step: int) -> list[int]:
    return [rank * 10_000 + step * 10 + i for i in range(4)]


def _model(dropout: float) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(dropout), nn.Linear(64, 4))
    return nn.parallel.DistributedDataParallel(model)


def _train(
    rank: int,
    url: str,
    run: str,
    *,
    steps: int,
    front_end: str = "scaler",
    fp16: bool = False,
    init_scale: float = 1024.0,
    growth_interval: int = 2000,
    poison_at: int | None = None,
    nan_at: int | None = None,
    rerun: bool = True,
) -> dict[str, Any]:
    """Train one run; what the rank saw: the closure's calls and each record's call."""
    import torch

    import ampscope
    from ampscope.reporter.http import HttpReporter

    model = _model(0.1 if fp16 else 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    reporter = HttpReporter(url, flush_interval=0.05)
    scaler: Any
    if front_end == "scaler":
        scaler = ampscope.GradScaler(
            "cpu",
            init_scale=init_scale,
            growth_interval=growth_interval,
            reporter=reporter,
            run_id=run,
        )
    else:
        scaler = ampscope.GradWatch(front_end, reporter=reporter, run_id=run)
    scaler.attach(model, track_origin=True)
    poison = [False]

    def hook(module: Any, grad_output: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not poison[0]:
            return None
        poison[0] = False
        return (grad_output[0] * float("inf"),)

    model.module[3].register_full_backward_pre_hook(hook)
    data = torch.Generator().manual_seed(rank)
    dtype = torch.float16 if fp16 else torch.bfloat16
    autocast = fp16 or front_end != "scaler"
    calls = 0
    for step in range(1, steps + 1):
        x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
        if step == nan_at:
            x[2] = float("nan")
        scaler.note_batch(_ids(rank, step))

        def loss_of(x: Any = x, y: Any = y) -> Any:
            with torch.autocast("cpu", dtype=dtype, enabled=autocast):
                return torch.nn.functional.mse_loss(model(x).float(), y)

        def closure(loss_of: Any = loss_of) -> Any:
            nonlocal calls
            calls += 1
            opt.zero_grad()
            loss = loss_of()
            scaler.scale(loss).backward()
            return loss

        opt.zero_grad()
        poison[0] = step == poison_at
        scaler.scale(loss_of()).backward()
        scaler.step(opt, rerun=closure if rerun else None)
        scaler.update()
    records = scaler.telemetry.history()
    scaler.close()
    return {
        "calls": calls,
        "calls_by_step": {
            r.step: (r.nonfinite.kind, r.nonfinite.reason, r.nonfinite.own)
            for r in records
            if r.nonfinite is not None
        },
        "skipped": sum(r.skipped for r in records),
        "backoffs": records[-1].totals.backoffs,
        "faults": records[-1].totals.faults,
        "scale": records[-1].scale_after,
    }


def _rank(rank: int, world_size: int, url: str) -> dict[str, Any]:
    import torch

    del world_size
    torch.set_num_threads(1)
    out = {}
    for run in HEALTHY:
        out[run] = _train(
            rank,
            url,
            run,
            steps=HEALTHY_STEPS,
            fp16=True,
            init_scale=2.0**40,
            growth_interval=8,
        )
    fault = FAULT_STEP if rank == FAULT_RANK else None
    out["corrupt"] = _train(rank, url, "corrupt", steps=FAULT_STEPS, poison_at=fault)
    out["corrupt-unrerun"] = _train(
        rank, url, "corrupt-unrerun", steps=FAULT_STEPS, poison_at=fault, rerun=False
    )
    nan = NAN_STEP if rank == NAN_RANK else None
    out["nan-loss"] = _train(rank, url, "nan-loss", steps=FAULT_STEPS, nan_at=nan)
    for policy in ("skip", "observe"):
        out[policy] = _train(
            rank,
            url,
            f"watch-{policy}",
            steps=FAULT_STEPS,
            front_end=policy,
            poison_at=fault,
            rerun=False,
        )
    return out


@pytest.fixture(scope="module")
def trained() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    process = ExporterProcess(free_port())
    process.start()
    try:
        results = run_distributed(
            _rank, RANKS, args=(process.url,), env={"AMPSCOPE_NODE": "node0"}, timeout=600
        )
        for run, steps in [
            *((run, HEALTHY_STEPS) for run in HEALTHY),
            ("corrupt", FAULT_STEPS),
            ("nan-loss", FAULT_STEPS),
            ("watch-skip", FAULT_STEPS),
            ("watch-observe", FAULT_STEPS),
        ]:
            wait_until(lambda r=run, s=steps: _at(process.url, r, s), f"{run} at step {steps}")
        yield process.url, results
    finally:
        process.stop()


def _at(url: str, run: str, steps: int) -> bool:
    if not any(r["run"] == run for r in get_json(f"{url}/api/v1/runs")):
        return False
    ranks = get_json(f"{url}/api/v1/runs/{run}/ranks")
    return len(ranks) == RANKS and all(r["step"] == steps for r in ranks)


def _samples(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=DEADLOCK_GUARD_S) as response:
        text = response.read().decode()
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def _of_run(
    samples: dict[tuple[tuple[str, str], ...], float], run: str
) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: value for labels, value in samples.items() if ("run", run) in labels}


def _offences(url: str, run: str) -> dict[tuple[str, str], float]:
    return {
        (dict(labels)["device"], dict(labels)["kind"]): value
        for labels, value in _samples(url, "ampscope_device_offences_total").items()
        if dict(labels)["run"] == run
    }


def _faults(url: str, run: str) -> dict[tuple[str, str], float]:
    return {
        (dict(labels)["rank"], dict(labels)["kind"]): value
        for labels, value in _samples(url, "ampscope_faults_total").items()
        if dict(labels)["run"] == run and value
    }


def _verdicts(url: str, run: str) -> dict[str, str]:
    health = get_json(f"{url}/api/v1/runs/{run}/health")
    return {v["rule"]: v["status"] for v in health["verdicts"]}


@pytest.mark.parametrize("run", HEALTHY)
def test_a_healthy_fp16_run_with_backoffs_is_weather(
    trained: tuple[str, list[dict[str, Any]]], run: str
) -> None:
    url, results = trained
    for out in results:
        seen = out[run]
        # The run overflowed for real: warm-up from 2**40, probing, the edge.
        assert seen["backoffs"] >= 10
        reasons = {reason for _, reason, _ in seen["calls_by_step"].values()}
        assert "warmup" in reasons
        assert {kind for kind, _, _ in seen["calls_by_step"].values()} == {"weather"}
        assert seen["calls"] == 0  # weather is never rerun
        assert seen["faults"] == {}
        assert seen["scale"] < 2.0**30
    assert _offences(url, run) == {}
    assert _faults(url, run) == {}
    assert get_json(f"{url}/api/v1/runs/{run}/suspect-batches") == []
    # Every skip of the run was weather, and the exporter says so: the skip and hotspot rules
    # count none of them (a warm-up from 2**40 skips 25 of its first steps).
    skipped = _of_run(_samples(url, "ampscope_skipped_steps_total"), run)
    weather = _of_run(_samples(url, "ampscope_weather_skipped_steps_total"), run)
    assert len(weather) == RANKS
    assert weather == skipped
    verdicts = _verdicts(url, run)
    assert verdicts["scale_collapse"] == "ok"
    assert verdicts["skip_storm"] == "ok"
    assert verdicts["inf_hotspot"] == "ok"
    assert verdicts["transient_fault"] == "ok"
    assert verdicts["reproducible_fault"] == "ok"


def test_a_one_time_corruption_is_the_rank_s_fault(
    trained: tuple[str, list[dict[str, Any]]],
) -> None:
    url, results = trained
    assert results[FAULT_RANK]["corrupt"]["calls_by_step"] == {
        FAULT_STEP: ("fault", "transient", True)
    }
    assert [out["corrupt"]["calls"] for out in results] == [1] * RANKS  # every rank reran
    assert _faults(url, "corrupt") == {(str(FAULT_RANK), "transient"): 1.0}
    assert _offences(url, "corrupt") == {(f"node0:{FAULT_RANK}", "transient_fault"): 1.0}
    suspects = get_json(f"{url}/api/v1/runs/corrupt/suspect-batches")
    assert [(s["step"], s["rank"]) for s in suspects] == [(FAULT_STEP, FAULT_RANK)]
    assert suspects[0]["batch_ids"] == _ids(FAULT_RANK, FAULT_STEP)
    # Without a closure: counted as what it is, blamed on nothing.
    for rank, out in enumerate(results):
        seen = out["corrupt-unrerun"]
        assert seen["calls_by_step"] == {
            FAULT_STEP: ("fault", "overflow_at_clean_scale", rank == FAULT_RANK)
        }
    assert _faults(url, "corrupt-unrerun") == {(str(FAULT_RANK), "overflow_at_clean_scale"): 1.0}
    assert _offences(url, "corrupt-unrerun") == {}
    assert get_json(f"{url}/api/v1/runs/corrupt-unrerun/suspect-batches") == []


def test_a_nan_sample_is_reproduced_and_not_the_device_s(
    trained: tuple[str, list[dict[str, Any]]],
) -> None:
    url, results = trained
    seen = results[NAN_RANK]["nan-loss"]
    assert seen["calls_by_step"][NAN_STEP] == ("fault", "reproducible", True)
    assert _faults(url, "nan-loss") == {(str(NAN_RANK), "reproducible"): 1.0}
    assert _offences(url, "nan-loss") == {}
    suspects = get_json(f"{url}/api/v1/runs/nan-loss/suspect-batches")
    assert [(s["step"], s["rank"]) for s in suspects] == [(NAN_STEP, NAN_RANK)]
    assert suspects[0]["batch_ids"] == _ids(NAN_RANK, NAN_STEP)
    assert _verdicts(url, "nan-loss")["reproducible_fault"] == "warning"


def test_non_finite_gradients_without_a_scaler_are_a_fault(
    trained: tuple[str, list[dict[str, Any]]],
) -> None:
    url, results = trained
    for rank, out in enumerate(results):
        kind, _, own = out["skip"]["calls_by_step"][FAULT_STEP]
        assert (kind, own) == ("fault", rank == FAULT_RANK)
    assert _faults(url, "watch-skip") == {(str(FAULT_RANK), "nonfinite_gradients"): 1.0}
    assert _offences(url, "watch-skip") == {(f"node0:{FAULT_RANK}", "nonfinite_origin"): 1.0}


def test_consequences_of_an_applied_update_are_no_offence(
    trained: tuple[str, list[dict[str, Any]]],
) -> None:
    url, results = trained
    for rank, out in enumerate(results):
        calls = out["observe"]["calls_by_step"]
        assert calls[FAULT_STEP][0] == "fault"
        later = [calls[step][:2] for step in range(FAULT_STEP + 1, FAULT_STEPS + 1)]
        assert later == [("consequence", "after_applied")] * (FAULT_STEPS - FAULT_STEP), rank
    offences = _offences(url, "watch-observe")
    assert all(device == f"node0:{FAULT_RANK}" for device, _ in offences), offences
    suspects = get_json(f"{url}/api/v1/runs/watch-observe/suspect-batches")
    assert {s["rank"] for s in suspects if s["step"] > FAULT_STEP} == set()
