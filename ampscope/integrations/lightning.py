"""PyTorch Lightning: ``Trainer(callbacks=[AmpscopeCallback()])``.

Lightning keeps the loss scaler in its precision plugin: ``MixedPrecision.scaler``
(``"16-mixed"``: a ``torch.amp.GradScaler``) or ``FSDPPrecision.scaler`` (FSDP1,
a ``ShardedGradScaler``). The callback swaps it in ``setup`` (before the strategy wraps
the model and before a checkpoint restores the scaler's state), attaches in
``on_fit_start`` (``trainer.strategy.model`` is wrapped by then), logs through the
LightningModule like Lightning's ``LearningRateMonitor``, and closes in ``teardown``.

``FSDPPrecision("16-mixed", scaler=...)`` cannot take a scaler in Lightning 2.6 (its
constructor checks the precision before setting it, and drops the argument); setting the
plugin's ``scaler`` attribute afterwards, as this callback does, works.
"""

from __future__ import annotations

import logging
from typing import Any

try:
    import lightning.pytorch as pl
except ImportError as exc:  # pragma: no cover - exercised only without lightning
    raise ImportError(
        "ampscope.integrations.lightning needs lightning: pip install 'ampscope[lightning]'"
    ) from exc

from ampscope.integrations._swap import NO_SCALER, Attacher, check_options, twin
from ampscope.scaler.mixin import TelemetryMixin

logger = logging.getLogger("ampscope")


class AmpscopeCallback(pl.Callback):
    """Trains with ampscope's scaler in place of the precision plugin's; logs it.

    Logs ``loss_scale`` and ``skipped_steps`` on the steps Lightning writes logs
    (``log_every_n_steps``). Reading the scale is one host-device sync on an
    accelerator, so it happens only then.

    Args:
        track_origin: ``None`` (default): origin tracking on when the process group has
            more than one rank; ``False`` turns it off.
        log: Whether to log ``loss_scale`` and ``skipped_steps``.
        **scaler_options: Telemetry options of :class:`ampscope.GradScaler`
            (``run_id``, ``reporter``, ``sinks``, ``top_k``...). The scaling itself stays
            the plugin's.

    Attributes:
        scaler: The ampscope scaler once ``fit`` has set up; ``None`` before, and when
            the precision plugin has no scaler (then nothing changes and a warning says
            so once).
    """

    def __init__(
        self, *, track_origin: bool | None = None, log: bool = True, **scaler_options: Any
    ) -> None:
        check_options(scaler_options)
        self.scaler: TelemetryMixin | None = None
        self._options = scaler_options
        self._log = log
        self._attacher = Attacher(track_origin)
        self._warned = False
        self._active = True

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        plugin = trainer.precision_plugin
        stock = getattr(plugin, "scaler", None)
        if isinstance(stock, TelemetryMixin) and stock is not self.scaler:
            # Another AmpscopeCallback swapped it: that one attaches, logs and closes.
            self.scaler, self._active = stock, False
            return
        ours = twin(stock, self._options) if stock is not None else None
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

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.scaler is not None and self._active:
            self._attacher.attach(self.scaler, trainer.strategy.model)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        # As LearningRateMonitor: compute only on the steps the loggers write.
        if self.scaler is None or not self._log or not self._active:
            return
        if not trainer._logger_connector.should_update_logs:
            return
        pl_module.log_dict(
            {
                "loss_scale": self.scaler.get_scale(),  # type: ignore[attr-defined]
                "skipped_steps": float(self.scaler.telemetry.snapshot().skipped_steps),
            },
            on_step=True,
            on_epoch=False,
        )

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.scaler is not None and self._active:
            self.scaler.close()
