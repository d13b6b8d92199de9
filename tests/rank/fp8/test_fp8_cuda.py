"""FP8 observation on real FP8 matmuls: torchao ``Float8Linear`` without emulation on a
CUDA GPU of compute capability 8.9 or later (Ada, Hopper, Blackwell). The same checks as
the emulated CPU tests (tests/rank/fp8/test_fp8_observer.py): each observed value equals
what the layer's own cast computed. Skips elsewhere (CI has no GPU)."""

from __future__ import annotations

import pytest
import torch
from fp8_setups import check_records, fp8_model, independent_hooks, train
from helpers import ListSink

import ampscope

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with FP8 matmuls (compute capability 8.9 or later)",
)

ROWS = 32
"""Batch rows: ``torch._scaled_mm`` wants every dimension a multiple of 16, and the
weight gradient's inner dimension is the batch."""


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_watch_values_equal_the_layers_own_cast_on_fp8_matmuls(recipe: str) -> None:
    model = fp8_model(recipe, emulate=False).cuda()
    seen = independent_hooks(model)
    sink = ListSink()
    watch = ampscope.GradWatch(reporter=None, sinks=[sink])
    watch.attach(model, fp8_every=1)
    train(watch, model, 4, device="cuda", rows=ROWS)
    assert len(sink.records) == 4
    check_records(sink.records, seen, [1.0] * 4)
    identity = sink.records[0].device
    assert identity is not None
    assert identity.device.startswith("GPU-")  # the GPU's UUID, as DCGM-exporter names it


def test_scaler_reports_grad_output_unscaled_on_fp8_matmuls() -> None:
    model = fp8_model(emulate=False).cuda()
    seen = independent_hooks(model)
    sink = ListSink()
    scaler = ampscope.GradScaler(
        "cuda", init_scale=2.0**12, growth_interval=2, reporter=None, sinks=[sink]
    )
    scaler.attach(model, fp8_every=1)
    train(scaler, model, 5, device="cuda", rows=ROWS)
    scales = [r.scale_before for r in sink.records]
    assert len(set(scales)) > 1
    check_records(sink.records, seen, scales)


def test_observing_adds_no_host_device_sync() -> None:
    """Observed iterations under ``set_sync_debug_mode("error")``: the FP8 values ride
    the step's one device-side copy; a read on the host would raise."""
    model = fp8_model(emulate=False).cuda()
    sink = ListSink()
    watch = ampscope.GradWatch(reporter=None, sinks=[sink])
    watch.attach(model, fp8_every=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(ROWS, 16, device="cuda")

    def iteration() -> None:
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        watch.scale(loss).backward()
        watch.step(optimizer)
        watch.update()

    for _ in range(3):  # warm-up: first casts, the first update()'s identity
        iteration()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            iteration()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    watch.close()
    assert len(sink.records) == 8
    assert all(r.fp8 for r in sink.records)
