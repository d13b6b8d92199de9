"""CUDA-only paths of the scalers: fused Adam deciding on the GPU, FSDP1 ``CPUOffload``.

Each trains ampscope's scaler and torch's stock one side by side (same init, data and
injected inf, :func:`dist_setups.train_side_by_side`) and checks parity and the records.
FSDP1 runs on a one-rank NCCL group in this process (FSDP1 then uses ``NO_SHARD``): one GPU
cannot host two NCCL ranks, and the offloaded gradients are on the CPU either way.

On the GPU machine (torch 2.11, H200) two stock FSDP1 ``CPUOffload`` runs were bitwise
equal on an idle device but both ended with NaN parameters while another process loaded
the GPU and the CPUs, ampscope or not. So the parity test first trains two stock models
side by side and skips, saying so, when torch itself does not reproduce.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_setups import INJECT_STEPS, STEPS, batch, make_model, train_side_by_side
from torch import nn

import ampscope

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

EXPECTED_SKIPS = [step in INJECT_STEPS for step in range(STEPS)]


def _to_cuda(x: torch.Tensor, step: int) -> torch.Tensor:
    return x.cuda()


def _assert_parity(result: dict[str, Any]) -> None:
    assert result["params_equal"], "parameters differ from torch's stock scaler"
    assert result["params_changed"]
    assert result["ours_scales"] == result["torch_scales"]
    assert result["ours_skips"] == result["torch_skips"] == EXPECTED_SKIPS
    assert result["record_skips"] == EXPECTED_SKIPS
    assert result["record_scales"] == result["torch_scales"]
    assert result["snapshot_steps"] == STEPS
    assert result["totals"]["skipped_steps"] == len(INJECT_STEPS)
    flagged = [step for step, local in enumerate(result["local"]) if any(local.values())]
    assert flagged == sorted(INJECT_STEPS)


@pytest.fixture
def one_rank_nccl() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fused_adam_on_cuda_matches_stock_and_is_recorded() -> None:
    """A fused optimizer skips on the device; the record learns it from the copied flag."""

    def inject(model: nn.Module, step: int) -> None:
        model[2].weight.grad.view(-1)[3] = float("inf")

    ours_model, stock_model = make_model().cuda(), make_model().cuda()
    ours = ampscope.GradScaler("cuda", init_scale=2.0**10, growth_interval=3, reporter=None)
    ours.attach(ours_model)
    stock = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=3)
    result = train_side_by_side(
        0, ours_model, ours, stock_model, stock, inject, input_transform=_to_cuda, fused=True
    )
    _assert_parity(result)
    assert [result["local"][s] for s in sorted(INJECT_STEPS)] == [{"cuda:0": True}] * len(
        INJECT_STEPS
    )


def _skip_unless_stock_reproduces(
    wrap: Callable[[], nn.Module], inject: Callable[[nn.Module, int], None]
) -> None:
    """Train two stock copies side by side as the parity test does; skip the test if
    their parameters differ or are not finite (torch's run is then not reproducible)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    models = [wrap(), wrap()]
    scalers = [TorchSharded("cuda", init_scale=2.0**10, growth_interval=3) for _ in models]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    for step in range(STEPS):
        x = batch(0, step).cuda()
        for model, scaler, opt in zip(models, scalers, optimizers, strict=True):
            scaler.scale(model(x).square().mean()).backward()
            if step in INJECT_STEPS:
                inject(model, step)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    pairs = list(zip(models[0].parameters(), models[1].parameters(), strict=True))
    if not all(torch.equal(a, b) and bool(a.isfinite().all()) for a, b in pairs):
        pytest.skip("two stock FSDP1 CPUOffload runs differ on this device now: no parity verdict")


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_cpu_offload_matches_stock(one_rank_nccl: None, use_orig_params: bool) -> None:
    """Offloaded parameters and gradients live on the CPU while the scale is on the GPU."""
    from torch.distributed.fsdp import CPUOffload
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    def wrap() -> nn.Module:
        return FSDP(
            make_model(),
            device_id=torch.device("cuda", 0),
            cpu_offload=CPUOffload(offload_params=True),
            use_orig_params=use_orig_params,
        )

    def inject(model: nn.Module, step: int) -> None:
        if use_orig_params:
            model.module[2].weight.grad.view(-1)[3] = float("inf")
        else:
            # One flat parameter: 0.weight (128), 0.bias (16), 2.weight (64), 2.bias (4).
            next(model.parameters()).grad[136] = float("inf")

    _skip_unless_stock_reproduces(wrap, inject)
    ours_model = wrap()
    assert next(ours_model.parameters()).device.type == "cpu", "CPUOffload did not offload"
    ours = ampscope.ShardedGradScaler("cuda", init_scale=2.0**10, growth_interval=3, reporter=None)
    ours.attach(ours_model)
    stock = TorchSharded("cuda", init_scale=2.0**10, growth_interval=3)
    result = train_side_by_side(
        0, ours_model, ours, wrap(), stock, inject, input_transform=_to_cuda
    )
    _assert_parity(result)
    name = "2.weight" if use_orig_params else "0.bias"
    assert [result["nonfinite"][s] for s in sorted(INJECT_STEPS)] == [{name: 1}] * len(INJECT_STEPS)
