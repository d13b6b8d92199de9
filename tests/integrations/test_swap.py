"""``ampscope.integrations._swap``: the twin trains exactly like the scaler it replaces."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded
from workers import INJECT_STEPS, STEPS, Net, batch, poison

import ampscope
from ampscope.integrations._swap import check_options, twin, warn_if_sinks_reused


def _train(scaler: Any, model: Net, optimizer: Any, steps: range, swap_at: int | None) -> Any:
    scales = []
    for step in steps:
        if step == swap_at:
            scaler = twin(scaler, {"reporter": None})
        scaler.scale(model(batch(0, step)).square().mean()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scales.append(scaler.get_scale())
    return scaler, scales


@pytest.mark.parametrize("swap_at", [0, 5])
def test_a_swap_before_or_during_training_changes_no_number(swap_at: int) -> None:
    runs = []
    for swap in (None, swap_at):
        model = Net()
        poison(model, 0, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        stock = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
        scaler, scales = _train(stock, model, optimizer, range(STEPS), swap)
        runs.append((scaler, scales, [p.detach().clone() for p in model.parameters()]))
    (stock, stock_scales, stock_params), (ours, our_scales, our_params) = runs
    assert type(ours) is ampscope.GradScaler
    assert our_scales == stock_scales
    assert all(torch.equal(a, b) for a, b in zip(stock_params, our_params, strict=True))
    assert ours.state_dict() == stock.state_dict()  # growth tracker carried over too
    records = ours.telemetry.history()
    assert [r.skipped for r in records] == [s in INJECT_STEPS for s in range(swap_at, STEPS)]
    ours.close()


def test_twin_keeps_class_settings_and_enabled_state() -> None:
    sharded = twin(TorchSharded("cpu", init_scale=4.0, backoff_factor=0.25, growth_interval=9), {})
    assert type(sharded) is ampscope.ShardedGradScaler
    assert sharded.get_backoff_factor() == 0.25
    assert (sharded.get_scale(), sharded.get_growth_interval()) == (4.0, 9)
    sharded.close()
    disabled = twin(torch.amp.GradScaler("cpu", enabled=False), {"reporter": None})
    assert disabled is not None
    assert not disabled.is_enabled()
    assert twin(disabled, {"reporter": None}) is disabled  # already ampscope's: unchanged
    assert twin(object(), {"reporter": None}) is None  # not a torch scaler: left alone


def test_scaling_arguments_are_not_telemetry_options() -> None:
    with pytest.raises(TypeError):
        check_options({"growth_interval": 10})
    with pytest.raises(ValueError, match="top_k"):
        check_options({"top_k": 0})


def test_the_replica_check_travels_with_the_integrations_options() -> None:
    check_options({"replica_check_every": 50})
    with pytest.raises(ValueError, match="replica_check_every"):
        check_options({"replica_check_every": -1})
    swapped = twin(torch.amp.GradScaler("cpu"), {"reporter": None, "replica_check_every": 7})
    assert swapped is not None
    assert swapped._ampscope_config.replica_check_every == 7
    swapped.close()


def test_a_retry_says_when_reporter_or_sink_objects_were_closed_with_the_last_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from ampscope.reporter.http import HttpReporter
    from ampscope.reporter.sinks import CallbackSink

    # Options a retry can rebuild from say nothing.
    for options in ({}, {"reporter": "auto"}, {"reporter": None, "run_id": "r"}):
        warn_if_sinks_reused(options, "Lightning's fit")
    assert caplog.records == []
    reporter = HttpReporter("http://127.0.0.1:9")
    try:
        options = {"reporter": reporter, "sinks": [CallbackSink(lambda record: None)]}
        warn_if_sinks_reused(options, "Lightning's fit")
    finally:
        reporter.close(0)
    (said,) = [r.getMessage() for r in caplog.records]
    assert "Lightning's fit trains again" in said
    assert "(HttpReporter, CallbackSink)" in said
