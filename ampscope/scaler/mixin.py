"""The one mixin that turns torch's scalers into instrumented ones.

It overrides two hook points and calls torch for all the work: ``_unscale_grads_``
(notes the optimizer and keeps this rank's pre-reduction found-inf where torch's
differs) and ``update`` (captures the step's scalars; see :mod:`ampscope.scaler.capture`).
Whether each optimizer's step ran is counted by a public step pre-hook. Numerics are
torch's: nothing here writes to gradients, parameters or found-inf, except the optional
scale clamp.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from ampscope.reporter.schema import Identity
from ampscope.scaler import compat
from ampscope.scaler.attribution import count_nonfinite
from ampscope.scaler.capture import StepCapture
from ampscope.scaler.config import TelemetryConfig
from ampscope.scaler.identity import resolve_identity
from ampscope.scaler.local_unscale import unscale_local_shards
from ampscope.scaler.names import ParamNames
from ampscope.scaler.outputs import build_sinks
from ampscope.scaler.telemetry import Telemetry

logger = logging.getLogger("ampscope")

_NO_FLAGS: Mapping[str, torch.Tensor] = MappingProxyType({})

# Attributes this mixin adds; dropped when the scaler is pickled (threads, hooks, sinks).
_OWN_ATTRIBUTES = (
    "_ampscope_config",
    "_ampscope_telemetry",
    "_ampscope_capture",
    "_ampscope_names",
    "_ampscope_identity",
    "_ampscope_origin",
    "_ampscope_origin_handles",
    "_ampscope_errors",
)


def _warn_if_torch_changed() -> None:
    problems = compat.check_torch()
    if problems:
        warnings.warn(
            "ampscope: this torch differs from what the instrumented scalers expect; "
            "telemetry may be wrong: " + "; ".join(problems),
            RuntimeWarning,
            stacklevel=3,
        )


class TelemetryMixin:
    """Adds telemetry to a subclass of ``torch.amp.GradScaler``. See :mod:`ampscope.scaler`."""

    _ampscope_config: TelemetryConfig
    _ampscope_telemetry: Telemetry
    _ampscope_capture: StepCapture | None
    _ampscope_names: ParamNames
    _ampscope_identity: Identity | None
    _ampscope_origin: Any
    _ampscope_origin_handles: list[Any]
    _ampscope_errors: int
    _ampscope_reduces_found_inf_in_place = False
    """Whether torch changes the found-inf tensors ``_unscale_grads_`` returns before
    update() (FSDP1's sharded scaler all-reduces them in place): then capture copies them."""

    def _ampscope_init(self, config: TelemetryConfig) -> None:
        """Called at the end of ``__init__``, after torch's constructor."""
        _warn_if_torch_changed()
        enabled = self.is_enabled()  # type: ignore[attr-defined]
        self._ampscope_config = config
        # A disabled scaler is a pure pass-through: no reporter, no thread, no records.
        self._ampscope_telemetry = Telemetry(
            sinks=build_sinks(config) if enabled else (),
            history=config.history,
            top_k=config.top_k,
        )
        self._ampscope_capture = StepCapture() if enabled else None
        self._ampscope_names = ParamNames()
        self._ampscope_identity = None
        self._ampscope_origin = None
        self._ampscope_origin_handles = []
        self._ampscope_errors = 0
        # Collected without close(): flush and stop the threads off the collecting thread.
        # The callback holds the telemetry only, never the scaler.
        finalizer = weakref.finalize(self, self._ampscope_telemetry.close_soon)
        finalizer.atexit = False  # interpreter exit is the telemetry module's job

    # -- public API ----------------------------------------------------------------------

    @property
    def telemetry(self) -> Telemetry:
        """This scaler's telemetry: ``snapshot()``, ``history(n)``."""
        return self._ampscope_telemetry

    @property
    def last_step_skipped(self) -> bool:
        """Whether the newest iteration skipped its optimizer step for inf/NaN gradients.

        After ``update()``: the iteration it closed; between ``step()`` and ``update()``:
        the current one. Free for ordinary optimizers (torch's ``step()`` already read
        found-inf on the host) and on CPU. For fused optimizers on an accelerator it reads
        the device flag, i.e. one host-device sync. ``False`` when disabled.
        """
        capture = self._ampscope_capture
        return False if capture is None else capture.last_step_skipped(self)  # type: ignore[arg-type]

    def attach(self, model: nn.Module, track_origin: bool = False) -> None:
        """Name ``model``'s parameters in records; optionally track found-inf origin.

        Call once, after wrapping the model (FSDP1, ``fully_shard``, DDP) and before the
        first backward. Costs one walk over ``named_parameters()``.

        Args:
            model: The wrapped model whose parameters the optimizer(s) hold.
            track_origin: Install origin hooks on the model's gradient collectives, so
                records say which rank's own gradients overflowed before the reduction
                (``found_inf_origin``). Costs one read-only pass per gradient bucket.

        Raises:
            TypeError, ValueError: from ``install_origin_hooks`` when the model runs no
                supported gradient collective.
        """
        self._ampscope_names.attach(model)
        if track_origin and self._ampscope_capture is not None:
            from ampscope.scaler.origin import OriginFlags, install_origin_hooks

            if self._ampscope_origin is None:
                self._ampscope_origin = OriginFlags()
            self._ampscope_origin_handles.append(install_origin_hooks(model, self._ampscope_origin))

    def close(self, timeout: float = 1.0) -> None:
        """Flush pending records, close the sinks and remove hooks. Idempotent.

        The reporter then sends its final record: the exporter shows the rank as
        ``finished`` and no alert fires for it. The scaler keeps working as torch's
        afterwards, without telemetry. Also runs at interpreter exit, and on a background
        thread when the scaler is garbage collected without it. Waits at most about
        ``timeout`` seconds (default 1), even with the exporter down.
        """
        capture, self._ampscope_capture = self._ampscope_capture, None
        if capture is not None:
            capture.close()
        for handle in self._ampscope_origin_handles:
            handle.remove()
        self._ampscope_origin_handles = []
        self._ampscope_telemetry.close(timeout)

    # -- torch hook points ---------------------------------------------------------------

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool = True,
    ) -> dict[torch.device, torch.Tensor]:
        parent: Any = super()
        capture = self._ampscope_capture
        if capture is None:
            result: dict[torch.device, torch.Tensor] = parent._unscale_grads_(
                optimizer, inv_scale, found_inf, allow_fp16
            )
            return result
        # Inline guards on the per-step path: _ampscope_guard's frame and argument packing
        # cost more than the try itself.
        try:
            dtensor = capture.unscaling(optimizer)
        except Exception:
            self._ampscope_failed()
            dtensor = False
        if dtensor:
            result, local = unscale_local_shards(
                parent._unscale_grads_, optimizer, inv_scale, found_inf, allow_fp16
            )
            self._ampscope_guard(capture.record_local, optimizer, local, fresh=True)
            return result
        result = parent._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if self._ampscope_reduces_found_inf_in_place:
            self._ampscope_guard(capture.record_local, optimizer, result, fresh=False)
        # Otherwise torch's found-inf is the local one: nothing to keep.
        return result

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """As torch's ``update()``, then records the step. On the CPU it reads the scale and
        growth tracker (host memory: no copy, no sync). On accelerators, one small stack
        and its non-blocking copy to pinned memory; never a sync. The first call also
        resolves the run id, which may broadcast it from rank 0 (a collective every
        rank reaches in its first update())."""
        parent: Any = super()
        capture = self._ampscope_capture
        if capture is None:
            parent.update(new_scale)
            return
        try:
            identity = self._ampscope_identity
            if identity is None:
                identity = self._ampscope_identity = self._ampscope_resolve_identity()
            pending = capture.before_update(
                self,  # type: ignore[arg-type]
                identity,
                new_scale is not None,
                self._ampscope_attribute if self._ampscope_config.attribution else None,
            )
        except Exception:
            self._ampscope_failed()
            pending = None
        parent.update(new_scale)
        config = self._ampscope_config
        if new_scale is None and (config.min_scale is not None or config.max_scale is not None):
            scale = compat.scale_tensor(self)  # type: ignore[arg-type]
            if scale is not None:
                scale.clamp_(min=config.min_scale, max=config.max_scale)
        try:
            origin = self._ampscope_origin
            pending = capture.after_update(
                self,  # type: ignore[arg-type]
                pending,
                _NO_FLAGS if origin is None else origin.take(),
            )
            if pending is not None:
                self._ampscope_telemetry.submit(pending)
        except Exception:
            self._ampscope_failed()

    # -- internals -----------------------------------------------------------------------

    def _ampscope_attribute(self, optimizer: torch.optim.Optimizer) -> Mapping[str, int]:
        """Non-finite element counts of a skipped step's gradients, by parameter name;
        empty when counting fails (counted and logged once, never raised)."""
        counts = self._ampscope_guard(count_nonfinite, optimizer, self._ampscope_names)
        return counts if counts is not None else {}

    def _ampscope_resolve_identity(self) -> Identity:
        # Attempted exactly once per scaler: a retry on a later update() could pair this
        # rank's broadcast with a different collective on the other ranks.
        try:
            return resolve_identity(self._ampscope_config.run_id)
        except Exception:
            logger.warning(
                "ampscope: could not agree on a run id with the other ranks; using a local one",
                exc_info=True,
            )
            return resolve_identity(self._ampscope_config.run_id, collective=False)

    def _ampscope_guard(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run telemetry work; an exception is counted and logged once, never raised."""
        try:
            return fn(*args, **kwargs)
        except Exception:
            self._ampscope_failed()
            return None

    def _ampscope_failed(self) -> None:
        """Count the exception being handled; log it the first time. Call in ``except``."""
        self._ampscope_errors += 1
        if self._ampscope_errors == 1:
            logger.warning(
                "ampscope: telemetry error, training continues (logged once)", exc_info=True
            )

    def __getstate__(self) -> dict[str, Any]:
        parent: Any = super()
        state: dict[str, Any] = parent.__getstate__()
        for name in _OWN_ATTRIBUTES:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        parent: Any = super()
        parent.__setstate__(state)
        # An unpickled copy keeps torch's behaviour and state but has telemetry off:
        # sinks, threads and hooks do not travel.
        self._ampscope_init(TelemetryConfig(reporter=None))
        self._ampscope_capture = None
