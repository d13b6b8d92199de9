"""Small FP8 models (torchao Float8Linear, emulated on the CPU) and an independent hook
that computes what each layer's own cast does, for the FP8 tests."""

from __future__ import annotations

import json
import logging
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

torchao_float8 = pytest.importorskip("torchao.float8")
logging.getLogger("torchao").setLevel(logging.ERROR)

from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.config import Float8LinearRecipeName  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402
from torchao.float8.float8_scaling_utils import (  # noqa: E402
    get_maybe_axiswise_dim,
    hp_tensor_to_float8_dynamic,
)
from torchao.float8.float8_training_tensor import GemmInputRole  # noqa: E402


def config(
    recipe: str = "tensorwise", emulate: bool = True, **kwargs: object
) -> Float8LinearConfig:
    """A config of a torchao recipe: emulated (the CPU) unless ``emulate=False`` (real FP8
    matmuls: a CUDA GPU of compute capability 8.9 or later)."""
    base = Float8LinearConfig.from_recipe_name(Float8LinearRecipeName(recipe))
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    fields.update(emulate=emulate, **kwargs)
    return Float8LinearConfig(**fields)  # type: ignore[arg-type]


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class TinyFp8(nn.Module):
    """``blocks`` residual blocks of two Linear layers each, then a head; ``scale_input``
    multiplies the input of ``blocks.<target>.up`` (set by a test at a known step)."""

    def __init__(self, width: int = 16, blocks: int = 2, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 16)
        self.scale_input = 1.0
        self.target = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            if index == self.target and self.scale_input != 1.0:
                x = x * self.scale_input
            x = block(x)
        return self.head(x)


def fp8_model(recipe: str = "tensorwise", emulate: bool = True, **kwargs: object) -> TinyFp8:
    model = TinyFp8(**kwargs)  # type: ignore[arg-type]
    convert_to_float8_training(model, config=config(recipe, emulate=emulate))
    return model


def data(step: int, width: int = 16, rows: int = 8) -> torch.Tensor:
    """A batch with a wide dynamic range, so that casts underflow a little."""
    generator = torch.Generator().manual_seed(1000 + step)
    magnitude = 10.0 ** (torch.rand(rows, width, generator=generator) * 6 - 5)
    return torch.randn(rows, width, generator=generator) * magnitude


@dataclass
class Seen:
    """What the independent hook computed for one (layer, tensor)."""

    amax: list[float] = field(default_factory=list)
    underflow: list[float] = field(default_factory=list)
    scale: list[float] = field(default_factory=list)


def _independent(tensor: torch.Tensor, module: Float8Linear, which: str) -> tuple[float, ...]:
    """amax, underflow ratio and scale of torchao's own cast of ``tensor``, read from the
    Float8TrainingTensor that ``hp_tensor_to_float8_dynamic`` returns."""
    c = module.config
    cast_config, role, dim = {
        "input": (c.cast_config_input, GemmInputRole.INPUT, -1),
        "weight": (c.cast_config_weight, GemmInputRole.WEIGHT, 0),
        "grad_output": (c.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, -1),
    }[which]
    fp8 = hp_tensor_to_float8_dynamic(
        tensor,
        cast_config.target_dtype,
        module.linear_mm_config,
        gemm_input_role=role,
        scaling_granularity=cast_config.scaling_granularity,
        axiswise_dim=get_maybe_axiswise_dim(dim, cast_config.scaling_granularity),
        round_scales_to_power_of_2=c.round_scales_to_power_of_2,
    )
    nonzero = tensor != 0
    underflowed = (fp8._data.float() == 0) & nonzero
    ratio = underflowed.sum().item() / max(nonzero.sum().item(), 1)
    return tensor.abs().max().item(), ratio, fp8._scale.max().item()


def independent_hooks(model: nn.Module) -> dict[tuple[str, str], Seen]:
    """Hooks of the test's own on every Float8Linear: per (layer, tensor), what the layer's
    cast did in each forward/backward (grad_output as the layer received it: scaled)."""
    seen: dict[tuple[str, str], Seen] = {}

    def keep(name: str, which: str, values: tuple[float, ...]) -> None:
        entry = seen.setdefault((name, which), Seen())
        entry.amax.append(values[0])
        entry.underflow.append(values[1])
        entry.scale.append(values[2])

    for name, module in model.named_modules():
        if not isinstance(module, Float8Linear):
            continue

        def pre(mod: nn.Module, args: tuple[torch.Tensor, ...], name: str = name) -> None:
            with torch.no_grad():
                keep(name, "input", _independent(args[0], mod, "input"))  # type: ignore[arg-type]
                weight_t = mod.weight.t()
                keep(name, "weight", _independent(weight_t, mod, "weight"))  # type: ignore[arg-type]

        def post(mod: nn.Module, args: object, out: torch.Tensor, name: str = name) -> None:
            def on_grad(grad: torch.Tensor) -> None:
                flat = grad.reshape(-1, grad.shape[-1])
                keep(name, "grad_output", _independent(flat, mod, "grad_output"))  # type: ignore[arg-type]

            out.register_hook(on_grad)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
    return seen


LAYERS = ("blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down", "head")
"""The Float8Linear layers of :class:`TinyFp8` (two blocks)."""


def train(front: Any, model: nn.Module, steps: int, device: str = "cpu", rows: int = 8) -> None:
    """``steps`` SGD iterations through ``front`` (a scaler or a watch), then close it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(steps):
        optimizer.zero_grad()
        loss = model(data(step, rows=rows).to(device)).square().mean()
        front.scale(loss).backward()
        front.step(optimizer)
        front.update()
    front.close()


def check_records(
    records: list[Any], seen: dict[tuple[str, str], Seen], loss_scale: list[float]
) -> None:
    """Every observed record's FP8 values equal what :func:`independent_hooks` computed
    of the same iteration (``grad_output`` unscaled by that step's ``loss_scale``)."""
    observed = [r for r in records if r.fp8 is not None]
    assert observed
    for record in observed:
        at = record.step - 1
        assert {(e.layer, e.tensor) for e in record.fp8} == {
            (layer, t) for layer in LAYERS for t in ("input", "weight", "grad_output")
        }
        for entry in record.fp8:
            mine = seen[(entry.layer, entry.tensor)]
            divisor = loss_scale[at] if entry.tensor == "grad_output" else 1.0
            assert entry.amax is not None
            assert entry.amax == pytest.approx(mine.amax[at] / divisor, rel=1e-2)
            assert entry.underflow_ratio == pytest.approx(mine.underflow[at], abs=1e-3)
            assert entry.scale == pytest.approx(mine.scale[at] * divisor, rel=1e-2)
            assert entry.cast == (
                "grad_input_gemm" if entry.tensor == "grad_output" else "output_gemm"
            )
    # The data's dynamic range makes the casts underflow: the ratios are not all zero.
    assert max(e.underflow_ratio for r in observed for e in r.fp8 or ()) > 0.01


# -- 2-rank gloo workers (tests/rank/fp8/test_fp8_distributed.py) ------------------------

SPIKE_STEP = 30
"""1-based step at which rank 1 multiplies the input of ``SPIKE_LAYER`` by ``SPIKE``."""
SPIKE_LAYER = "blocks.1.up"
SPIKE = 1e3
SETUPS = ("ddp-watch-bf16", "ddp-scaler-fp16", "fsdp2-watch-bf16", "fsdp2-scaler-fp16")


def _inject(model: nn.Module, rank: int, steps: list[int]) -> None:
    """Rank 1 multiplies the layer's input by SPIKE at SPIKE_STEP and divides its output
    back: nothing but that one input's amax changes (registered before ampscope's hooks,
    so ampscope sees the multiplied input)."""
    layer = model.get_submodule(SPIKE_LAYER)

    def pre(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
        if rank == 1 and steps[0] == SPIKE_STEP:
            return (args[0] * SPIKE,)
        return None

    def post(module: nn.Module, args: object, out: torch.Tensor) -> torch.Tensor | None:
        if rank == 1 and steps[0] == SPIKE_STEP:
            return out / SPIKE
        return None

    layer.register_forward_pre_hook(pre)
    layer.register_forward_hook(post)


def health(url: str, run: str) -> dict[str, Any]:
    """The exporter's verdicts on ``run``, by rule."""
    with urllib.request.urlopen(f"{url}/api/v1/runs/{run}/health", timeout=10) as response:
        report: dict[str, Any] = json.load(response)
    return {v["rule"]: v for v in report["verdicts"]}


def fp8_worker(
    rank: int, world_size: int, url: str, run: str, steps: int, setups: tuple[str, ...] = SETUPS
) -> dict[str, object]:
    """Train the tiny FP8 model under each of ``setups`` (one run id each), reporting to
    the exporter at ``url``; return each setup's records' FP8 amax by step and (rank 0)
    the run's verdicts, read as soon as both ranks closed: a spike verdict lives for
    ``spike_verdict_window_s`` of the exporter's clock, so it is read before the later
    setups take their time."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import ampscope
    from ampscope.reporter.http import HttpReporter

    out: dict[str, object] = {}
    for setup in setups:
        wrap, front_name, precision = setup.split("-")
        model = TinyFp8(seed=0)
        convert_to_float8_training(
            model, config=config(enable_fsdp_float8_all_gather=wrap == "fsdp2")
        )
        step_box = [0]
        _inject(model, rank, step_box)
        if wrap == "ddp":
            wrapped: nn.Module = DistributedDataParallel(model)
        else:
            for block in model.blocks:
                fully_shard(block)
            wrapped = fully_shard(model)
        records: list[object] = []
        reporter = HttpReporter(url, flush_interval=0.05)
        sink = _Keep(records)
        front: object
        if front_name == "watch":
            front = ampscope.GradWatch(reporter=reporter, sinks=[sink], run_id=f"{run}-{setup}")
        else:
            front = ampscope.GradScaler(
                "cpu", init_scale=2.0**8, reporter=reporter, sinks=[sink], run_id=f"{run}-{setup}"
            )
        front.attach(wrapped, fp8_every=1)  # type: ignore[attr-defined]
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-2)
        for step in range(1, steps + 1):
            step_box[0] = step
            optimizer.zero_grad()
            x = data(1000 * rank + step)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = wrapped(x).float().square().mean()
            front.scale(loss).backward()  # type: ignore[attr-defined]
            front.step(optimizer)  # type: ignore[attr-defined]
            front.update()  # type: ignore[attr-defined]
        front.close(timeout=10.0)  # type: ignore[attr-defined]
        dist.barrier()
        out[setup] = {
            "amax": [
                {f"{e.layer}/{e.tensor}": e.amax for e in r.fp8 or ()}  # type: ignore[attr-defined]
                for r in records
            ],
            "casts": sorted({(e.tensor, e.cast) for r in records for e in r.fp8 or ()}),  # type: ignore[attr-defined]
            "skipped": [r.skipped for r in records],  # type: ignore[attr-defined]
            "health": health(url, f"{run}-{setup}") if rank == 0 else None,
        }
    return out


class _Keep:
    def __init__(self, records: list[object]) -> None:
        self.records = records

    def emit(self, record: object) -> None:
        self.records.append(record)

    def close(self, timeout: float) -> None:
        pass


def clean_worker(rank: int, world_size: int, url: str, steps: int) -> dict[str, object]:
    """A clean bf16 DDP run under GradWatch, every iteration observed (run id ``clean``):
    the steps it trained and (rank 0) the run's verdicts once both ranks closed."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import ampscope
    from ampscope.reporter.http import HttpReporter

    model = TinyFp8(seed=0)
    convert_to_float8_training(model, config=config())
    wrapped = DistributedDataParallel(model)
    watch = ampscope.GradWatch(reporter=HttpReporter(url, flush_interval=0.1), run_id="clean")
    watch.attach(wrapped, fp8_every=1)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    target = torch.randn(8, 16, generator=torch.Generator().manual_seed(5))
    for step in range(steps):
        optimizer.zero_grad()
        # Ordinary activations (data()'s deliberately wide range underflows by design).
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * rank + step))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = (wrapped(x).float() - target).square().mean()
        watch.scale(loss).backward()
        watch.step(optimizer)
        watch.update()
    recorded = watch.telemetry.snapshot().steps
    watch.close(timeout=10.0)
    dist.barrier()
    return {
        "steps": recorded,
        "health": health(url, "clean") if rank == 0 else None,
    }


def launch_worker(
    rank: int, world_size: int, url: str, steps: int, clean_steps: int
) -> dict[str, object]:
    """Every 2-rank FP8 check in one launch (one process start and torchao import): the
    spike run of ``steps`` under each of ``SETUPS`` (run ids ``spike-<setup>``), then the
    clean run of ``clean_steps``."""
    return {
        "spike": fp8_worker(rank, world_size, url, "spike", steps),
        "clean": clean_worker(rank, world_size, url, clean_steps),
    }
