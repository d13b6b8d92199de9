"""``ampscope.integrations.transformers.instrument`` with the real Hugging Face Trainer."""

from __future__ import annotations

import logging
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
from support import need_module, run_distributed
from watch_workers import trainer_worker as trainer_watch_worker
from workers import INJECT_STEPS, STEPS, Dataset, Net, as_on_gpu, trainer_worker

need_module("transformers")


def _check_logs(ours: dict[str, Any]) -> None:
    # logging_steps=1: one training log per step, with the scaler's scale after that
    # step and its skipped-step count, seen by a user callback registered before
    # instrument() (as report_to callbacks are) and kept in trainer.state.log_history.
    skipped = [sum(ours["skipped"][: step + 1]) for step in range(STEPS)]
    assert ours["logged"] == list(zip(ours["record_scales"], skipped, strict=True))
    assert ours["history_logged"] == ours["record_scales"]
    assert ours["closed"]  # closed at the end of training


def test_trainer_single_process(report_to: str, tmp_path: Path) -> None:
    result = trainer_worker(0, 1, "hf-single", str(tmp_path))
    check_same_training(result["stock"], result["ours"])
    assert result["stock"]["logged"] == []
    _check_logs(result["ours"])
    check_exporter(report_to, "hf-single", [result["ours"]])


@pytest.mark.distributed
def test_trainer_ddp_two_ranks(report_to: str, tmp_path: Path) -> None:
    results = run_distributed(trainer_worker, 2, args=("hf-ddp", str(tmp_path)))
    for rank_result in results:
        check_same_training(rank_result["stock"], rank_result["ours"])
        _check_logs(rank_result["ours"])
    check_origin([r["ours"] for r in results])
    for rank_result in results:  # attached to the DDP-wrapped model: names unwrapped
        assert rank_result["ours"]["nonfinite"][min(INJECT_STEPS)] == ["head.weight"]
    check_exporter(report_to, "hf-ddp", [r["ours"] for r in results])


def test_trainer_without_a_scaler_changes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from transformers import Trainer, TrainingArguments

    from ampscope.integrations.transformers import instrument

    # fp16=True on CPU: the Trainer's accelerator silently has no scaler.
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, fp16=True, report_to=[])
    trainer = Trainer(model=Net(), args=args, train_dataset=Dataset(8))
    callbacks = list(trainer.callback_handler.callbacks)
    with caplog.at_level(logging.WARNING, logger="ampscope"):
        assert instrument(trainer, reporter=None) is None
        assert instrument(trainer, reporter=None) is None
    assert trainer.accelerator.scaler is None
    assert trainer.callback_handler.callbacks == callbacks
    messages = [r.getMessage() for r in caplog.records if "no loss scaler" in r.getMessage()]
    assert len(messages) == 1
    assert "Hugging Face Trainer has no loss scaler" in messages[0]


def _check_watch_logs(result: dict[str, Any]) -> None:
    # A watch logs no loss scale: its skipped steps and the non-finite updates applied.
    for run in ("observe", "skip"):
        ours = result[run]
        skipped = [sum(ours["skipped"][: step + 1]) for step in range(STEPS)]
        first = min(INJECT_STEPS)
        applied = [max(0, step - first + 1) if run == "observe" else 0 for step in range(STEPS)]
        assert ours["logged"] == list(zip(skipped, applied, strict=True))
        assert ours["closed"]


def test_trainer_bf16_gets_a_watch(tmp_path: Path) -> None:
    result = trainer_watch_worker(0, 1, "hf-watch", str(tmp_path))
    check_watch(result)
    _check_watch_logs(result)


@pytest.mark.distributed
def test_trainer_watch_ddp_two_ranks(tmp_path: Path) -> None:
    results = run_distributed(trainer_watch_worker, 2, args=("hf-watch-ddp", str(tmp_path)))
    for rank, result in enumerate(results):
        check_watch(result, rank, 2)
        _check_watch_logs(result)


class _IdDataset(Dataset):
    """The test Dataset with a ``sample_ids`` column, recording the order it is read in."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.read: list[int] = []

    def __getitem__(self, index: int) -> dict[str, Any]:
        self.read.append(index)
        return {**super().__getitem__(index), "sample_ids": 1000 + index}


def _train_with_ids(tmp_path: Path, dataset: Dataset, **options: Any) -> list[Any]:
    """Three bf16 updates of two micro-batches of two samples; each update's ``batch``."""
    from transformers import Trainer, TrainingArguments

    from ampscope.integrations.transformers import instrument

    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=True,
        max_steps=3,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        optim="sgd",
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=3,
    )
    trainer = Trainer(model=Net(), args=args, train_dataset=dataset)
    watch = instrument(trainer, reporter=None, **options)
    assert watch is not None
    trainer.train()  # Net.forward(x, labels) refuses any other keyword: none reaches it
    trainer.evaluate(_IdDataset(4))  # nor in evaluation
    return [record.batch for record in watch.telemetry.history()]


@pytest.mark.usefixtures("fresh_accelerate")
def test_trainer_notes_the_ids_a_batch_carries(tmp_path: Path) -> None:
    dataset = _IdDataset(12)
    batches = _train_with_ids(tmp_path, dataset)
    # The column survives remove_unused_columns (on by default); each update's record
    # holds the ids of its two micro-batches, in the order the sampler drew them.
    drawn = [1000 + index for index in dataset.read]
    assert sorted(drawn) == list(range(1000, 1012))
    assert [(b.ids, b.left_out) for b in batches] == [
        (drawn[0:4], 0),
        (drawn[4:8], 0),
        (drawn[8:12], 0),
    ]


@pytest.mark.usefixtures("fresh_accelerate")
def test_trainer_notes_nothing_without_the_key(tmp_path: Path) -> None:
    assert _train_with_ids(tmp_path, Dataset(12)) == [None, None, None]
    # Another key: the id column is an unused one, which the Trainer removes.
    assert _train_with_ids(tmp_path, _IdDataset(12), batch_ids_key="doc") == [None] * 3
    assert _train_with_ids(tmp_path, _IdDataset(12), batch_ids_key=None) == [None] * 3


@pytest.mark.usefixtures("fresh_accelerate")
def test_trainer_notes_a_chosen_key_and_keeps_the_batch(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    from ampscope.integrations.transformers import instrument

    seen: list[dict[str, Any]] = []

    class Keeping(Trainer):  # type: ignore[misc]
        def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            seen.append(dict(inputs))
            return super().training_step(model, inputs, *args, **kwargs)

    class Named(_IdDataset):
        def __getitem__(self, index: int) -> dict[str, Any]:
            row = super().__getitem__(index)
            row["doc"] = row.pop("sample_ids")  # ints: the default collator drops strings
            return row

    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=True,
        max_steps=2,
        per_device_train_batch_size=3,
        optim="sgd",
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    dataset = Named(6)
    trainer = Keeping(model=Net(), args=args, train_dataset=dataset)
    watch = instrument(trainer, reporter=None, batch_ids_key="doc")
    assert watch is not None
    trainer.train()
    drawn = [1000 + index for index in dataset.read]
    assert [r.batch.ids for r in watch.telemetry.history()] == [drawn[0:3], drawn[3:6]]
    # A subclass's own training_step runs, on a copy without the key.
    assert [sorted(inputs) for inputs in seen] == [["labels", "x"], ["labels", "x"]]


@pytest.mark.usefixtures("fresh_accelerate")
def test_trainer_rejects_a_bad_key(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    from ampscope.integrations.transformers import instrument

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, bf16=True, report_to=[])
    trainer = Trainer(model=Net(), args=args, train_dataset=Dataset(4))
    with pytest.raises(ValueError, match="batch_ids_key"):
        instrument(trainer, reporter=None, batch_ids_key="")
    with pytest.raises(TypeError, match="batch_ids_key"):
        instrument(trainer, reporter=None, batch_ids_key=3)  # type: ignore[arg-type]


@pytest.mark.usefixtures("fresh_accelerate")
def test_trainer_says_when_it_cannot_keep_the_id_column(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from transformers import Trainer, TrainingArguments

    from ampscope.integrations.transformers import instrument

    # A transformers without the private list of kept columns: the user is told what to do.
    monkeypatch.setattr(Trainer, "_set_signature_columns_if_needed", None)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, bf16=True, report_to=[])
    trainer = Trainer(model=Net(), args=args, train_dataset=Dataset(4))
    with caplog.at_level(logging.WARNING, logger="ampscope"):
        assert instrument(trainer, reporter=None) is not None
    messages = [r.getMessage() for r in caplog.records]
    [message] = [m for m in messages if "remove_unused_columns" in m]
    assert "set remove_unused_columns=False" in message


@pytest.mark.usefixtures("fresh_accelerate")
def test_trainer_pauses_the_rank_while_it_evaluates_and_saves(tmp_path: Path) -> None:
    import torch
    from transformers import Trainer, TrainingArguments

    from ampscope.integrations.transformers import instrument
    from ampscope.reporter import pause

    seen: list[tuple[str, str | None]] = []

    def note(where: str) -> None:
        now = pause.current()
        seen.append((where, None if now is None else now.reason))

    class SpiedNet(Net):
        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
            note("train" if self.training else "eval")
            return super().forward(x, labels)

    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=True,
        max_steps=6,
        per_device_train_batch_size=2,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=3,
        optim="sgd",
        report_to=[],
        disable_tqdm=True,
        seed=3,
    )
    trainer = Trainer(
        model=SpiedNet(), args=args, train_dataset=Dataset(12), eval_dataset=Dataset(4)
    )
    assert instrument(trainer, reporter=None) is not None
    save_model = trainer.save_model

    def spied_save(*a: Any, **kw: Any) -> None:
        note("write")  # the checkpoint's model file (then the optimizer's, the state's)
        save_model(*a, **kw)

    trainer.save_model = spied_save  # type: ignore[method-assign]
    trainer.train()
    reasons = {where: {reason for w, reason in seen if w == where} for where, _ in seen}
    # Steps 2, 4 and 6 evaluate, 3 and 6 save (6 after evaluating): each said what it did.
    assert reasons == {
        "train": {None, "eval", "checkpoint"},
        "eval": {"eval"},
        "write": {"checkpoint"},
    }
    # The step after one is still paused until it ends: under DDP it waits in its backward
    # for the rank that wrote the checkpoint.
    trained = [reason for where, reason in seen if where == "train"]
    assert trained == [None, None, "eval", "checkpoint", "eval", None]
    assert sum(where == "write" for where, _ in seen) == 2
    assert pause.current() is None  # the end of training ended every pause


@pytest.mark.usefixtures("fresh_accelerate")
def test_trainer_ends_its_pause_when_an_evaluation_raises(tmp_path: Path) -> None:
    import torch
    from transformers import Trainer, TrainingArguments

    from ampscope.integrations.transformers import instrument
    from ampscope.reporter import pause

    class FailingEval(Net):
        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
            if not self.training:
                raise RuntimeError("a metric's bug")
            return super().forward(x, labels)

    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=True,
        max_steps=4,
        per_device_train_batch_size=2,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="no",
        optim="sgd",
        report_to=[],
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=FailingEval(), args=args, train_dataset=Dataset(8), eval_dataset=Dataset(4)
    )
    front = instrument(trainer, reporter=None)
    assert front is not None
    with pytest.raises(RuntimeError, match="a metric's bug"):
        trainer.train()
    # The Trainer called no callback after the evaluation raised; the caller caught it.
    assert pause.current() is None
    assert front.telemetry.closed  # no on_train_end closed it: train() raising did


@pytest.mark.usefixtures("fresh_accelerate")
@pytest.mark.parametrize("fp16", [False, True], ids=["bf16-watch", "fp16-scaler"])
def test_trainer_train_that_raises_ends_the_rank_failed_and_a_retry_trains_on(
    report_to: str, tmp_path: Path, fp16: bool
) -> None:
    import torch
    from transformers import Trainer, TrainingArguments

    from ampscope.integrations.transformers import instrument
    from ampscope.reporter import failure

    class BadBatch(Net):
        raise_at: int | None = 3  # training forwards done before the bad one

        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
            if self.training and self.raise_at is not None:
                if self.raise_at == 0:
                    raise ValueError("a sample with no tokens")
                self.raise_at -= 1
            return super().forward(x, labels)

    failure.forget()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=not fp16,
        fp16=fp16,
        max_steps=6,
        per_device_train_batch_size=2,
        save_strategy="no",
        optim="sgd",
        report_to=[],
        disable_tqdm=True,
    )
    model = BadBatch()
    trainer = Trainer(model=model, args=args, train_dataset=Dataset(12))
    if fp16:
        as_on_gpu(trainer.accelerator)
    run = f"hf-raises-{'fp16' if fp16 else 'bf16'}"
    watch = instrument(trainer, run_id=run)
    assert watch is not None
    with pytest.raises(ValueError, match="a sample with no tokens"):
        trainer.train()
    # Caught, as a retry wrapper or a sweep does: the rank ended failed, with the exception,
    # not running and then stalled (the Trainer called no on_train_end).
    [view] = ranks_read(report_to, run, "failed")
    check_failed_with(view, "ValueError", "a sample with no tokens")
    assert view["step"] == 3

    # The retry: train() again, with a new front-end (the closed one's in its place would
    # record nothing), whose records make the rank running again; it ends finished. A
    # notebook or a sweep frees the accelerator's memory between the two, which unlists the
    # prepared optimizer: it still steps through the front-end the retry trains with.
    model.raise_at = None
    trainer.accelerator.free_memory()
    trainer.train()
    retried = trainer.accelerator.scaler
    assert retried is not watch
    assert type(retried) is type(watch)
    assert retried.telemetry.closed
    [view] = ranks_read(report_to, run, "finished")
    assert view["failure"] is None
    assert view["step"] == retried.telemetry.history()[-1].step == 6
    failure.forget()
