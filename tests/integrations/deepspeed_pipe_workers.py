"""DeepSpeed ``PipelineEngine`` ranks for tests/integrations/test_deepspeed_pipe.py.

One launch, on 2 gloo ranks, DeepSpeed on its CPU accelerator as in
:mod:`deepspeed_workers` (its :func:`~deepspeed_workers.setup`, with the test-only fp16
override): a ``PipelineModule`` of four layers trained with ``train_batch()``. In bf16 at
ZeRO-1: 2 stages x 1 data-parallel rank (with and without ampscope, the NaN at a known
step; and clean, for the health) and 1 stage x 2 data-parallel ranks (the replica check
compares); then 2 stages with the NaN in bf16 at ZeRO-0 (DeepSpeed's ``BF16_Optimizer``)
and in fp16 at ZeRO 0 and 1 (DeepSpeed's loss scaler).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from deepspeed_workers import loss_scale_of, said
from torch import nn

STEPS = 5
"""Optimizer steps (``train_batch()`` calls) per scenario."""
NAN_STEP = 3
"""The 1-based step whose first micro-batch holds a NaN in its input: with 2 stages, the
first stage's (rank 0, which loads the inputs): its forward reaches the last stage, so both
stages' gradients hold NaN; with 2 data-parallel ranks, rank ``NAN_RANK``'s only."""
NAN_RANK = 1
GAS = 2
STAGE_PARAMS = (("0.weight", "0.bias"), ("2.weight", "2.bias", "3.weight", "3.bias"))
"""Each stage's parameters (uniform partition: 2 of the 4 layers each; ReLU has none)."""
ALL_PARAMS = STAGE_PARAMS[0] + STAGE_PARAMS[1]


def _loss(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return (output.float() - label).pow(2).mean()


def _batches(
    rank: int, stages: int, nan_step: int | None, dtype: torch.dtype
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches ``train_batch()`` pulls (input, label), step by step."""
    nan_rank = 0 if stages > 1 else NAN_RANK
    step_micro = 0
    while True:
        step, micro = divmod(step_micro, GAS)
        step_micro += 1
        generator = torch.Generator().manual_seed(1000 * (step + 1) + 10 * micro + rank)
        x = torch.randn(4, 8, generator=generator)
        label = torch.randn(4, 1, generator=generator)
        if rank == nan_rank and step + 1 == nan_step and micro == 0:
            x[0, 0] = math.nan
        yield x.to(dtype), label


def train(
    rank: int,
    *,
    stages: int,
    nan_step: int | None = NAN_STEP,
    instrumented: bool = True,
    run_id: str | None = None,
    replica_check_every: int | None = None,
    zero: int = 1,
    precision: str = "bf16",
) -> dict[str, Any]:
    """Train a pipeline engine for :data:`STEPS` batches; the rank's records, DeepSpeed's
    own view per step, the weights, the stage and its data-parallel group."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    from ampscope.reporter.sinks import CallbackSink

    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 1)]
    model = PipelineModule(
        layers=layers, num_stages=stages, loss_fn=_loss, partition_method="uniform"
    )
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": zero},
        precision: {"enabled": True},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=list(model.parameters()), config=config
    )
    truth = _own_nonfinite(engine)
    records: list[Any] = []
    monitor = None
    if instrumented:
        from ampscope.integrations.deepspeed import instrument

        options = (
            {} if replica_check_every is None else {"replica_check_every": replica_check_every}
        )
        monitor = instrument(
            engine,
            run_id=run_id,
            reporter=None if run_id is None else "auto",
            sinks=[CallbackSink(records.append)],
            **options,
        )
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    data = _batches(rank, stages, nan_step, dtype)
    seen: list[dict[str, Any]] = []
    for step in range(1, STEPS + 1):
        if monitor is not None:
            monitor.note_batch([f"r{rank}s{step}"])
        loss = engine.train_batch(data)
        norm = engine.get_global_grad_norm()
        seen.append(
            {
                **said(engine),
                "norm": None if norm is None else float(norm),
                "scale": loss_scale_of(engine),
                "loss": float(loss),
            }
        )
    if monitor is not None:
        monitor.close()
    weights = [v for p in engine.module.parameters() for v in p.detach().float().flatten().tolist()]
    out = {
        "records": [r.model_dump(mode="json") for r in records],
        "seen": seen,
        "weights": weights,
        "stage": engine.stage_id,
        "params": [name for name, _ in engine.module.named_parameters()],
        "group": dist.get_process_group_ranks(engine.seq_data_parallel_group),
        "grid_group": list(engine.grid.dp_group),
        "optimizer": type(engine.optimizer).__name__,
        "truth": truth,
    }
    engine.destroy()
    return out


def _own_nonfinite(engine: Any) -> list[list[str]]:
    """The origin's ground truth where ``train_batch()`` reduces through
    ``allreduce_gradients()`` (not under ``BF16_Optimizer``): at each such reduction, this
    stage's parameters whose ``.grad`` (summed over the micro-batches) held inf/NaN right
    before it. Installed before ampscope's own wrap of the same method."""
    found: list[list[str]] = []
    named = list(engine.module.named_parameters())
    own = engine.allreduce_gradients

    def allreduce_gradients(*args: Any, **kwargs: Any) -> Any:
        found.append(
            [n for n, p in named if p.grad is not None and not bool(p.grad.isfinite().all())]
        )
        return own(*args, **kwargs)

    engine.allreduce_gradients = allreduce_gradients
    return found


def pipelines(rank: int, world_size: int) -> dict[str, Any]:
    """Every pipeline scenario, in one launch."""
    from deepspeed_workers import setup

    setup(fp16=True)
    return {
        "plain": train(rank, stages=2, instrumented=False),
        "ours": train(rank, stages=2, run_id="ds-pipe-nan"),
        "clean": train(rank, stages=2, nan_step=None, run_id="ds-pipe-clean"),
        "data": train(rank, stages=1, replica_check_every=1),
        "bf16z0": train(rank, stages=2, zero=0),
        "fp16z0": train(rank, stages=2, zero=0, precision="fp16"),
        "fp16z1": train(rank, stages=2, zero=1, precision="fp16"),
        "tied": tied(rank),
    }


TIED_WEIGHT = "tied_modules.t.weight"


def tied(rank: int) -> dict[str, Any]:
    """2 stages sharing one weight (``TiedLayerSpec``: the first and last layer), bf16 at
    ZeRO-1: at :data:`NAN_STEP` only the first stage's own gradient of the tied weight is
    made NaN (a hook on that stage), before ``train_batch()`` all-reduces the tied
    gradients across the stages. Each stage's records."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    from ampscope.integrations.deepspeed import instrument
    from ampscope.reporter.sinks import CallbackSink

    torch.manual_seed(0)
    layers = [
        TiedLayerSpec("t", nn.Linear, 8, 8),
        LayerSpec(nn.Linear, 8, 8),
        LayerSpec(nn.Linear, 8, 8),
        TiedLayerSpec("t", nn.Linear, 8, 8),
    ]
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=_tied_loss)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=list(model.parameters()), config=config
    )
    step = 0
    if engine.stage_id == 0:
        weight = dict(engine.module.named_parameters())[TIED_WEIGHT]
        weight.register_hook(lambda grad: grad * math.nan if step == NAN_STEP else grad)
    records: list[Any] = []
    monitor = instrument(engine, sinks=[CallbackSink(records.append)], track_origin=True)

    def data() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(rank)
        while True:
            x = torch.randn(4, 8, generator=generator)
            yield x.to(torch.bfloat16), torch.randn(4, 8, generator=generator)

    batches = data()
    for step in range(1, STEPS + 1):  # noqa: B007 (the hook reads it)
        engine.train_batch(batches)
    monitor.close()
    out = {"stage": engine.stage_id, "records": [r.model_dump(mode="json") for r in records]}
    engine.destroy()
    return out


def _tied_loss(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return (output.float() - label).pow(2).mean()
