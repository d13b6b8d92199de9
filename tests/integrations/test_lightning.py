"""``ampscope.integrations.lightning.AmpscopeCallback`` with the real Lightning."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from checks import (
    check_exporter,
    check_failed_with,
    check_origin,
    check_same_training,
    check_watch,
    ranks_read,
)
from support import DEADLOCK_GUARD_S, need_module, run_distributed
from watch_workers import lightning_worker as lightning_watch_worker
from workers import INJECT_STEPS, STEPS, Net, batch, lightning_plugin, lightning_worker, poison

need_module("lightning")


def _check_logs(ours: dict[str, Any]) -> None:
    # log_every_n_steps=1: the module's logger got the scaler's scale after every step
    # and its running skipped-step count.
    skipped = [float(sum(ours["skipped"][: step + 1])) for step in range(STEPS)]
    assert ours["logged"] == list(zip(ours["record_scales"], skipped, strict=True))
    assert ours["callback_scaler_is_plugins"]
    assert ours["closed"]  # closed at teardown


def test_lightning_single_process(report_to: str) -> None:
    result = lightning_worker(0, 1, "pl-single")
    check_same_training(result["stock"], result["ours"])
    _check_logs(result["ours"])
    check_exporter(report_to, "pl-single", [result["ours"]])


@pytest.mark.distributed
def test_lightning_ddp_two_ranks(report_to: str) -> None:
    results = run_distributed(lightning_worker, 2, args=("pl-ddp",))
    for rank_result in results:
        check_same_training(rank_result["stock"], rank_result["ours"])
    # Lightning logs from rank 0 only.
    _check_logs(results[0]["ours"])
    check_origin([r["ours"] for r in results])
    for rank_result in results:  # attached to DDP(LightningModule): names unwrapped
        assert rank_result["ours"]["nonfinite"][min(INJECT_STEPS)] == ["net.head.weight"]
    check_exporter(report_to, "pl-ddp", [r["ours"] for r in results])


def test_lightning_fp32_has_no_scaler_and_nothing_changes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import lightning.pytorch as pl
    import torch

    from ampscope.integrations.lightning import AmpscopeCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.layer(x).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    callback = AmpscopeCallback(reporter=None)
    # "32-true": Lightning's plain Precision plugin, which runs no scaler (nor a watch).
    trainer = pl.Trainer(
        accelerator="cpu",
        precision="32-true",
        max_steps=2,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(torch.ones(4, 2), batch_size=None)
    with caplog.at_level(logging.WARNING, logger="ampscope"):
        trainer.fit(Module(), loader)
        trainer.fit(Module(), loader)  # reused: still says it once
    assert getattr(trainer.precision_plugin, "scaler", None) is None
    assert callback.scaler is None
    messages = [r.getMessage() for r in caplog.records if "no loss scaler" in r.getMessage()]
    assert len(messages) == 1
    assert "precision='32-true'" in messages[0]


def test_fsdp_precision_gets_the_sharded_scaler() -> None:
    """Lightning 2.6's FSDPPrecision("16-mixed", scaler=...) raises and would drop it;
    the callback sets the attribute on the plugin instead, keeping the class."""
    from lightning.pytorch.plugins.precision import FSDPPrecision
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    import ampscope
    from ampscope.integrations.lightning import AmpscopeCallback

    with pytest.raises(ValueError, match="does not use a scaler"):
        FSDPPrecision("16-mixed", scaler=ShardedGradScaler("cpu"))
    plugin = FSDPPrecision("16-mixed")
    stock = ShardedGradScaler("cpu", init_scale=8.0, growth_interval=5)
    plugin.scaler = stock

    class FakeTrainer:  # setup() reads the precision plugin and wraps the save
        precision_plugin = plugin

        def save_checkpoint(self, *args: Any) -> None:
            raise AssertionError("not called here")

    callback = AmpscopeCallback(reporter=None)
    callback.setup(FakeTrainer(), None, "fit")  # type: ignore[arg-type]
    assert isinstance(plugin.scaler, ampscope.ShardedGradScaler)
    assert plugin.scaler is callback.scaler
    assert (plugin.scaler.get_scale(), plugin.scaler.get_growth_interval()) == (8.0, 5)
    assert plugin.scaler.process_group is stock.process_group
    plugin.scaler.close()


def test_fsdp_precision_in_bf16_gets_a_watch() -> None:
    """Lightning runs FSDP only on GPUs; the swap is checked on the plugin, which runs the
    same scaler code path as MixedPrecision."""
    from lightning.pytorch.plugins.precision import FSDPPrecision

    import ampscope
    from ampscope.integrations.lightning import AmpscopeCallback

    plugin = FSDPPrecision("bf16-mixed")

    class FakeTrainer:  # setup() reads the precision plugin and wraps the save
        precision_plugin = plugin

        def save_checkpoint(self, *args: Any) -> None:
            raise AssertionError("not called here")

    callback = AmpscopeCallback(policy="skip", max_consecutive_skips=3, reporter=None)
    callback.setup(FakeTrainer(), None, "fit")  # type: ignore[arg-type]
    assert isinstance(plugin.scaler, ampscope.GradWatch)
    assert plugin.scaler is callback.scaler
    assert (plugin.scaler.policy, plugin.scaler.max_consecutive_skips) == ("skip", 3)
    plugin.scaler.close()


def test_logs_on_lightning_logging_steps_and_a_second_callback_is_harmless() -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import Logger

    from ampscope.integrations.lightning import AmpscopeCallback

    class ListLogger(Logger):  # type: ignore[misc]
        name, version = "list", "0"

        def __init__(self) -> None:
            super().__init__()
            self.metrics: list[tuple[int | None, dict[str, float]]] = []

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.metrics.append((step, dict(metrics)))

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
            pass

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()
            poison(self.net, 0, 1)

        def training_step(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.net(x).square().mean()  # type: ignore[no-any-return]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    first, second, logger = AmpscopeCallback(reporter=None), AmpscopeCallback(), ListLogger()
    trainer = pl.Trainer(
        accelerator="cpu",
        plugins=[lightning_plugin()],
        max_steps=STEPS,
        log_every_n_steps=3,
        logger=logger,
        callbacks=[first, second],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = torch.stack([batch(0, step) for step in range(STEPS)])
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=None))
    assert first.scaler is not None
    assert second.scaler is first.scaler  # the second one found it swapped, stood aside
    records = first.scaler.telemetry.history()
    logged = [(step, m["loss_scale"], m["skipped_steps"]) for step, m in logger.metrics]
    assert logged == [
        (step, records[step].scale_after, float(sum(r.skipped for r in records[: step + 1])))
        for step in range(2, STEPS, 3)
    ]


def test_lightning_bf16_mixed_gets_a_watch() -> None:
    result = lightning_watch_worker(0, 1, "pl-watch")
    check_watch(result, param="net.head.weight")
    for run in ("observe", "skip"):
        assert result[run]["plugin_holds_it"]
        assert result[run]["hook_restored"]  # the scheduler hook is the module's again
        assert result[run]["closed"]


@pytest.mark.distributed
def test_lightning_watch_ddp_two_ranks() -> None:
    results = run_distributed(lightning_watch_worker, 2, args=("pl-watch-ddp",))
    for rank, result in enumerate(results):
        check_watch(result, rank, 2, param="net.head.weight")


def _fit_with_ids(rows: list[Any], collate: Any = None, **options: Any) -> list[Any]:
    """Three bf16-mixed updates of two micro-batches of two rows; each update's ``batch``.

    The module's ``training_step`` takes a mapping's ``"x"`` and checks that the batch still
    holds every key the data loader gave it.
    """
    import lightning.pytorch as pl
    import torch

    from ampscope.integrations.lightning import AmpscopeCallback

    keys: list[list[str]] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if isinstance(batch, dict):
                keys.append(sorted(batch))
                batch = batch["x"]
            return self.net(batch).square().mean()  # type: ignore[no-any-return]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    callback = AmpscopeCallback(reporter=None, **options)
    trainer = pl.Trainer(
        accelerator="cpu",
        precision="bf16-mixed",
        max_steps=3,
        accumulate_grad_batches=2,
        logger=False,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(rows, batch_size=2, collate_fn=collate)  # type: ignore[arg-type]
    trainer.fit(Module(), loader)
    assert callback.scaler is not None
    if rows and isinstance(rows[0], dict):  # the batch reached training_step whole
        assert keys == [sorted(rows[0])] * 6
    return [record.batch for record in callback.scaler.telemetry.history()]


def _rows(key: str = "sample_ids") -> list[dict[str, Any]]:
    return [{"x": batch(0, index)[0], key: 1000 + index} for index in range(12)]


@pytest.mark.parametrize("as_list", [False, True])
def test_lightning_notes_the_ids_a_batch_carries(as_list: bool) -> None:
    # default_collate makes the ids a CPU tensor, read with tolist(); IdsAsList makes them
    # a list in the loader (what survives the move to a GPU). The micro-batches of one
    # update add up.
    from torch.utils.data import default_collate

    from ampscope.integrations import IdsAsList

    batches = _fit_with_ids(_rows(), IdsAsList(default_collate) if as_list else None)
    assert [(b.ids, b.left_out) for b in batches] == [
        (list(range(1000, 1004)), 0),
        (list(range(1004, 1008)), 0),
        (list(range(1008, 1012)), 0),
    ]


def test_lightning_notes_a_chosen_key_collated_as_a_list() -> None:
    from torch.utils.data import default_collate

    def collate(rows: list[dict[str, Any]]) -> dict[str, Any]:
        ids = [f"doc-{row['doc']}" for row in rows]
        collated = default_collate([{"x": row["x"]} for row in rows])
        return {**collated, "doc": ids}

    batches = _fit_with_ids(_rows("doc"), collate, batch_ids_key="doc")
    assert [b.ids for b in batches] == [
        [f"doc-{1000 + index}" for index in range(start, start + 4)] for start in (0, 4, 8)
    ]


def test_lightning_notes_nothing_without_the_key() -> None:
    assert _fit_with_ids([batch(0, index)[0] for index in range(12)]) == [None] * 3
    assert _fit_with_ids(_rows(), batch_ids_key="doc") == [None] * 3
    assert _fit_with_ids(_rows(), batch_ids_key=None) == [None] * 3


def test_lightnings_device_move_leaves_ids_collated_as_a_list() -> None:
    # What the strategy's batch_to_device does before on_train_batch_start (the meta device
    # stands in for a GPU): tensors move, a list of ids stays on the host.
    import torch
    from lightning.fabric.utilities.apply_func import move_data_to_device

    moved = move_data_to_device({"x": torch.ones(2), "sample_ids": [7, 8]}, torch.device("meta"))
    assert moved["x"].device.type == "meta"
    assert moved["sample_ids"] == [7, 8]


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_lightning_clips_through_the_front_end(
    precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``gradient_clip_val``: the same training as without ampscope, bit for bit, and
    after the first iteration the records' norms are the clip's (no norm pass of ampscope's
    own); the plugin's clip is Lightning's again after fit."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.plugins.precision import MixedPrecision

    from ampscope.integrations.lightning import AmpscopeCallback
    from ampscope.rank import compat

    own_passes = {"n": 0}
    original = compat.foreach_norm

    def counted(tensors: list[torch.Tensor], low_precision: bool) -> Any:
        own_passes["n"] += 1
        return original(tensors, low_precision)

    compat.check_torch()  # once per process, with a norm of its own: before counting
    monkeypatch.setattr(compat, "foreach_norm", counted)
    clip_norms: list[float] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(3)
            self.net = Net()

        def training_step(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.net(x).square().mean()  # type: ignore[no-any-return]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            # Lightning calls it after unscale_, before clipping.
            norms = torch.stack([p.grad.norm() for p in self.parameters()])
            clip_norms.append(torch.linalg.vector_norm(norms).item())

    def fit(callbacks: list[Any]) -> tuple[Module, MixedPrecision]:
        plugin = MixedPrecision(precision, "cpu")  # type: ignore[arg-type]
        module = Module()
        trainer = pl.Trainer(
            accelerator="cpu",
            plugins=[plugin],
            max_steps=STEPS,
            gradient_clip_val=1e-3,
            logger=False,
            callbacks=callbacks,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        data = torch.stack([batch(0, step) for step in range(STEPS)])
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
        return module, plugin

    stock, _ = fit([])
    callback = AmpscopeCallback(reporter=None)
    own_passes["n"] = 0
    clip_norms.clear()
    ours, plugin = fit([callback])
    for mine, theirs in zip(ours.parameters(), stock.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    assert own_passes["n"] == 1  # the first iteration's, before any clip was seen
    assert "clip_grad_by_norm" not in vars(plugin)
    assert callback.scaler is not None
    records = callback.scaler.telemetry.history()
    assert [r.stats.grad_norm for r in records] == pytest.approx(clip_norms, rel=1e-5)


def test_sigterm_keeps_lightnings_graceful_stop_and_the_rank_reads_stopped(
    report_to: str, tmp_path: Path
) -> None:
    # Lightning chains the SIGTERM handler it replaces (ampscope's, installed when the
    # callback built its reporter): it notes the signal and stops at the batch's end, which
    # its OnExceptionCheckpoint saves on. ampscope's handler says goodbye and leaves the end
    # to Lightning, instead of ending the process by SIGTERM's default.
    env = {**os.environ, "AMPSCOPE_RUN_ID": "pl-sigterm", "PYTHONPATH": _pythonpath()}
    worker = Path(__file__).parent / "lightning_sigterm_worker.py"
    process = subprocess.Popen(
        [sys.executable, str(worker), str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + DEADLOCK_GUARD_S
        while not (tmp_path / "started").exists():
            assert process.poll() is None, process.communicate()[0]
            assert time.monotonic() < deadline, "the worker never started training"
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=DEADLOCK_GUARD_S)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert (tmp_path / "on_exception.ckpt").exists(), output
    with urllib.request.urlopen(f"{report_to}/api/v1/runs/pl-sigterm/ranks", timeout=5) as r:
        ranks = json.loads(r.read())
    assert [(view["rank"], view["state"]) for view in ranks] == [(0, "stopped")]


def _pythonpath() -> str:
    root = str(Path(__file__).resolve().parents[2])
    inherited = os.environ.get("PYTHONPATH")
    return root if not inherited else f"{root}{os.pathsep}{inherited}"


@pytest.mark.parametrize("weights_only", [False, True], ids=["full", "weights-only"])
def test_lightning_pauses_the_rank_around_validation_and_checkpoint_saves(
    tmp_path: Any, weights_only: bool
) -> None:
    # A weights-only save calls no callback's on_save_checkpoint: the trainer's
    # save_checkpoint says it.
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from ampscope.integrations.lightning import AmpscopeCallback
    from ampscope.reporter import pause

    seen: list[tuple[str, str | None]] = []

    def note(where: str) -> None:
        now = pause.current()
        seen.append((where, None if now is None else now.reason))

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def training_step(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
            note("train")
            return self.net(x).square().mean()  # type: ignore[no-any-return]

        def validation_step(self, x: torch.Tensor, batch_idx: int) -> None:
            note("validate")

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class BatchEnd(pl.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, *args: Any) -> None:
            note("batch-end")  # after AmpscopeCallback's, before ModelCheckpoint's save

    class SpyingIO(TorchCheckpointIO):  # type: ignore[misc]
        def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
            note("write")  # the file itself, which can take many minutes for a large model
            super().save_checkpoint(checkpoint, path, storage_options)

    trainer = pl.Trainer(
        accelerator="cpu",
        plugins=[lightning_plugin(), SpyingIO()],
        max_steps=STEPS,
        val_check_interval=4,
        limit_val_batches=2,
        num_sanity_val_steps=1,
        logger=False,
        callbacks=[
            AmpscopeCallback(reporter=None),
            BatchEnd(),
            ModelCheckpoint(
                dirpath=tmp_path,
                every_n_train_steps=5,
                save_top_k=-1,
                save_weights_only=weights_only,
            ),
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = torch.stack([batch(0, step) for step in range(STEPS)])
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    trainer.fit(Module(), loader, loader)
    reasons = {where: {reason for w, reason in seen if w == where} for where, _ in seen}
    # A batch after a validation or a save is still paused until it ends (under DDP it
    # waits in its backward for the rank that writes); every batch's end ends the pause.
    assert reasons == {
        "train": {None, "eval", "checkpoint"},
        "validate": {"eval"},
        "write": {"checkpoint"},
        "batch-end": {None},
    }
    assert [reason for where, reason in seen if where == "train"][:2] == ["eval", None]
    assert sum(where == "write" for where, _ in seen) >= 2
    assert pause.current() is None  # fit ended every pause it opened
    assert "save_checkpoint" not in vars(trainer)  # and undid its wrap of the trainer's save


def _quiet_trainer(tmp_path: Any, callback: Any = None, **options: Any) -> Any:
    import lightning.pytorch as pl

    from ampscope.integrations.lightning import AmpscopeCallback

    return pl.Trainer(
        accelerator="cpu",
        plugins=[lightning_plugin()],
        max_steps=STEPS,
        logger=False,
        callbacks=[callback or AmpscopeCallback(reporter=None)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        **options,
    )


def _loader() -> Any:
    import torch

    data = torch.stack([batch(0, step) for step in range(STEPS)])
    return torch.utils.data.DataLoader(data, batch_size=None)


def _fit_quietly(tmp_path: Any, module: Any, callback: Any = None, **options: Any) -> Any:
    trainer = _quiet_trainer(tmp_path, callback, **options)
    trainer.fit(module, _loader(), _loader())
    return trainer


class _Module:
    """A LightningModule class whose validation raises when ``fail``, and whose training
    step raises at batch ``raise_at`` (built lazily: the import of lightning is the
    test's)."""

    @staticmethod
    def build(*, fail: bool, raise_at: int | None = None) -> Any:
        import lightning.pytorch as pl
        import torch

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = Net()
                self.raise_at = raise_at

            def training_step(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
                if batch_idx == self.raise_at:
                    raise RuntimeError("a bad batch")
                return self.net(x).square().mean()  # type: ignore[no-any-return]

            def validation_step(self, x: torch.Tensor, batch_idx: int) -> None:
                if fail and not self.trainer.sanity_checking:
                    raise RuntimeError("a metric's bug")

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.SGD(self.parameters(), lr=0.05)

        return Module()


def test_lightning_pause_ends_when_validation_raises_and_is_caught(tmp_path: Any) -> None:
    from ampscope.integrations.lightning import AmpscopeCallback
    from ampscope.reporter import pause

    callback = AmpscopeCallback(reporter=None)
    with pytest.raises(RuntimeError, match="a metric's bug"):
        _fit_quietly(tmp_path, _Module.build(fail=True), callback, val_check_interval=2)
    # Lightning skips the callbacks' teardown on this path; on_exception ends the pause,
    # and closes the front-end (its telemetry thread too).
    assert pause.current() is None
    assert callback.scaler is not None
    assert callback.scaler.telemetry.closed


def test_lightning_fit_that_raises_ends_the_rank_failed_and_a_retry_trains_on(
    report_to: str, tmp_path: Any
) -> None:
    from ampscope.integrations.lightning import AmpscopeCallback
    from ampscope.reporter import failure

    failure.forget()
    callback = AmpscopeCallback(run_id="pl-raises")
    trainer = _quiet_trainer(tmp_path, callback)
    module = _Module.build(fail=False, raise_at=3)
    with pytest.raises(RuntimeError, match="a bad batch"):
        trainer.fit(module, _loader())
    # Caught, as a retry wrapper or a notebook does: the rank ended failed, with the
    # exception, not running and then stalled (Lightning skipped the callbacks' teardown).
    failed = callback.scaler
    assert failed is not None
    [view] = ranks_read(report_to, "pl-raises", "failed")
    check_failed_with(view, "RuntimeError", "a bad batch")
    assert view["step"] == 3  # the three steps taken before the bad batch

    # The retry: the same trainer fits again, with a new scaler (the old one's scale),
    # whose records make the rank running again; it ends normally: finished.
    module.raise_at = None
    trainer.fit(module, _loader())
    retried = callback.scaler
    assert retried is not None
    assert retried is not failed
    assert trainer.precision_plugin.scaler is retried
    assert retried.telemetry.closed
    [view] = ranks_read(report_to, "pl-raises", "finished")
    assert view["failure"] is None
    assert view["step"] == retried.telemetry.history()[-1].step > 0
    failure.forget()


def test_lightning_pause_not_opened_by_a_save_checkpoint_after_fit(tmp_path: Any) -> None:
    from ampscope.reporter import pause

    trainer = _fit_quietly(tmp_path, _Module.build(fail=False), limit_val_batches=1)
    assert pause.current() is None
    trainer.save_checkpoint(tmp_path / "final.ckpt")
    # No next batch would end it: the rank would say paused for the rest of the process.
    assert pause.current() is None


def test_lightning_keeps_a_users_save_wrap_and_its_own_ends_with_its_fit(tmp_path: Any) -> None:
    # A user wraps the trainer's save during fit (an upload after each save), over the
    # callback's wrap, with functools.wraps (which copies a function's attributes): the
    # user's wrap stays after fit, and the callback's, left inside it, opens no pause once
    # its fit ended, so the next fit's pauses end at its batches as before.
    import functools

    import lightning.pytorch as pl

    from ampscope.reporter import pause

    uploads: list[str] = []

    class Upload(pl.Callback):  # type: ignore[misc]
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            if "save_checkpoint" in vars(trainer) and not uploads:
                inner = trainer.save_checkpoint

                @functools.wraps(inner)
                def save_checkpoint(path: Any, *args: Any, **kwargs: Any) -> Any:
                    result = inner(path, *args, **kwargs)
                    uploads.append(str(path))
                    return result

                trainer.save_checkpoint = save_checkpoint

    trainer = _quiet_trainer(tmp_path, limit_val_batches=1)
    trainer.callbacks.append(Upload())
    module = _Module.build(fail=False)
    trainer.fit(module, _loader(), _loader())
    wrap = vars(trainer).get("save_checkpoint")
    assert wrap is not None  # the user's
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    assert uploads == [str(tmp_path / "after.ckpt")]
    assert pause.current() is None
    # The same trainer fits again under a new callback, saving in a hook, through the
    # user's wrap and the first fit's: that one opens no pause (nothing of its own would end
    # it), the new callback's ends with the batch.
    from ampscope.integrations.lightning import AmpscopeCallback

    seen: list[str | None] = []

    class SaveEveryBatch(pl.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            trainer.save_checkpoint(tmp_path / "step.ckpt")
            now = pause.current()
            seen.append(None if now is None else now.reason)

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            now = pause.current()
            seen.append(None if now is None else now.reason)

    trainer.callbacks[:] = [AmpscopeCallback(reporter=None), SaveEveryBatch()]
    trainer.fit_loop.epoch_loop.max_steps = 2 * STEPS
    trainer.fit(module, _loader(), _loader())
    assert "checkpoint" in seen
    assert len(uploads) > 1
    assert pause.current() is None
