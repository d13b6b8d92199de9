"""PyTorch Lightning: ``Trainer(callbacks=[AmpscopeCallback()])``.

Lightning keeps the loss scaler in its precision plugin: ``MixedPrecision.scaler``
(``"16-mixed"``: a ``torch.amp.GradScaler``) or ``FSDPPrecision.scaler`` (FSDP1,
a ``ShardedGradScaler``). The callback swaps it in ``setup`` (before the strategy wraps
the model and before a checkpoint restores the scaler's state), attaches in
``on_fit_start`` (``trainer.strategy.model`` is wrapped by then), logs through the
LightningModule like Lightning's ``LearningRateMonitor``, and closes in ``teardown``, or,
when ``fit`` raises (Lightning then skips ``teardown``), in ``on_exception``, which ends
the rank ``failed`` with the exception as a ``with`` block over the front-end would. A
later ``fit`` of the same trainer (a retry) trains with a new front-end.

With ``precision="bf16-mixed"`` the ``MixedPrecision`` plugin has no scaler (nor has
``FSDPPrecision`` outside fp16); the callback gives it a :class:`~ampscope.GradWatch`, and
the plugin then runs its scaler code path:
``scale()`` before backward, ``unscale_()`` before clipping, ``step()`` and ``update()``.
Lightning steps LR schedulers whether or not the optimizer stepped; under ``policy="skip"``
the callback holds the step-interval schedulers on a skipped iteration by wrapping the
LightningModule's ``lr_scheduler_step`` hook for the length of ``fit``.

``FSDPPrecision("16-mixed", scaler=...)`` cannot take a scaler in Lightning 2.6 (its
constructor checks the precision before setting it, and drops the argument); setting the
plugin's ``scaler`` attribute afterwards, as this callback does, works.

Clipping by norm (``gradient_clip_algorithm="norm"``, the default) goes through the
front-end's ``clip_grad_norm_`` for the length of ``fit``: the same clip, bit for bit,
whose one pass over the gradients also gives the records' gradient norms.

Batch ids: ``on_train_batch_start`` sees each training batch (each micro-batch under
``accumulate_grad_batches``) and notes the ids of one that is a mapping holding
``batch_ids_key``. Lightning has moved the batch to the device by then (no public hook sees
it before on the trainer's side), so ids collated as a list are read as they are, and a
tensor of ids on an accelerator is counted as left out rather than read with a sync. The
batch is not changed: ``training_step`` receives it whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

try:
    import lightning.pytorch as pl
except ImportError as exc:  # pragma: no cover - exercised only without lightning
    raise ImportError(
        "ampscope.integrations.lightning needs lightning: pip install 'ampscope[lightning]'"
    ) from exc

from ampscope.integrations._batch import BATCH_IDS_KEY, check_key, note_ids
from ampscope.integrations._pause import OpenPauses
from ampscope.integrations._swap import (
    NO_SCALER,
    WATCHING,
    Attacher,
    check_options,
    check_policy,
    make_watch,
    twin,
    warn_if_sinks_reused,
)
from ampscope.rank.frontends.base import TelemetryFrontEnd
from ampscope.rank.frontends.watch import GradWatch
from ampscope.reporter import stop_signal
from ampscope.reporter.schema import Policy

_HOOK = "lr_scheduler_step"

logger = logging.getLogger("ampscope")


class AmpscopeCallback(pl.Callback):
    """Trains with ampscope's scaler in place of the precision plugin's, or with a
    ``GradWatch`` under ``precision="bf16-mixed"``; logs it.

    Logs ``loss_scale`` and ``skipped_steps`` (a watch: ``skipped_steps`` and
    ``nonfinite_applied``) on the steps Lightning writes logs (``log_every_n_steps``).
    Reading them waits for the telemetry (and the scale is one host-device sync) on an
    accelerator, so it happens only then.

    Args:
        track_origin: ``None`` (default): origin tracking on when the process group has
            more than one rank; ``False`` turns it off.
        policy: The watch's policy under ``bf16-mixed``: ``"observe"`` (default),
            ``"skip"`` (step-interval LR schedulers hold on skipped iterations) or
            ``"raise"``.
        max_consecutive_skips: The watch's limit under ``skip`` (see
            :class:`ampscope.GradWatch`).
        log: Whether to log.
        batch_ids_key: The key of each training batch's sample ids (default
            ``"sample_ids"``): a batch that is a mapping holding it has its ids noted for
            the iteration (``note_batch``); ``None``: no ids. Costs a dict lookup per batch.
        **scaler_options: Telemetry options of :class:`ampscope.GradScaler`
            (``run_id``, ``reporter``, ``sinks``, ``top_k``...). The scaling itself stays
            the plugin's.

    Attributes:
        scaler: The ampscope scaler or watch once ``fit`` has set up; ``None`` before,
            and when the precision plugin has neither a scaler nor bf16-mixed (then
            nothing changes and a warning says so once).
    """

    def __init__(
        self,
        *,
        track_origin: bool | None = None,
        policy: Policy = "observe",
        max_consecutive_skips: int | None = None,
        log: bool = True,
        batch_ids_key: str | None = BATCH_IDS_KEY,
        **scaler_options: Any,
    ) -> None:
        check_options(scaler_options)
        self._key = check_key(batch_ids_key)
        self._watch = check_policy(policy, max_consecutive_skips)
        self.scaler: TelemetryFrontEnd | None = None
        self._options = scaler_options
        self._log = log
        self._attacher = Attacher(track_origin)
        self._warned = False
        self._active = True
        self._pauses = OpenPauses()
        self._save_wrap: tuple[Callable[..., Any], Any] | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # Lightning installs its SIGTERM handler after this, chaining ampscope's, and ends
        # the run itself (its SIGTERMException at the batch's end): ampscope's says goodbye
        # and leaves that end to it.
        stop_signal.leave_end_to_wrapper()
        plugin = trainer.precision_plugin
        stock = getattr(plugin, "scaler", None)
        if isinstance(stock, TelemetryFrontEnd) and stock is not self.scaler:
            # Another AmpscopeCallback swapped it: that one attaches, logs and closes.
            self.scaler, self._active = stock, False
            return
        if isinstance(stock, TelemetryFrontEnd) and stock.telemetry.closed:
            # This trainer's fit again (a retry after an exception, or more epochs): ours,
            # closed when the last fit ended or raised. The new fit gets a new front-end (a
            # scaler is twinned anew below, state and all; a watch is built anew), attached
            # anew: its records make the rank running again on the exporter.
            self._attacher = Attacher(self._attacher.track_origin)
            warn_if_sinks_reused(self._options, "Lightning's fit")
            if isinstance(stock, GradWatch):
                stock = None
        ours: TelemetryFrontEnd | None = twin(stock, self._options) if stock is not None else None
        if ours is None and stock is None and _watchable(plugin):
            why = f"{type(plugin).__name__}(precision={plugin.precision!r})"
            logger.info(WATCHING.format(library="Lightning", why=why, policy=self._watch.policy))
            ours = make_watch(self._watch, self._options)
        if ours is None:
            if not self._warned:
                self._warned = True
                why = f"{type(plugin).__name__}(precision={plugin.precision!r})"
                if stock is not None:
                    why += f" holds a {type(stock).__qualname__}"
                logger.warning(
                    NO_SCALER.format(library="Lightning", why=why, cpu_fallback="bf16-mixed")
                )
            return
        plugin.scaler = ours
        self.scaler, self._active = ours, True
        _clip_through(plugin, ours)
        self._pause_on_saves(trainer)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.scaler is not None and self._active:
            self._attacher.attach(self.scaler, trainer.strategy.model)
            if isinstance(self.scaler, GradWatch) and self.scaler.policy == "skip":
                _hold_schedulers_on_skips(trainer, pl_module, self.scaler)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._active:
            note_ids(self.scaler, batch, self._key)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Ended at the end of the next training batch, not at on_validation_end:
        # ModelCheckpoint (which Lightning runs after every other callback) saves in its own
        # on_validation_end; and under DDP the ranks that do not write the checkpoint wait
        # for the one that does in that batch's backward (its all-reduce).
        # Only within fit (its sanity check too): a trainer.validate() of its own steps never.
        if trainer.state.fn == "fit":
            self._pauses.open("eval")

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Called as the checkpoint's state is gathered, before the strategy writes it. Only
        # while fit runs: a trainer.save_checkpoint() after fit has no next batch to end it.
        if trainer.state.fn == "fit" and trainer.state.status == "running":
            self._pauses.open("checkpoint")

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._pauses.end()
        # As LearningRateMonitor: compute only on the steps the loggers write.
        if self.scaler is None or not self._log or not self._active:
            return
        if not trainer._logger_connector.should_update_logs:
            return
        snapshot = self.scaler.telemetry.snapshot()
        if isinstance(self.scaler, GradWatch):
            values = {
                "skipped_steps": float(snapshot.skipped_steps),
                "nonfinite_applied": float(snapshot.nonfinite_applied),
            }
        else:
            values = {
                "loss_scale": self.scaler.get_scale(),  # type: ignore[attr-defined]
                "skipped_steps": float(snapshot.skipped_steps),
            }
        pl_module.log_dict(values, on_step=True, on_epoch=False)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # Lightning skips teardown when fit raises, and the caller may catch the exception
        # and go on (a retry, a sweep, a notebook): end the pauses and the fit here, so that
        # the rank ends failed with the exception rather than reading running, then
        # stalled. Lightning's graceful SIGTERM stop (its SIGTERMException, a SystemExit
        # without a status) is a normal end: the rank reads stopped, as the handler said.
        # KeyboardInterrupt fails the rank, as in a `with` block (Lightning then exits 1).
        self._pauses.end()
        if trainer.state.fn == "fit":
            self._end_fit(trainer, pl_module, exception)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._pauses.end()
        if stage == "fit":
            self._end_fit(trainer, pl_module, None)

    def _end_fit(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException | None
    ) -> None:
        """Undo this fit's wraps and close the front-end: the rank ends finished, or
        failed on ``exception`` (:meth:`~ampscope.reporter.failure.ClosedByWith.close_after`).
        Once per fit: a later hook finds the front-end closed."""
        self._unwrap_saves(trainer)
        if self.scaler is None or not self._active or self.scaler.telemetry.closed:
            return
        if _HOOK in vars(pl_module):
            delattr(pl_module, _HOOK)  # the class's hook again
        plugin = trainer.precision_plugin
        if _CLIP in vars(plugin):
            delattr(plugin, _CLIP)  # the class's clip again
        self.scaler.close_after(exception)

    def _pause_on_saves(self, trainer: pl.Trainer) -> None:
        """Pause for every checkpoint saved while this callback's fit runs: ``ModelCheckpoint``
        and a user's ``trainer.save_checkpoint()`` in a hook both go through the trainer's
        ``save_checkpoint``, the weights-only saves too, which call no callback's
        ``on_save_checkpoint``. From before the state's gather (a sharded gather under FSDP)
        to the end of the next training batch, as the callback's other pauses. The wrap is
        this fit's: undone at its end, and inert once its front-end closed (should a user's
        own wrap, installed over it, keep it in place)."""
        save = trainer.save_checkpoint
        front = self.scaler

        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            live = front is not None and not front.telemetry.closed
            if live and trainer.state.fn == "fit" and trainer.state.status == "running":
                self._pauses.open("checkpoint")
            return save(*args, **kwargs)

        # What to put back: the trainer's own attribute, where someone set one, else the
        # class's; the wrap is told by identity (a user's functools.wraps copies attributes).
        self._save_wrap = (save_checkpoint, vars(trainer).get(_SAVE))
        setattr(trainer, _SAVE, save_checkpoint)

    def _unwrap_saves(self, trainer: pl.Trainer) -> None:
        """Undo ``_pause_on_saves``; a wrap installed over it since is left in place."""
        wrap, self._save_wrap = self._save_wrap, None
        if wrap is None or vars(trainer).get(_SAVE) is not wrap[0]:
            return
        if wrap[1] is None:
            delattr(trainer, _SAVE)
        else:
            setattr(trainer, _SAVE, wrap[1])


_CLIP = "clip_grad_by_norm"
_SAVE = "save_checkpoint"


def _clip_through(plugin: Any, front: TelemetryFrontEnd) -> None:
    """Route ``gradient_clip_algorithm="norm"`` through the front-end's
    ``clip_grad_norm_`` (torch's clip bit for bit, whose pass also gives the records'
    gradient norms), for this fit only: where the plugin clips as Lightning's base
    precision plugin does (``clip_grad_norm_`` over ``main_params``). FSDP1 clips through
    the model's own method and keeps it."""
    from lightning.pytorch.plugins.precision import Precision

    if getattr(type(plugin), _CLIP, None) is not Precision.clip_grad_by_norm:
        return

    def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
        front.clip_grad_norm_(plugin.main_params(optimizer), clip_val)

    setattr(plugin, _CLIP, clip_grad_by_norm)


def _watchable(plugin: Any) -> bool:
    """A plugin that runs a scaler's ``scale``/``unscale_``/``step``/``update`` once it
    holds one, training without one: ``MixedPrecision`` in bf16, ``FSDPPrecision``
    (FSDP1) in anything but fp16."""
    from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision

    if isinstance(plugin, MixedPrecision):
        return plugin.precision == "bf16-mixed"
    return isinstance(plugin, FSDPPrecision) and plugin.precision != "16-mixed"


def _hold_schedulers_on_skips(
    trainer: pl.Trainer, pl_module: pl.LightningModule, watch: GradWatch
) -> None:
    """Wrap ``pl_module.lr_scheduler_step`` (for this fit only) so that a step-interval
    scheduler does not step after an iteration the watch skipped, as the Trainer and
    Accelerate hold theirs; epoch-interval schedulers and the hook itself are unchanged."""
    per_step = {id(c.scheduler) for c in trainer.lr_scheduler_configs if c.interval == "step"}
    if not per_step:
        return
    hook = getattr(pl_module, _HOOK)

    def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
        if id(scheduler) in per_step and watch.last_step_skipped:
            return
        hook(scheduler, metric)

    # An instance attribute, not a submodule or parameter: nn.Module stores it plainly.
    object.__setattr__(pl_module, _HOOK, lr_scheduler_step)
