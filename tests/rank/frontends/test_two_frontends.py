"""Two front-ends open at once in one process (a GAN's scaler for D and one for G) report
under two run ids, never mixed into one series; one scaler for several optimizers, a retry
after close(), a notebook cell run again and a scaler that never steps keep the run id."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import ListSink, Net, run

import ampscope


def _scaler(sink: ListSink, **options: object) -> ampscope.GradScaler:
    return ampscope.GradScaler("cpu", init_scale=1024.0, reporter=None, sinks=[sink], **options)


def _optimizer(model: Net) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01)


def _runs(sink: ListSink) -> set[str]:
    return {r.identity.run for r in sink.records}


def _steps(sink: ListSink) -> list[int]:
    return [r.step for r in sink.records]


def _gan_iterations(
    first: torch.amp.GradScaler, second: torch.amp.GradScaler, steps: int, second_init: float
) -> None:
    """D's iteration through ``first``, then G's through ``second``, each its own update(),
    as a GAN with a scaler per network trains."""
    d_model, g_model = Net(), Net()
    d_opt, g_opt = _optimizer(d_model), _optimizer(g_model)
    for step in range(steps):
        first.scale(d_model(torch.tensor([step % 10]))).backward()
        first.step(d_opt)
        first.update()
        d_opt.zero_grad()
        second.scale(g_model(torch.tensor([(step + 3) % 10]))).backward()
        second.step(g_opt)
        second.update()
        g_opt.zero_grad()
    assert first.get_scale() == 1024.0
    assert second.get_scale() == second_init


@pytest.mark.parametrize("how", ["run_id", "env"])
def test_two_open_scalers_report_as_two_runs(
    how: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    options: dict[str, object] = {}
    if how == "run_id":
        options["run_id"] = f"gan-{how}"
    else:
        monkeypatch.setenv("AMPSCOPE_RUN_ID", f"gan-{how}")
    d_sink, g_sink = ListSink(), ListSink()
    d_scaler = _scaler(d_sink, **options)
    g_scaler = ampscope.GradScaler(
        "cpu", init_scale=4096.0, reporter=None, sinks=[g_sink], **options
    )
    _gan_iterations(d_scaler, g_scaler, 5, 4096.0)
    d_scaler.close()
    g_scaler.close()
    assert _runs(d_sink) == {f"gan-{how}"}
    assert _runs(g_sink) == {f"gan-{how}.2"}
    # Each series is one front-end's own: steps 1.., its own scale, no other's record.
    assert _steps(d_sink) == _steps(g_sink) == [1, 2, 3, 4, 5]
    assert {r.scale_after for r in d_sink.records} == {1024.0}
    assert {r.scale_after for r in g_sink.records} == {4096.0}
    assert any(f"'gan-{how}.2'" in r.getMessage() for r in caplog.records)


def test_one_scaler_for_two_optimizers_keeps_the_run_id() -> None:
    sink = ListSink()
    scaler = _scaler(sink, run_id="one-scaler")
    d_model, g_model = Net(), Net()
    d_opt, g_opt = _optimizer(d_model), _optimizer(g_model)
    for step in range(3):
        # torch's recipe for several optimizers: step each, then one update().
        scaler.scale(d_model(torch.tensor([step])) + g_model(torch.tensor([step]))).backward()
        scaler.step(d_opt)
        scaler.step(g_opt)
        scaler.update()
        d_opt.zero_grad()
        g_opt.zero_grad()
    scaler.close()
    assert _runs(sink) == {"one-scaler"}
    assert _steps(sink) == [1, 2, 3]


def test_a_retry_after_close_keeps_the_run_id() -> None:
    first_sink, retry_sink = ListSink(), ListSink()
    model = Net()
    first = _scaler(first_sink, run_id="retry")
    run(first, model, [_optimizer(model)], 2)
    first.close()
    retry = _scaler(retry_sink, run_id="retry")
    run(retry, model, [_optimizer(model)], 2)
    retry.close()
    assert _runs(first_sink) == _runs(retry_sink) == {"retry"}


def test_a_scaler_dropped_without_close_frees_the_run_id() -> None:
    """A notebook cell run again: the old scaler is unreachable but not yet collected."""
    sinks = [ListSink(), ListSink()]
    gc.disable()  # the clash itself must collect the old one, not the collector's timing
    try:
        for sink in sinks:
            model = Net()
            scaler = _scaler(sink, run_id="notebook")
            run(scaler, model, [_optimizer(model)], 2)
        scaler.close()
    finally:
        gc.enable()
    assert _runs(sinks[0]) == _runs(sinks[1]) == {"notebook"}


def test_scalers_that_never_record_claim_nothing() -> None:
    """An evaluation's scaler that never steps, and a disabled one, stay open beside the
    training scaler: it keeps the run id."""
    idle = _scaler(ListSink(), run_id="idle")
    disabled = ampscope.GradScaler("cpu", enabled=False, run_id="idle")
    model = Net()
    sink = ListSink()
    training = _scaler(sink, run_id="idle")
    run(training, model, [_optimizer(model)], 2)
    training.close()
    assert _runs(sink) == {"idle"}
    assert idle.telemetry.snapshot().steps == 0
    assert not disabled.is_enabled()
    idle.close()


def test_a_watch_beside_a_scaler_gets_its_own_run_id() -> None:
    scaler_sink, watch_sink = ListSink(), ListSink()
    scaler = _scaler(scaler_sink, run_id="mixed")
    watch = ampscope.GradWatch(reporter=None, sinks=[watch_sink], run_id="mixed")
    scaled, watched = Net(), Net()
    scaled_opt, watched_opt = _optimizer(scaled), _optimizer(watched)
    for step in range(2):
        scaler.scale(scaled(torch.tensor([step]))).backward()
        scaler.step(scaled_opt)
        scaler.update()
        watch.scale(watched(torch.tensor([step]))).backward()
        watch.step(watched_opt)
        watch.update()
    scaler.close()
    watch.close()
    assert _runs(scaler_sink) == {"mixed"}
    assert _runs(watch_sink) == {"mixed.2"}
