"""DeepSpeed ranks for tests/integrations/test_deepspeed.py (and the CUDA test).

Every scenario group runs in one launch: each rank builds several engines one after the
other on the same gloo process group. DeepSpeed runs on the CPU accelerator
(``DS_ACCELERATOR=cpu``, set by the tests before the ranks start), and its shared-memory
comm op, which the first start would compile with g++ for minutes, is turned off: gloo's
collectives carry everything (:func:`setup`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from typing import Any

import torch
from support import HostReads
from torch import nn

STEPS = 6
"""Optimizer steps (accumulation boundaries) per scenario."""
NAN_STEP = 3
"""The 1-based optimizer step whose rank-1 input holds a NaN (its first micro-batch)."""
NAN_RANK = 1
"""The rank whose input holds the NaN (rank 0 when there is one rank)."""
PARAMS = ("body.weight", "body.bias", "head.weight", "head.bias")
FEATURES = 8
FLIP_STEPS = 5
FLIP_STEP = 3
"""The replica fault: after this optimizer step's update, rank ``NAN_RANK``'s copy of
``FLIP_PARAM`` has one bit flipped (as a corrupted all-gather or memory would leave it)."""
FLIP_PARAM = "head.weight"
AGREE = {
    "agree": True,
    "replicas": 2,
    "ranks": [],
    "majority": True,
    "parameters": [],
    "parameters_differing": 0,
}
"""A record's replica check where both ranks' parameters agree."""
CLOSE_AFTER = 2
"""Rank 0 closes its monitor after this step; rank 1's replica checks go on with it."""


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(FEATURES, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def setup(*, fp16: bool = False) -> Any:
    """Import DeepSpeed on the CPU accelerator, its shm comm op off, on the process group
    the test launched. ``fp16``: a TEST-ONLY override of the CPU accelerator's
    ``is_fp16_supported`` (DeepSpeed refuses fp16 on a CPU without AVX512-FP16 support,
    "Type fp16 is not supported on your device"); with it fp16 trains at every stage."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    # deepspeed.comm's `torch` attribute is torch itself: the module is in sys.modules.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # type: ignore[attr-defined]
    if fp16:
        type(get_accelerator()).is_fp16_supported = lambda self: True
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


ZERO3_BUCKETS = {"reduce_bucket_size": 100}
"""ZeRO-3's gradient buckets, small enough that each backward reduces three, in backward
order: head.weight and head.bias (17 elements, copied into the bucket's buffer), body.weight
alone (128 elements: an "extra large" gradient, left outside the buffer), body.bias (the
end-of-backward flush). The per-bucket origin check is tried on both of DeepSpeed's paths
and on buckets reduced during the backward."""


def config(stage: int, section: str, gas: int, **precision: Any) -> dict[str, Any]:
    """``section``: the precision's config section (``fp16``, ``bf16``, ``torch_autocast``;
    ``FP32``: none)."""
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage, **(ZERO3_BUCKETS if stage == 3 else {})},
        **({} if section == FP32 else {section: {"enabled": True, **precision}}),
        "steps_per_print": 10**9,
    }


FP32 = "fp32"
"""No precision section: fp32, whose ZeRO-0 steps the user's torch optimizer (DeepSpeed
computes no norm there and has no overflow flag)."""


AUTOCAST = "torch_autocast"
"""DeepSpeed's torch.autocast mode, in fp16 (``"dtype": "float16"``): a torch GradScaler of
DeepSpeed's scales the loss; the model's weights stay float32."""


def world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def batch(
    rank: int,
    step: int,
    micro: int,
    dtype: torch.dtype,
    nan_step: int | None,
    features: int = FEATURES,
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randn(4, features, generator=generator)
    if rank == NAN_RANK % world() and step == nan_step and micro == 0:
        x[0, 0] = math.nan
    return x.to(dtype)


def train(
    rank: int,
    *,
    stage: int,
    dtype: str,
    gas: int = 2,
    steps: int = STEPS,
    nan_step: int | None = NAN_STEP,
    instrumented: bool = True,
    run_id: str | None = None,
    track_origin: bool | None = None,
    replica_check_every: int | None = None,
    flip_step: int | None = None,
    close_after: int | None = None,
    model: nn.Module | None = None,
    unmanaged: bool = False,
    **precision: Any,
) -> dict[str, Any]:
    """Train one engine; the rank's records, DeepSpeed's own view per step, the weights,
    what ampscope logged about replicas. ``dtype``: the config section (``AUTOCAST``:
    torch_autocast in fp16); ``flip_step``: plant the replica fault; ``close_after``: rank
    0 closes its monitor after that step and trains on; ``unmanaged``:
    ``"managed_gradient_accumulation": false``, ``step()`` called at the boundary only."""
    import deepspeed

    from ampscope.reporter.sinks import CallbackSink

    if dtype == AUTOCAST:
        precision = {"dtype": "float16", **precision}
    model = Net() if model is None else model
    features = next(model.parameters()).shape[-1]  # before ZeRO-3 partitions it
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={
            **config(stage, dtype, gas, **precision),
            **({"managed_gradient_accumulation": False} if unmanaged else {}),
        },
    )
    records: list[Any] = []
    monitor = None
    logged = _Logged()
    logging.getLogger("ampscope").addHandler(logged)
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
            track_origin=track_origin,
            **options,
        )
        assert instrument(engine) is monitor
    logging.getLogger("ampscope").removeHandler(logged)
    if flip_step is not None and rank == NAN_RANK:
        _flip_after(engine, flip_step)
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(dtype, torch.float32)
    seen: list[dict[str, Any]] = []
    for step in range(1, steps + 1):
        reads = 0
        for micro in range(gas):
            x = batch(rank, step, micro, torch_dtype, nan_step, features).to(engine.device)
            if monitor is not None:
                monitor.note_batch([f"r{rank}s{step}m{micro}"])
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            if unmanaged and micro < gas - 1:
                continue  # the caller owns the boundary: step() at the last micro-batch
            with HostReads() as census:  # the training thread's host reads in step()
                engine.step()
            reads += census.count
        seen.append(
            {
                "reads": reads,
                **said(engine),
                "scale": loss_scale_of(engine),
                "norm": _norm(engine),
                "weights": _weights(engine, stage),
            }
        )
        if monitor is not None and rank == 0 and step == close_after:
            monitor.close()
            from ampscope.integrations.deepspeed import instrument

            logging.getLogger("ampscope").addHandler(logged)
            assert instrument(engine) is monitor  # one monitor per engine, closed or not
            logging.getLogger("ampscope").removeHandler(logged)
    # Which origin check the monitor chose (the stage's reduction point), and that close()
    # took its wrap of allreduce_gradients off the engine.
    origin_check = None if monitor is None else type(monitor._flags).__name__
    reduced_check = monitor is not None and monitor._reduced is not None
    if monitor is not None:
        monitor.close()
    weights = _weights(engine, stage)
    unwrapped = "allreduce_gradients" not in vars(engine) and not any(
        name in vars(engine.optimizer) for name in _REDUCTIONS
    )
    engine.destroy()
    return {
        "records": [r.model_dump(mode="json") for r in records],
        "seen": seen,
        "weights": weights,
        "optimizer": type(engine.optimizer).__name__,
        "replica_logs": [m for m in logged.messages if "replica" in m],
        "closed_logs": [m for m in logged.messages if "closed" in m],
        "origin_check": origin_check,
        "reduced_check": reduced_check,
        "unwrapped": unwrapped,
    }


_REDUCTIONS = ("reduce_ipg_grads", "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads")
"""The ZeRO-2 and ZeRO-3 optimizers' bucket reductions, which the origin check wraps."""


class _Logged(logging.Handler):
    """The messages ampscope logs while an engine is instrumented."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _flip_after(engine: Any, step: int) -> None:
    """After the ``step``-th update of DeepSpeed's optimizer (inside ``engine.step()``, its
    all-gather done), flip the lowest bit of element 0 of this rank's ``FLIP_PARAM``."""
    own = engine.optimizer.step
    calls = [0]

    def step_then_flip(*args: Any, **kwargs: Any) -> Any:
        out = own(*args, **kwargs)
        calls[0] += 1
        if calls[0] == step:
            param = dict(engine.module.named_parameters())[FLIP_PARAM]
            words = {2: torch.int16, 4: torch.int32}[param.element_size()]
            param.detach().reshape(-1).view(words)[0] ^= 1
        return out

    engine.optimizer.step = step_then_flip


CUDA_STEPS = 16
CUDA_NAN_STEP = 14
CUDA_FP16 = {"initial_scale_power": 20, "loss_scale_window": 1000, "hysteresis": 1}
"""fp16 on a GPU from 2**20: backoffs until the gradients fit (weather), then clean steps."""


def cuda_run(rank: int, world_size: int) -> dict[str, Any]:
    """One CUDA rank (nccl), ZeRO-2: bf16 and real fp16, each with and without ampscope;
    origin tracking asked for (one rank: it is off by default)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl")
    out: dict[str, Any] = {}
    common = {"stage": 2, "steps": CUDA_STEPS, "nan_step": CUDA_NAN_STEP}
    out["bf16_plain"] = train(rank, dtype="bf16", instrumented=False, **common)
    out["bf16"] = train(rank, dtype="bf16", track_origin=True, **common)
    out["fp16_plain"] = train(rank, dtype="fp16", instrumented=False, **common, **CUDA_FP16)
    out["fp16"] = train(rank, dtype="fp16", track_origin=True, **common, **CUDA_FP16)
    return out


def said(engine: Any) -> dict[str, Any]:
    """What DeepSpeed says of the optimizer step just taken: applied, its skipped-step
    count, its optimizer's overflow flag."""
    return {
        "applied": engine.was_step_applied(),
        "skipped_steps": engine.skipped_steps,
        "overflow": bool(getattr(engine.optimizer, "overflow", False)),
    }


def loss_scale_of(engine: Any) -> float | None:
    """The loss scale DeepSpeed holds: its fp16 scaler's, or torch_autocast's GradScaler's
    (the engine's at ZeRO-0, the optimizer's at ZeRO 1-3); ``None`` without one."""
    if engine.fp16_enabled():
        return float(engine.optimizer.loss_scale)
    scaler = getattr(engine, "torch_autocast_z0_gradscaler", None) or getattr(
        engine.optimizer, "torch_autocast_gradscaler", None
    )
    return None if scaler is None else float(scaler.get_scale())


def _norm(engine: Any) -> float | None:
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def _weights(engine: Any, stage: int) -> list[float]:
    params = list(engine.module.parameters())
    if stage == 3:  # partitioned: gathered whole for the comparison
        from deepspeed.runtime.zero import GatheredParameters

        with GatheredParameters(params):
            return [v for p in params for v in p.detach().float().flatten().tolist()]
    return [v for p in params for v in p.detach().float().flatten().tolist()]


def bf16_stages(rank: int, world_size: int) -> dict[str, Any]:
    """ZeRO 0-3 in bf16 with the NaN, with and without ampscope (a replica check at every
    step); the replica fault at ZeRO 0-2; bf16 ZeRO-2 with ``check_grad_overflow: false``
    (DeepSpeed applies the NaN); 50 clean steps; fp32 ZeRO-0 with the NaN, with and
    without ampscope."""
    setup()
    out: dict[str, Any] = {}
    for stage in (0, 1, 2, 3):
        out[f"plain{stage}"] = train(rank, stage=stage, dtype="bf16", instrumented=False)
        out[f"ours{stage}"] = train(
            rank, stage=stage, dtype="bf16", run_id=f"ds-bf16-z{stage}", replica_check_every=1
        )
    for stage in (0, 1, 2):
        out[f"flip{stage}"] = train(
            rank,
            stage=stage,
            dtype="bf16",
            gas=1,
            steps=FLIP_STEPS,
            nan_step=None,
            run_id="ds-flip" if stage == 2 else None,
            replica_check_every=1,
            flip_step=FLIP_STEP,
        )
    out["closed"] = train(
        rank,
        stage=2,
        dtype="bf16",
        gas=1,
        steps=FLIP_STEPS,
        nan_step=None,
        replica_check_every=1,
        close_after=CLOSE_AFTER,
    )
    out["applied"] = train(
        rank, stage=2, dtype="bf16", run_id="ds-applied", check_grad_overflow=False
    )
    out["clean"] = clean_run(rank, world_size, "ds-clean")
    # fp32 at ZeRO-0: DeepSpeed says nothing of the NaN (no overflow flag, no norm).
    out["fp32_plain0"] = train(rank, stage=0, dtype=FP32, instrumented=False)
    out["fp32_0"] = train(rank, stage=0, dtype=FP32, run_id="ds-fp32-z0")
    for stage in (0, 2):
        out[f"failed{stage}"] = failed_record(rank, stage)
        out[f"unmanaged{stage}"] = train(rank, stage=stage, dtype="bf16", unmanaged=True)
    out["coalesced"] = coalesced(rank)
    return out


def coalesced(rank: int) -> dict[str, Any]:
    """bf16 ZeRO-1 under ``engine.coalesce_grad_reduction()``: one block of two backwards
    per optimizer step (``gradient_accumulation_steps`` 1, as DeepSpeed asks), ``step()``
    after the block, whose exit reduces every gradient (the backwards do not call
    ``allreduce_gradients()``). The NaN in rank ``NAN_RANK``'s first backward of
    :data:`NAN_STEP`, in whose block ``step()`` is first called (and refused)."""
    import deepspeed

    from ampscope.integrations.deepspeed import instrument
    from ampscope.reporter.sinks import CallbackSink

    model = Net()
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config(1, "bf16", 1)
    )
    records: list[Any] = []
    monitor = instrument(engine, sinks=[CallbackSink(records.append)], replica_check_every=0)
    seen = []
    for step in range(1, STEPS + 1):
        with engine.coalesce_grad_reduction():
            if step == NAN_STEP:  # a step() inside the block: DeepSpeed refuses it
                with contextlib.suppress(AssertionError):
                    engine.step()
            for micro in range(2):
                x = batch(rank, step, micro, torch.bfloat16, NAN_STEP)
                engine.backward(engine(x).float().pow(2).mean())
        engine.step()
        seen.append(said(engine))
    monitor.close()
    unwrapped = not {"allreduce_gradients", "coalesce_grad_reduction"} & set(vars(engine))
    engine.destroy()
    return {
        "records": [r.model_dump(mode="json") for r in records],
        "seen": seen,
        "unwrapped": unwrapped,
    }


def failed_record(rank: int, stage: int) -> dict[str, Any]:
    """bf16 with the NaN, the NaN rank's record of that step failing inside ampscope (a
    TEST-ONLY fault: the monitor's identity read raises once): the step after it must
    report its own, clean gradients, not the failed step's inf/NaN."""
    from ampscope.integrations.deepspeed import DeepSpeedMonitor

    own = DeepSpeedMonitor._ampscope_identity_now
    calls = 0

    def identity_now(monitor: DeepSpeedMonitor) -> Any:
        nonlocal calls
        calls += 1
        if rank == NAN_RANK and calls == NAN_STEP:
            raise RuntimeError("test-only: a failed record")
        return own(monitor)

    DeepSpeedMonitor._ampscope_identity_now = identity_now  # type: ignore[method-assign]
    try:
        return train(rank, stage=stage, dtype="bf16")
    finally:
        DeepSpeedMonitor._ampscope_identity_now = own  # type: ignore[method-assign]


FP16_STEPS = 8
FP16_NAN_STEP = 6
FP16_PRECISION = {"initial_scale_power": 18, "loss_scale_window": 2, "hysteresis": 1}
"""A scale too high for the gradients at first (backoffs), a window short enough to grow."""


def fp16_stages(rank: int, world_size: int) -> dict[str, Any]:
    """fp16 (the test-only override) at ZeRO 0 and 2: backoffs from a scale too high for
    the gradients, growth, then the NaN. Then DeepSpeed's torch_autocast fp16 mode at ZeRO
    0 and 2 with the NaN (its GradScaler; at ZeRO-0 the engine says it applied the step the
    GradScaler skipped), and with torchao's Float8Linear (emulated) at ZeRO-0."""
    setup(fp16=True)
    out: dict[str, Any] = {}
    for stage in (0, 2):
        common = {"stage": stage, "dtype": "fp16", "steps": FP16_STEPS, "nan_step": FP16_NAN_STEP}
        out[f"plain{stage}"] = train(rank, instrumented=False, **common, **FP16_PRECISION)
        out[f"ours{stage}"] = train(rank, run_id=f"ds-fp16-z{stage}", **common, **FP16_PRECISION)
    out["subset"] = not_given(rank)
    # torch_autocast last: DeepSpeed keeps it process-wide, and a ZeRO engine built after
    # one gets a GradScaler too, whatever its config says.
    for stage in (0, 2):
        common = {"stage": stage, "dtype": AUTOCAST, "steps": FP16_STEPS, "nan_step": FP16_NAN_STEP}
        out[f"autocast_plain{stage}"] = train(rank, instrumented=False, **common)
        out[f"autocast{stage}"] = train(rank, run_id=f"ds-autocast-z{stage}", **common)
    out["autocast_groups"] = autocast_groups(rank)
    out["autocast_fp8"] = autocast_fp8(rank)
    return out


NOT_GIVEN_STEPS = 10


def not_given(rank: int) -> dict[str, Any]:
    """fp16 ZeRO-1 whose optimizer was given only ``head``'s parameters: ``body`` requires a
    gradient that DeepSpeed neither steps nor zeroes, so its ``.grad`` sums over the steps
    (inputs 4 times larger) until it overflows in fp16; the steps DeepSpeed takes are
    clean. Records, DeepSpeed's view, whether ``body``'s gradient ended non-finite."""
    import deepspeed

    from ampscope.integrations.deepspeed import instrument
    from ampscope.reporter.sinks import CallbackSink

    model = Net()
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=model.head.parameters(),
        config=config(1, "fp16", 1, initial_scale_power=14),
    )
    records: list[Any] = []
    monitor = instrument(engine, sinks=[CallbackSink(records.append)], replica_check_every=0)
    seen = []
    for step in range(1, NOT_GIVEN_STEPS + 1):
        x = batch(rank, step, 0, torch.float32, None) * 4
        engine.backward(engine(x.half()).float().pow(2).mean())
        engine.step()
        seen.append(said(engine))
    monitor.close()
    grad = engine.module.body.weight.grad
    out = {
        "records": [r.model_dump(mode="json") for r in records],
        "seen": seen,
        "body_overflowed": grad is not None and not bool(grad.isfinite().all()),
    }
    engine.destroy()
    return out


AUTOCAST_GROUPS_STEPS = 8
AUTOCAST_BURST_STEP = 7
"""The step whose input is 100 times larger on every rank: an overflow at a grown scale."""


def autocast_groups(rank: int) -> dict[str, Any]:
    """torch_autocast fp16 at ZeRO-2 with three parameter groups, clean but for one burst of
    large inputs: DeepSpeed updates its GradScaler once per group in a step, so torch's
    growth tracker counts three per step. The GradScaler's growth interval is shortened to
    4 updates (a TEST-ONLY write of torch's private ``_growth_interval``) so that it grows
    within a few steps, on an update that is not the step's last. Per step: the scale and
    torch's own tracker, read after the step."""
    import deepspeed

    from ampscope.integrations.deepspeed import instrument
    from ampscope.reporter.sinks import CallbackSink

    torch.manual_seed(0)
    model = Net()
    groups = [
        {"params": [model.body.weight]},
        {"params": [model.body.bias]},
        {"params": list(model.head.parameters())},
    ]
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=groups, config=config(2, AUTOCAST, 1, dtype="float16")
    )
    scaler = engine.optimizer.torch_autocast_gradscaler
    scaler._growth_interval = 4
    records: list[Any] = []
    monitor = instrument(engine, sinks=[CallbackSink(records.append)], replica_check_every=0)
    seen = []
    for step in range(1, AUTOCAST_GROUPS_STEPS + 1):
        x = batch(rank, step, 0, torch.float32, None) * (100 if step == AUTOCAST_BURST_STEP else 1)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
        seen.append({"scale": float(scaler.get_scale()), "tracker": int(scaler._growth_tracker)})
    monitor.close()
    engine.destroy()
    return {"records": [r.model_dump(mode="json") for r in records], "seen": seen}


def autocast_fp8(rank: int) -> dict[str, Any]:
    """torch_autocast fp16 at ZeRO-0 on a model of torchao ``Float8Linear`` layers
    (``emulate=True``: the CPU), clean; the error's text where they do not compose."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return {"missing": "torchao"}

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
    try:
        return train(
            rank, stage=0, dtype=AUTOCAST, steps=3, nan_step=None, model=model, run_id=None
        )
    except Exception as error:  # the test shows what the combination does
        return {"error": f"{type(error).__name__}: {error}"}


def clean_run(rank: int, world_size: int, run_id: str) -> dict[str, Any]:
    """50 clean bf16 ZeRO-2 steps reported to the exporter (after :func:`setup`)."""
    return train(rank, stage=2, dtype="bf16", gas=1, steps=50, nan_step=None, run_id=run_id)


def accelerate_run(rank: int, world_size: int) -> dict[str, Any]:
    """Accelerate with a DeepSpeed plugin (ZeRO-2, bf16): ``instrument(accelerator)``
    before ``prepare()`` observes the engine ``prepare()`` builds."""
    setup()
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    from ampscope.integrations.accelerate import instrument
    from ampscope.reporter.sinks import CallbackSink

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # as `accelerate launch` sets it
    ds_config = config(2, "bf16", 2)
    del ds_config["optimizer"]  # the loop's own optimizer
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config)
    accelerator = Accelerator(
        deepspeed_plugin=plugin, mixed_precision="bf16", gradient_accumulation_steps=2
    )
    records: list[Any] = []
    monitor = instrument(
        accelerator, reporter=None, sinks=[CallbackSink(records.append)], replica_check_every=1
    )
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert instrument(accelerator) is monitor
    for step in range(1, STEPS + 1):
        for micro in range(2):
            with accelerator.accumulate(model):
                x = batch(rank, step, micro, torch.bfloat16, NAN_STEP)
                loss = model(x).float().pow(2).mean()
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    assert monitor is not None
    monitor.close()
    return {
        "records": [r.model_dump(mode="json") for r in records],
        "engine": type(model).__name__,
        "monitor": type(monitor).__name__,
    }


class _Samples(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Each rank's samples; rank 1's sample ``NAN_SAMPLE`` holds a NaN."""

    def __init__(self, rank: int) -> None:
        generator = torch.Generator().manual_seed(7 + rank)
        self.x = torch.randn(32, FEATURES, generator=generator)
        if rank == NAN_RANK:
            self.x[NAN_SAMPLE, 0] = math.nan

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"x": self.x[index], "sample_ids": index}


NAN_SAMPLE = 9
"""Rank 1's poisoned sample: in its third micro-batch of 4 samples, step 2 (gas 2)."""


class _Regression(Net):
    def forward(self, x: torch.Tensor) -> Any:  # type: ignore[override]
        return {"loss": super().forward(x).float().pow(2).mean()}


def trainer_run(rank: int, world_size: int, output_dir: str) -> dict[str, Any]:
    """The Trainer with ``deepspeed=`` (ZeRO-2; fp32: the Trainer refuses bf16 on a CPU
    unless ``use_cpu``, which turns DeepSpeed off): ``instrument(trainer)`` observes the
    engine the Trainer builds in ``train()``; the batch ids come from the dataset."""
    setup()
    from transformers import Trainer, TrainingArguments

    from ampscope.integrations.transformers import instrument
    from ampscope.reporter.sinks import CallbackSink

    ds_config = config(2, "bf16", 2)
    del ds_config["optimizer"], ds_config["bf16"]
    ds_config["train_micro_batch_size_per_gpu"] = "auto"
    ds_config["gradient_accumulation_steps"] = "auto"
    args = TrainingArguments(
        output_dir=output_dir,
        deepspeed=ds_config,
        max_steps=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=0.01,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_drop_last=True,
    )
    trainer = Trainer(model=_Regression(), args=args, train_dataset=_Samples(rank))
    records: list[Any] = []
    monitor = instrument(
        trainer, reporter=None, sinks=[CallbackSink(records.append)], replica_check_every=1
    )
    trainer.train()
    assert monitor is not None
    return {
        "records": [r.model_dump(mode="json") for r in records],
        "monitor": type(monitor).__name__,
        "closed": monitor.telemetry.closed,
        "logged": [log.get("skipped_steps") for log in trainer.state.log_history if "loss" in log],
    }


def hugging_face_runs(rank: int, world_size: int, output_dir: str) -> dict[str, Any]:
    """Accelerate, then the Trainer, on DeepSpeed in one launch (Accelerate's process-wide
    state reset between them, keeping the process group)."""
    from accelerate.state import AcceleratorState

    out = {"accelerate": accelerate_run(rank, world_size)}
    AcceleratorState._reset_state(reset_partial_state=False)
    out["trainer"] = trainer_run(rank, world_size, output_dir)
    return out
