"""Hugging Face ``Trainer``: ``instrument(trainer)`` before ``trainer.train()``.

The Trainer builds an Accelerate ``Accelerator`` in its constructor and keeps the loss
scaler there (``trainer.accelerator.scaler``); ``train()`` prepares the model and the
optimizer, which hands that scaler to the optimizer wrapper. So the swap happens between
``Trainer()`` and ``train()``, and attaching waits for ``on_train_begin``, when
``trainer.model_wrapped`` is the DDP/FSDP-wrapped model. A ``TrainerCallback`` (the shape
of Hugging Face's own ``TensorBoardCallback``) does the attaching, adds ``loss_scale`` and
``skipped_steps`` to the training logs and closes the scaler when training ends.

With ``deepspeed=`` the engine the Trainer builds is observed instead (see
:mod:`ampscope.integrations.deepspeed`). With ``bf16=True`` (or fp32) there is no
scaler: a :class:`~ampscope.GradWatch` takes its place (see
:mod:`ampscope.integrations.accelerate`). The Trainer steps its LR scheduler only when
``accelerator.optimizer_step_was_skipped`` is false, so under ``policy="skip"`` a skipped
iteration holds the scheduler, as an fp16 overflow does.

Batch ids: a ``TrainerCallback`` never sees the batch, so ``instrument`` wraps the
Trainer's ``training_step`` (an instance attribute over the class's method, as Accelerate's
``prepare`` is wrapped), which runs once per micro-batch: when the batch holds the
``batch_ids_key`` column its ids are noted, and the step gets a shallow copy without it
(``prediction_step`` too), since the Trainer unpacks the batch into ``model(**inputs)``.
The column survives ``remove_unused_columns`` (the key joins the Trainer's list of the
model's input names) and the collator's tensor of ids becomes a list before Accelerate's
data loader moves the batch to the device, so the ids are read on the host, without a sync.

Pauses: the Trainer has no hook before an evaluation or a save, but after a step's
``on_step_end`` (and an epoch's ``on_epoch_end``) its flow callback has decided whether one
follows (``control.should_evaluate``, ``should_save``, ``should_training_stop``). A second
callback, last in line, reads that decision and opens the rank's pause there; the next
``on_step_end`` (or ``on_train_end``, or ``train()`` raising) ends it: the end of the next
step, not its start, since under DDP the ranks that do not write a checkpoint wait for the
one that does in that step's backward (its all-reduce). The exporter then holds the rank running
through a long evaluation or checkpoint save up to its ``pause_limit_s``.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "ampscope.integrations.transformers needs transformers: "
        "pip install 'ampscope[transformers]'"
    ) from exc

from ampscope.integrations._batch import (
    BATCH_IDS_KEY,
    IdsAsList,
    carries_ids,
    check_key,
    note_ids,
    without_key,
)
from ampscope.integrations._pause import OpenPauses
from ampscope.integrations._swap import check_options, check_policy
from ampscope.integrations.accelerate import attacher_of, instrument_accelerator, renew
from ampscope.rank.config import WatchConfig
from ampscope.rank.frontends.base import TelemetryFrontEnd
from ampscope.rank.frontends.watch import GradWatch
from ampscope.reporter.schema import Policy

if TYPE_CHECKING:
    from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

logger = logging.getLogger("ampscope")


class AmpscopeTrainerCallback(TrainerCallback):
    """Attaches the scaler on ``on_train_begin``, logs it, closes it on ``on_train_end``
    (``train()`` raising closes it with the exception: :func:`instrument`'s wrap).

    Added by :func:`instrument`; not meant to be constructed by hand.
    """

    def __init__(self, trainer: Trainer, scaler: TelemetryFrontEnd) -> None:
        self.trainer = trainer
        self.scaler = scaler

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        attacher = attacher_of(self.trainer.accelerator)
        if attacher is not None:
            attacher.attach(self.scaler, self.trainer.model_wrapped)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        # Only the training logs (those with "loss"): evaluation and the final summary
        # are not about the scaler. This callback runs first, so report_to callbacks
        # (TensorBoard, W&B, MLflow...) see the added values; the history entry the
        # Trainer just appended gets them too. get_scale() reads the scale tensor: one
        # host-device sync per logging step on an accelerator.
        if logs is None or "loss" not in logs:
            return
        snapshot = self.scaler.telemetry.snapshot()
        values: dict[str, float]
        if isinstance(self.scaler, GradWatch):
            # No scale to log; whether inf/NaN updates were skipped or applied instead.
            values = {
                "skipped_steps": snapshot.skipped_steps,
                "nonfinite_applied": snapshot.nonfinite_applied,
            }
        else:
            values = {
                "loss_scale": self.scaler.get_scale(),  # type: ignore[attr-defined]
                "skipped_steps": snapshot.skipped_steps,
            }
        logs.update(values)
        if state.log_history and state.log_history[-1].get("loss") == logs["loss"]:
            state.log_history[-1].update(values)

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self.scaler.close()


class AmpscopePauseCallback(TrainerCallback):
    """Pauses the rank (``ampscope.paused``) while the Trainer evaluates, saves a
    checkpoint, or finishes training after its last step, until the next step ends.

    Added by :func:`instrument` last in line: ``on_step_end`` and ``on_epoch_end`` then see
    what the Trainer's flow callback decided (``control.should_evaluate``,
    ``should_save``, ``should_training_stop``), just before the Trainer acts on it.
    """

    def __init__(self) -> None:
        self.pauses = OpenPauses()

    def _pause_for(self, control: TrainerControl) -> None:
        # Opened in the reverse of the order the Trainer works in (evaluate, save, stop),
        # so the newest, the reason said, is the work under way; on_evaluate and on_save
        # hand over to the next.
        if control.should_training_stop:
            self.pauses.open("end-of-training")
        if control.should_save:
            self.pauses.open("checkpoint")
        if control.should_evaluate:
            self.pauses.open("eval")

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        # The step after a pause ended here: its collectives waited for every rank.
        self.pauses.end()
        self._pause_for(control)

    def on_epoch_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self._pause_for(control)

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self.pauses.done("eval")

    def on_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self.pauses.done("checkpoint")

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self.pauses.end()


def instrument(
    trainer: Trainer,
    *,
    track_origin: bool | None = None,
    policy: Policy = "observe",
    max_consecutive_skips: int | None = None,
    batch_ids_key: str | None = BATCH_IDS_KEY,
    **scaler_options: Any,
) -> TelemetryFrontEnd | None:
    """Make ``trainer`` train with ampscope's scaler, or with a ``GradWatch`` when it has
    none (``bf16=True``, fp32). Call after ``Trainer()``, before ``trainer.train()``.

    Replaces ``trainer.accelerator.scaler`` with ampscope's scaler of the same class
    (``GradScaler`` for DDP, FSDP2 and one device, ``ShardedGradScaler`` for FSDP1) and
    the same scaling settings, and adds a callback that attaches it to the wrapped model
    when training starts (origin tracking when the run is distributed), adds
    ``loss_scale`` and ``skipped_steps`` to every training log (so they reach whatever
    ``report_to`` sends to), pauses the rank (``ampscope.paused``: ``eval``,
    ``checkpoint``, ``end-of-training``) from the end of a step after which the Trainer
    evaluates, saves or stops, until the next step ends (or ``train()`` returns or raises),
    and closes the scaler when training ends, or when ``train()`` raises, with the
    exception: the rank ends ``failed`` with it, as a ``with`` block over the scaler would
    end it. A later ``train()`` (a retry) trains with a new scaler (the closed one's
    scaling state) or watch, found in ``trainer.accelerator.scaler``; with ``deepspeed=``
    the monitor is one per engine and a later ``train()`` records nothing. Calling it again returns
    the same scaler and changes nothing.

    Args:
        trainer: A ``transformers.Trainer`` (or subclass).
        track_origin: ``None`` (default): on when the process group has more than one
            rank; ``False`` turns it off.
        policy: The watch's policy in a bf16/fp32 run: ``"observe"`` (default),
            ``"skip"`` (the scheduler holds on skipped iterations) or ``"raise"``.
            A watch logs ``skipped_steps`` and ``nonfinite_applied`` (no loss scale).
        max_consecutive_skips: The watch's limit under ``skip`` (see
            :class:`ampscope.GradWatch`).
        batch_ids_key: The dataset column of each sample's id (default ``"sample_ids"``):
            a training batch that holds it has its ids noted for the iteration
            (``note_batch``), and the model never receives it; ``None``: no ids. Costs a
            dict lookup and a shallow copy of the batch per micro-batch that holds it.
        **scaler_options: Telemetry options of :class:`ampscope.GradScaler`
            (``run_id``, ``reporter``, ``sinks``, ``top_k``...). The scaling itself stays
            the Trainer's.

    Returns:
        The ampscope scaler or watch; with ``deepspeed=`` a
        :class:`~ampscope.integrations.deepspeed.DeepSpeedMonitor` that observes the
        engine ``train()`` builds (DeepSpeed decides the skips; ``policy`` does not
        apply; the logs get ``loss_scale`` and ``skipped_steps``); or ``None`` when the
        Trainer has neither a loss scaler nor a precision a watch applies to
        (``fp16=True`` on CPU): then nothing changes and a warning says so once.
    """
    check_options(scaler_options)
    watch = check_policy(policy, max_consecutive_skips)
    key = check_key(batch_ids_key)
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, AmpscopeTrainerCallback):
            return callback.scaler
    scaler = instrument_accelerator(
        trainer.accelerator, track_origin, scaler_options, "Hugging Face Trainer", watch
    )
    if scaler is not None:
        # First in line, so that the report_to callbacks log what on_log adds.
        ours = AmpscopeTrainerCallback(trainer, scaler)
        trainer.callback_handler.callbacks.insert(0, ours)
        # Last in line: it reads what the flow callback decided about this step.
        pauses = AmpscopePauseCallback()
        trainer.callback_handler.callbacks.append(pauses)
        trainer.train = _training(trainer.train, trainer, ours, pauses, (watch, scaler_options))
        if key is not None:
            _note_ids_in_steps(trainer, ours, key)
    return scaler


def _training(
    train: Callable[..., Any],
    trainer: Trainer,
    ours: AmpscopeTrainerCallback,
    pauses: AmpscopePauseCallback,
    renewal: tuple[WatchConfig, dict[str, Any]],
) -> Callable[..., Any]:
    """``train`` that ends as a ``with`` block over the front-end would: on an exception
    (the Trainer calls no ``on_train_end`` then, and the caller may catch it and go on) the
    front-end closes with it, so the rank ends ``failed`` with the exception, not running
    and then stalled. The pauses its callbacks opened end however it ends (the Trainer calls
    no callback when an evaluation or a save raises). A ``train()`` after the front-end
    closed (a retry, a second run) trains with a new one, built with ``renewal`` (the
    watch's policy and the telemetry options; :func:`~ampscope.integrations.accelerate.renew`)."""

    def training(*args: Any, **kwargs: Any) -> Any:
        fresh = renew(trainer.accelerator, *renewal)
        if fresh is not None:
            ours.scaler = fresh
        try:
            return train(*args, **kwargs)
        except BaseException as exc:
            pauses.pauses.end()
            ours.scaler.close_after(exc)
            raise
        finally:
            pauses.pauses.end()

    return training


def _note_ids_in_steps(trainer: Trainer, ours: AmpscopeTrainerCallback, key: str) -> None:
    """Note the ids of every training micro-batch that holds ``key``; keep the column
    through the Trainer's column removal and out of the model's inputs."""
    try:
        model_takes_it = key in inspect.signature(trainer.model.forward).parameters
    except (TypeError, ValueError):  # no signature to read: the model takes no such name
        model_takes_it = False
    # remove_unused_columns keeps the columns named in _signature_columns (the model's
    # forward parameters and the label names), read when the data loaders are built.
    # Private to transformers (tested with 5.23: the Trainer test with the default
    # remove_unused_columns=True fails if it changes); without it, say what to do.
    keep_columns = getattr(trainer, "_set_signature_columns_if_needed", None)
    columns = None
    if callable(keep_columns):
        keep_columns()
        columns = getattr(trainer, "_signature_columns", None)
    if isinstance(columns, list):
        if key not in columns:
            columns.append(key)
    elif trainer.args.remove_unused_columns:
        logger.warning(
            "ampscope: cannot keep the %r column through this transformers' "
            "remove_unused_columns; set remove_unused_columns=False to have its ids noted",
            key,
        )
    if callable(trainer.data_collator):
        trainer.data_collator = IdsAsList(trainer.data_collator, key)
    trainer.training_step = _stepping(trainer.training_step, ours, key, model_takes_it)
    trainer.prediction_step = _stepping(trainer.prediction_step, None, key, model_takes_it)


def _stepping(
    step: Callable[..., Any],
    ours: AmpscopeTrainerCallback | None,
    key: str,
    model_takes_it: bool,
) -> Callable[..., Any]:
    """``step(model, inputs, ...)`` that notes the ids of ``inputs`` for the front-end
    ``ours`` holds now (none when ``ours`` is ``None``) and hands on ``inputs`` without
    them unless the model's forward takes them."""

    def stepped(model: Any, inputs: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        if carries_ids(inputs, key):
            note_ids(None if ours is None else ours.scaler, inputs, key)
            if not model_takes_it:
                inputs = without_key(inputs, key)
        return step(model, inputs, *args, **kwargs)

    return stepped
