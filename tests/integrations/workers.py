"""Training runs with the real libraries, imported by the tests and by spawned ranks.

Every worker trains the same tiny model twice in one process: once as the library sets
itself up (the stock scaler) and once instrumented by ampscope, with the same seed, data
and injected inf, and returns plain values for the test to compare.

None of the three libraries runs fp16 loss scaling on CPU (Accelerate and the Trainer
silently drop the scaler and autocast, Lightning turns ``"16-mixed"`` into bf16). So
each worker sets up the scaler and fp16 autocast exactly where and how the library does
on a GPU, with the device ``"cpu"`` instead of ``"cuda"``; see :func:`as_on_gpu` and
:func:`lightning_plugin`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

STEPS = 12
INJECT_STEPS = frozenset({3, 7, 8})
"""0-based optimizer steps at which one rank's own gradient gets an inf."""
INIT_SCALE = 2.0**10
GROWTH_INTERVAL = 3
FEATURES = 8


def inject_rank(world_size: int) -> int:
    """The rank whose gradients overflow: the last one."""
    return world_size - 1


class Net(nn.Module):
    """Two linear layers; with ``labels`` returns the Trainer's ``{"loss": ...}``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.body = nn.Linear(FEATURES, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        out = self.head(torch.relu(self.body(x))).float()
        if labels is None:
            return out
        return {"loss": (out - labels).square().mean()}


def poison(model: nn.Module, rank: int, world_size: int) -> None:
    """Put an inf into this rank's own ``head.weight`` gradient at ``INJECT_STEPS``.

    A tensor hook runs before DDP's reducer sees the gradient, so only the injecting
    rank's pre-reduction gradient holds it: what origin tracking must name.
    """
    backward_calls = [0]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        step = backward_calls[0]
        backward_calls[0] += 1
        if rank == inject_rank(world_size) and step in INJECT_STEPS:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad

    model.head.weight.register_hook(hook)  # type: ignore[union-attr]


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, FEATURES, generator=torch.Generator().manual_seed(100 * rank + step))


def as_on_gpu(accelerator: Any) -> None:
    """What ``Accelerator(mixed_precision="fp16")`` sets up on a GPU, on the CPU.

    On a GPU it sets ``native_amp`` (``prepare()`` then wraps forward in fp16 autocast)
    and ``scaler = get_grad_scaler(...)``, a ``torch.amp.GradScaler`` for DDP and one
    device. On CPU it does neither, silently; the factors here stand in for a
    ``GradScalerKwargs`` handler.
    """
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler(
        "cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL
    )


def _summary(scaler: Any, model: nn.Module, scales: list[float]) -> dict[str, Any]:
    module = getattr(model, "module", model)
    result: dict[str, Any] = {
        # Plain floats (exact for float32): tensors sent from a rank that then exits
        # break torch.multiprocessing's shared-memory handoff.
        "params": [p.detach().flatten().tolist() for p in module.parameters()],
        "scales": scales,
        "scaler_class": f"{type(scaler).__module__}.{type(scaler).__qualname__}",
    }
    telemetry = getattr(scaler, "telemetry", None)
    if telemetry is not None:
        records = telemetry.history()
        result.update(
            record_scales=[r.scale_after for r in records],
            skipped=[r.skipped for r in records],
            origin=[any(r.found_inf_origin.values()) for r in records],
            nonfinite=[sorted(p.name for p in r.nonfinite_params) for r in records],
            run=records[-1].identity.run if records else None,
        )
    return result


# -- Accelerate -------------------------------------------------------------------------


def accelerate_run(rank: int, world_size: int, mode: str, run_id: str) -> dict[str, Any]:
    """``mode``: "stock", "before" (instrument before prepare) or "after"."""
    from accelerate import Accelerator

    from ampscope.integrations.accelerate import instrument

    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    as_on_gpu(accelerator)
    model = Net()
    poison(model, rank, world_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    if mode == "before":
        instrument(accelerator, run_id=run_id)
    model, optimizer = accelerator.prepare(model, optimizer)
    if mode == "after":
        instrument(accelerator, run_id=run_id)
        assert instrument(accelerator, run_id=run_id) is accelerator.scaler  # twice: same
    scales = []
    for step in range(STEPS):
        loss = model(batch(rank, step)).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        scales.append(accelerator.scaler.get_scale())
    scaler = accelerator.scaler
    result = _summary(scaler, model, scales)
    result["optimizer_scaler_is_accelerators"] = optimizer.scaler is scaler
    if mode != "stock":
        scaler.close()
    return result


def accelerate_worker(rank: int, world_size: int, run_id: str) -> dict[str, Any]:
    return {
        mode: accelerate_run(rank, world_size, mode, f"{run_id}-{mode}")
        for mode in ("stock", "before", "after")
    }


# -- Hugging Face Trainer ---------------------------------------------------------------


class Dataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(5)
        self.x = torch.randn(size, FEATURES, generator=generator)
        self.labels = torch.randn(size, 4, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "labels": self.labels[index]}


def trainer_run(
    rank: int, world_size: int, instrumented: bool, run_id: str, output_dir: str
) -> dict[str, Any]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ampscope.integrations.transformers import instrument

    class Watch(TrainerCallback):  # type: ignore[misc]
        """A report_to-style callback passed by the user: what it sees in on_log."""

        def __init__(self) -> None:
            self.logged: list[dict[str, float]] = []
            self.scales: list[float] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.scales.append(trainer.accelerator.scaler.get_scale())

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            self.logged.append(dict(logs or {}))

    args = TrainingArguments(
        output_dir=output_dir,
        use_cpu=True,
        fp16=True,
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=0.05,
        lr_scheduler_type="constant",
        optim="sgd",
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=3,
    )
    watch = Watch()
    model = Net()
    poison(model, rank, world_size)
    trainer = Trainer(model=model, args=args, train_dataset=Dataset(64), callbacks=[watch])
    as_on_gpu(trainer.accelerator)
    scaler = None
    if instrumented:
        scaler = instrument(trainer, run_id=run_id)
        assert instrument(trainer, run_id=run_id) is scaler  # twice: same scaler
    trainer.train()
    result = _summary(trainer.accelerator.scaler, trainer.model, watch.scales)
    result["logged"] = [
        (log["loss_scale"], log["skipped_steps"]) for log in watch.logged if "loss_scale" in log
    ]
    result["history_logged"] = [
        log["loss_scale"] for log in trainer.state.log_history if "loss_scale" in log
    ]
    result["closed"] = scaler is not None and scaler.telemetry.closed
    return result


def trainer_worker(rank: int, world_size: int, run_id: str, output_dir: str) -> dict[str, Any]:
    return {
        "stock": trainer_run(rank, world_size, False, run_id, output_dir),
        "ours": trainer_run(rank, world_size, True, run_id, output_dir),
    }


# -- Lightning --------------------------------------------------------------------------


def lightning_plugin() -> Any:
    """``Trainer(precision="16-mixed")`` on a GPU builds ``MixedPrecision("16-mixed",
    "cuda")`` with a ``torch.amp.GradScaler("cuda")``; on CPU Lightning switches to
    bf16-mixed. This is the GPU plugin with the device ``"cpu"``."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    return MixedPrecision(
        "16-mixed",
        "cpu",
        scaler=torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL),
    )


def lightning_run(rank: int, world_size: int, instrumented: bool, run_id: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import Logger

    from ampscope.integrations.lightning import AmpscopeCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()
            poison(self.net, rank, world_size)

        def training_step(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.net(x).square().mean()  # type: ignore[no-any-return]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class ListLogger(Logger):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.metrics: list[tuple[int, dict[str, float]]] = []

        name = "list"
        version = "0"

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.metrics.append((step or 0, dict(metrics)))

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
            pass

    class Watch(pl.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.scales: list[float] = []

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            self.scales.append(trainer.precision_plugin.scaler.get_scale())

    data = torch.stack([batch(r, s) for s in range(STEPS) for r in range(world_size)])
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    watch, logger = Watch(), ListLogger()
    callbacks: list[Any] = [watch]
    ampscope_callback = None
    if instrumented:
        ampscope_callback = AmpscopeCallback(run_id=run_id)
        callbacks.insert(0, ampscope_callback)
    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy="ddp" if world_size > 1 else "auto",
        plugins=[lightning_plugin()],
        max_steps=STEPS,
        log_every_n_steps=1,
        logger=logger,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    scaler = trainer.precision_plugin.scaler
    result = _summary(scaler, module.net, watch.scales)
    result["logged"] = [
        (m["loss_scale"], m["skipped_steps"]) for _, m in logger.metrics if "loss_scale" in m
    ]
    result["callback_scaler_is_plugins"] = (
        ampscope_callback is not None and ampscope_callback.scaler is scaler
    )
    result["closed"] = ampscope_callback is not None and scaler.telemetry.closed
    return result


def lightning_worker(rank: int, world_size: int, run_id: str) -> dict[str, Any]:
    return {
        "stock": lightning_run(rank, world_size, False, run_id),
        "ours": lightning_run(rank, world_size, True, run_id),
    }
