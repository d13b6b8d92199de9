"""Two real ranks report through HttpReporter to a real exporter process, which is killed
and restarted mid-run; /metrics must still equal each rank's own ground truth.

The ranks train a DDP model with origin tracking; each rank injects an inf into its own
input on different steps, so DDP's all-reduce spreads it (both ranks skip, their local
found-inf counts agree) while the origin counts say which rank produced it.

One launch does every check (~10 s on 2 cores):
* steps, skipped steps, backoffs, growths, found-inf (local and origin) per device, the
  loss scale and the aligned scale on /metrics equal each rank's own snapshot and history;
* the first exporter had the pre-kill counts; after SIGKILL and a restart on the same
  port the counters are exact again (every record carries cumulative totals);
* ``ampscope_reporter_dropped_records_total`` equals the drops of rank 0's deliberately
  small reporter queue while the exporter was down, and 0 for rank 1 (default reporter,
  ``reporter="auto"`` via ``AMPSCOPE_URL``);
* ingest needs the bearer token (``AMPSCOPE_TOKEN`` on both sides); a wrong token is
  refused with 401 and the reporter drops and counts the batch instead of retrying;
* ``promtool check metrics`` accepts the exposition.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import DEADLOCK_GUARD_S, free_port, promtool_check_metrics, run_distributed

from ampscope.demo.exporter import ExporterProcess
from ampscope.verdicts import aligned

pytestmark = pytest.mark.distributed

TOKEN = "integration-secret"
RUN = "e2e-run"
BEFORE_KILL = 6
"""Steps both ranks take (and deliver) before the exporter is killed."""
WHILE_DOWN = 10
"""Steps taken while no exporter listens."""
AFTER_RESTART = 6
OVERFLOW_STEPS = {0: {2, 9, 17}, 1: {4, 5, 8, 12, 13, 20}}
"""Steps whose input holds an inf, per rank."""
ALL_OVERFLOWS = len(OVERFLOW_STEPS[0] | OVERFLOW_STEPS[1])


def _text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=DEADLOCK_GUARD_S) as response:
        return str(response.read().decode())


def _wait_for(flag: Path, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not flag.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{flag.name} did not appear within {timeout:.0f}s")
        time.sleep(0.02)


def _train(rank: int, world_size: int, url: str, flags: str) -> dict[str, Any]:
    """One rank: a tiny DDP model, an ampscope scaler with origin tracking."""
    import torch
    import torch.distributed as dist

    import ampscope
    from ampscope.reporter.http import HttpReporter
    from ampscope.reporter.schema import SCALE_ALIGN_STEPS

    flag_dir = Path(flags)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    reporter: Any = "auto"  # rank 1: HttpReporter() to AMPSCOPE_URL with AMPSCOPE_TOKEN
    if rank == 0:
        # Small queue so that the outage forces drops; fast retries to keep the test short.
        reporter = HttpReporter(
            url, flush_interval=0.05, max_batch=2, max_queue=4, retry_initial=0.05, retry_max=0.2
        )
    scaler = ampscope.GradScaler("cpu", init_scale=2.0**10, growth_interval=3, reporter=reporter)
    scaler.attach(model, track_origin=True)
    data = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank))

    def train(first: int, count: int) -> None:
        for step in range(first, first + count):
            batch = data.clone()
            if step in OVERFLOW_STEPS[rank]:
                batch[0, 0] = float("inf")
            loss = model(batch).pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()

    train(1, BEFORE_KILL)
    if rank == 0:
        assert reporter.flush(timeout=20), "pre-kill records not delivered"
    scaler.telemetry.snapshot()  # resolves pending steps, which hands their records on
    dist.barrier()
    if rank == 0:
        (flag_dir / "kill").touch()
    _wait_for(flag_dir / "killed")
    train(BEFORE_KILL + 1, WHILE_DOWN)
    scaler.telemetry.snapshot()
    dist.barrier()
    if rank == 0:
        (flag_dir / "restart").touch()
    _wait_for(flag_dir / "restarted")
    train(BEFORE_KILL + WHILE_DOWN + 1, AFTER_RESTART)

    snap = scaler.telemetry.snapshot()
    history = scaler.telemetry.history()
    last = history[-1]
    aligned_step = snap.steps - snap.steps % SCALE_ALIGN_STEPS
    scaler.close()  # flushes the reporter (rank 1's may be in a backoff: close retries at once)
    result = {
        "steps": snap.steps,
        "skipped_steps": snap.skipped_steps,
        "backoffs": snap.backoffs,
        "growths": snap.growths,
        "scale": snap.scale,
        "growth_tracker": snap.growth_tracker,
        "aligned_step": aligned_step,
        "aligned_scale": next(r.scale_after for r in history if r.step == aligned_step),
        "found_inf_local": dict(snap.found_inf_local),
        "found_inf_origin": dict(snap.found_inf_origin),
        "node": last.identity.node,
        "last_record": last,
    }
    if rank == 0:
        result["dropped"] = reporter.dropped
        result["sent"] = reporter.sent
    return result


def _control_exporter(exporter: ExporterProcess, flags: Path, seen: dict[str, Any]) -> None:
    """Test-side choreography: scrape, SIGKILL, and restart when the ranks say so."""
    try:
        _wait_for(flags / "kill")
        # Rank 1's default reporter sends every 0.5 s: wait until both ranks' steps arrived.
        end = time.monotonic() + DEADLOCK_GUARD_S
        while time.monotonic() < end:
            seen["before_kill"] = _samples(_text(exporter.url + "/metrics"))
            steps = [v for k, v in seen["before_kill"].items() if k[0] == "ampscope_steps_total"]
            if steps == [BEFORE_KILL, BEFORE_KILL]:
                break
            time.sleep(0.05)
        exporter.kill()
        (flags / "killed").touch()
        _wait_for(flags / "restart")
        exporter.start()
        (flags / "restarted").touch()
    except BaseException as exc:  # reported by the test; the ranks then time out
        seen["error"] = exc


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _per_rank(samples: dict) -> dict:
    return {k: v for k, v in samples.items() if not k[0].startswith("ampscope_exporter_")}


def _value(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"{name}{labels} missing from /metrics"
    return samples[key]


def test_counters_equal_ground_truth_across_an_exporter_kill(tmp_path, caplog):
    exporter = ExporterProcess(free_port(), env={"AMPSCOPE_TOKEN": TOKEN})
    exporter.start()
    flags = tmp_path / "flags"
    flags.mkdir()
    seen: dict[str, Any] = {}
    controller = threading.Thread(target=_control_exporter, args=(exporter, flags, seen))
    controller.start()
    try:
        results = run_distributed(
            _train,
            args=(exporter.url, str(flags)),
            env={"AMPSCOPE_URL": exporter.url, "AMPSCOPE_TOKEN": TOKEN, "AMPSCOPE_RUN_ID": RUN},
            timeout=120,
        )
        controller.join(30)
        assert "error" not in seen, seen.get("error")
        text = _text(exporter.url + "/metrics")
        samples = _samples(text)

        total_steps = BEFORE_KILL + WHILE_DOWN + AFTER_RESTART
        for rank, truth in enumerate(results):
            labels = {"run": RUN, "node": truth["node"], "rank": str(rank), "local_rank": str(rank)}
            own = len(OVERFLOW_STEPS[rank])
            # Ground truth is what we injected, and the exporter says the same.
            assert truth["steps"] == total_steps
            assert truth["skipped_steps"] == ALL_OVERFLOWS
            assert truth["found_inf_local"] == {"cpu": ALL_OVERFLOWS}
            assert truth["found_inf_origin"] == {"cpu": own}
            expected = {
                "ampscope_steps_total": truth["steps"],
                "ampscope_skipped_steps_total": truth["skipped_steps"],
                "ampscope_scale_backoffs_total": truth["backoffs"],
                "ampscope_scale_growths_total": truth["growths"],
                "ampscope_loss_scale": truth["scale"],
                "ampscope_growth_tracker": truth["growth_tracker"],
                "ampscope_last_step": truth["steps"],
                "ampscope_loss_scale_aligned": truth["aligned_scale"],
                "ampscope_loss_scale_aligned_step": truth["aligned_step"],
                # The pair in one sample, for the desync rule: equal to the float, bit for bit.
                "ampscope_loss_scale_aligned_packed": aligned.pack(
                    truth["aligned_step"], truth["aligned_scale"]
                ),
                "ampscope_rank_up": 1,
            }
            actual = {name: _value(samples, name, **labels) for name in expected}
            assert actual == expected, f"rank {rank}"
            assert truth["backoffs"] == ALL_OVERFLOWS
            assert truth["growths"] > 0
            found_inf = _value(samples, "ampscope_found_inf_total", device="cpu", **labels)
            origin = _value(samples, "ampscope_found_inf_origin_total", device="cpu", **labels)
            assert (found_inf, origin) == (ALL_OVERFLOWS, own), f"rank {rank}"
            # The first exporter had counted the pre-kill steps before it died.
            before = _value(seen["before_kill"], "ampscope_steps_total", **labels)
            assert before == BEFORE_KILL, f"rank {rank}"
            dropped = _value(samples, "ampscope_reporter_dropped_records_total", **labels)
            if rank == 0:
                # Queue of 4 (+ a batch of 2 in flight) against 10 steps while down.
                assert truth["dropped"] >= WHILE_DOWN - 4 - 2
                assert dropped == truth["dropped"]
                assert truth["sent"] + truth["dropped"] == total_steps
            else:
                assert dropped == 0

        # A reporter with the wrong token is refused (401): dropped and counted, not retried.
        caplog.set_level(logging.ERROR, logger="ampscope")
        from ampscope.reporter.http import HttpReporter

        intruder = HttpReporter(exporter.url, token="wrong", retry_initial=0.05, retry_max=0.1)
        intruder.emit(results[0]["last_record"])
        assert intruder.flush(timeout=10)
        intruder.close(1)
        assert (intruder.sent, intruder.dropped) == (0, 1)
        assert any("HTTP 401" in r.getMessage() for r in caplog.records)
        after = _samples(_text(exporter.url + "/metrics"))
        unauthorized = ("ampscope_exporter_ingest_rejections_total", (("reason", "token_wrong"),))
        assert after[unauthorized] == samples.get(unauthorized, 0) + 1
        assert _per_rank(after) == _per_rank(samples), "a refused batch changed rank state"

        promtool_check_metrics(text)
    finally:
        exporter.kill()
        controller.join(5)
