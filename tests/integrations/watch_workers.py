"""bf16 and fp32 training runs with the real libraries, a GradWatch installed by the
integrations; imported by the tests and by spawned ranks.

Each worker trains the same tiny model (bf16 autocast on CPU, which the libraries do
run) as the library sets itself up, then instrumented under ``observe`` and under
``skip``, with the same seed, data and injected inf (``workers.poison``), and returns
plain values: parameters as their float32 bit patterns, so that NaN weights compare too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from workers import STEPS, Dataset, Net, batch, poison

RUNS = ("stock", "observe", "skip")


def _bits(model: nn.Module) -> list[list[int]]:
    module = getattr(model, "module", model)
    return [p.detach().float().view(torch.int32).flatten().tolist() for p in module.parameters()]


def _scheduler_steps(scheduler: Any) -> int:
    return int(getattr(scheduler, "scheduler", scheduler).last_epoch)


def _summary(installed: Any, model: nn.Module, scheduler: Any) -> dict[str, Any]:
    result: dict[str, Any] = {
        "bits": _bits(model),
        "finite": all(bool(p.isfinite().all()) for p in model.parameters()),
        "scheduler_steps": _scheduler_steps(scheduler),
        "installed": None if installed is None else type(installed).__name__,
    }
    telemetry = getattr(installed, "telemetry", None)
    if telemetry is not None:
        records = telemetry.history()
        result.update(
            skipped=[r.skipped for r in records],
            found=[r.found_inf_global for r in records],
            origin=[any(r.found_inf_origin.values()) for r in records],
            nonfinite=[sorted(p.name for p in r.nonfinite_params) for r in records],
            setup=records[-1].setup.model_dump(),
            applied=records[-1].totals.nonfinite_applied,
            event=sorted({r.event for r in records}),
        )
    return result


def reset_accelerate() -> None:
    # One process trains several Accelerators with different precisions; Accelerate
    # keeps a process-wide state that refuses a second precision unless reset. Its
    # gradient state is a second one: a Trainer's run left behind (its data loader's end,
    # whether gradients sync) decides what a later Accelerator's accumulate() syncs.
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _decaying(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


# -- Accelerate -------------------------------------------------------------------------


def accelerate_run(
    rank: int, world_size: int, precision: str, run: str, run_id: str
) -> dict[str, Any]:
    from accelerate import Accelerator

    from ampscope.integrations.accelerate import instrument

    reset_accelerate()
    accelerator = Accelerator(mixed_precision=precision, cpu=True)
    model = Net()
    poison(model, rank, world_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = _decaying(optimizer)
    watch = None
    if run != "stock":
        watch = instrument(accelerator, policy=run, run_id=f"{run_id}-{run}", reporter=None)  # type: ignore[arg-type]
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    skipped = []
    for step in range(STEPS):
        accelerator.backward(model(batch(rank, step)).square().mean())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        skipped.append(optimizer.step_was_skipped)
    result = _summary(watch, model, scheduler)
    result["step_was_skipped"] = skipped
    result["is_accelerators"] = watch is None or accelerator.scaler is watch
    if watch is not None:
        watch.close()
    return result


def accelerate_worker(rank: int, world_size: int, run_id: str) -> dict[str, Any]:
    try:
        return {
            precision: {
                run: accelerate_run(rank, world_size, precision, run, run_id) for run in RUNS
            }
            for precision in ("bf16", "no")
        }
    finally:
        reset_accelerate()  # the fp16 tests in this process set their own precision


# -- Hugging Face Trainer ---------------------------------------------------------------


def trainer_run(
    rank: int, world_size: int, run: str, run_id: str, output_dir: str
) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments

    from ampscope.integrations.transformers import instrument

    reset_accelerate()
    args = TrainingArguments(
        output_dir=output_dir,
        use_cpu=True,
        bf16=True,
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=0.05,
        lr_scheduler_type="linear",
        optim="sgd",
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=3,
    )
    model = Net()
    poison(model, rank, world_size)
    trainer = Trainer(model=model, args=args, train_dataset=Dataset(64))
    watch = None
    if run != "stock":
        watch = instrument(trainer, policy=run, run_id=f"{run_id}-{run}", reporter=None)  # type: ignore[arg-type]
        assert instrument(trainer, policy=run) is watch  # twice: the same
    trainer.train()
    result = _summary(watch, trainer.model, trainer.lr_scheduler)
    result["logged"] = [
        (log["skipped_steps"], log["nonfinite_applied"])
        for log in trainer.state.log_history
        if "nonfinite_applied" in log
    ]
    result["closed"] = watch is not None and watch.telemetry.closed
    return result


def trainer_worker(rank: int, world_size: int, run_id: str, output_dir: str) -> dict[str, Any]:
    try:
        return {run: trainer_run(rank, world_size, run, run_id, output_dir) for run in RUNS}
    finally:
        reset_accelerate()


# -- Lightning --------------------------------------------------------------------------


def lightning_run(rank: int, world_size: int, run: str, run_id: str) -> dict[str, Any]:
    import lightning.pytorch as pl

    from ampscope.integrations.lightning import AmpscopeCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()
            poison(self.net, rank, world_size)

        def training_step(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.net(x).square().mean()  # type: ignore[no-any-return]

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": _decaying(optimizer), "interval": "step"},
            }

    data = torch.stack([batch(r, s) for s in range(STEPS) for r in range(world_size)])
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    callback = (
        AmpscopeCallback(policy=run, run_id=f"{run_id}-{run}", reporter=None)
        if run != "stock"
        else None
    )  # type: ignore[arg-type]
    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy="ddp" if world_size > 1 else "auto",
        precision="bf16-mixed",
        max_steps=STEPS,
        log_every_n_steps=1,
        logger=False,
        callbacks=[callback] if callback is not None else [],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    watch = callback.scaler if callback is not None else None
    result = _summary(watch, module.net, trainer.lr_scheduler_configs[0].scheduler)
    result["plugin_holds_it"] = watch is None or trainer.precision_plugin.scaler is watch
    result["hook_restored"] = "lr_scheduler_step" not in vars(module)
    result["closed"] = watch is not None and watch.telemetry.closed
    return result


def lightning_worker(rank: int, world_size: int, run_id: str) -> dict[str, Any]:
    return {run: lightning_run(rank, world_size, run, run_id) for run in RUNS}
