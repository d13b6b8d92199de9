"""The one mixin that turns torch's scalers into instrumented ones.

It overrides torch's hook points and calls torch for the work: ``_unscale_grads_``
(notes the optimizer, keeps this rank's pre-reduction found-inf where torch's differs, and
takes the gradient norms right after torch's kernel), ``update`` (captures the step's
scalars; see :mod:`ampscope.rank.capture.scaler`), ``scale`` (keeps the loss for the record's
stats) and ``_check_inf_per_device`` (marks a fused optimizer's check, which unscales
nothing). Whether each optimizer's step ran is counted by a public step pre-hook.
Numerics are torch's: nothing here writes to gradients, parameters or found-inf, except
the optional scale clamp, and the one unscale torch's own ``GradScaler`` would make as one
group (every gradient present, dense, on one device and dtype): there the mixin runs
torch's kernel on the gradients itself (:func:`~ampscope.rank.compat.unscale_one_group_`,
bit for bit torch's), without torch's walk over the parameters in Python, and hands the
same list of gradients to the norms.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain
from operator import is_
from typing import Any

import torch

from ampscope.rank import compat
from ampscope.rank.capture.registry import OptimizerInfo
from ampscope.rank.capture.scaler import StepCapture
from ampscope.rank.config import TelemetryConfig
from ampscope.rank.frontends.base import OWN_ATTRIBUTES, TelemetryFrontEnd, warn_if_torch_changed
from ampscope.rank.frontends.rerun import Closure
from ampscope.rank.gradients.attribution import count_nonfinite
from ampscope.rank.gradients.local_unscale import unscale_local_shards
from ampscope.rank.gradients.stats import sum_over


def _torch_unscale(scaler: TelemetryMixin) -> object:
    """The ``_unscale_grads_`` this mixin's overrides hand over to (the next class's)."""
    return getattr(super(TelemetryMixin, scaler)._unscale_grads_, "__func__", None)  # type: ignore[misc]


def _same_params(groups: list[dict[str, Any]], params: tuple[torch.Tensor, ...]) -> bool:
    """Whether the parameter groups hold exactly ``params``, in order (a check in C of each
    one's identity: no tensor comparison)."""
    listed = groups[0]["params"] if len(groups) == 1 else [*chain(*(g["params"] for g in groups))]
    return len(listed) == len(params) and all(map(is_, listed, params))


class TelemetryMixin(TelemetryFrontEnd):
    """Adds telemetry to a subclass of ``torch.amp.GradScaler``. See :mod:`ampscope.rank`."""

    _ampscope_capture: StepCapture | None
    _ampscope_reduces_found_inf_in_place = False
    """Whether torch changes the found-inf tensors ``_unscale_grads_`` returns before
    update() (FSDP1's sharded scaler all-reduces them in place): then capture copies them."""

    _ampscope_unscales_nothing = False
    """torch's ``_check_inf_per_device`` is running: it checks a fused optimizer's
    gradients with an inverse scale of 1, so their norms are still scaled."""

    def _ampscope_init(self, config: TelemetryConfig) -> None:
        """Called at the end of ``__init__``, after torch's constructor."""
        warn_if_torch_changed()
        enabled = self.is_enabled()  # type: ignore[attr-defined]
        # A disabled scaler is a pure pass-through: no reporter, no thread, no records.
        reduce = None
        if self._ampscope_reduces_found_inf_in_place:  # FSDP1: flat gradient shards
            reduce = sum_over(getattr(self, "process_group", None))
        self._ampscope_start(config, enabled, reduce)
        self._ampscope_capture = StepCapture() if enabled else None
        self._ampscope_lean_unscale = (
            type(self)._unscale_grads_ is TelemetryMixin._unscale_grads_
            and _torch_unscale(self) is compat.TORCH_UNSCALE
            and compat.unscale_unchanged()
        )
        """Whether the parent's ``_unscale_grads_`` is torch's own, which
        :meth:`_ampscope_one_group` may do without its walk over the parameters."""
        self._ampscope_named: dict[int, Mapping[str, int]] = {}
        """This iteration's non-finite counts taken at unscale, by optimizer id (host
        transport only): see :meth:`_ampscope_name_now`."""

    # -- public API ----------------------------------------------------------------------

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

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        *args: Any,
        rerun: Closure | None = None,
        rerun_rtol: float = 0.0,
        **kwargs: Any,
    ) -> Any:
        """As torch's ``step()``; with ``rerun``, a flagged iteration is rerun first.

        Without ``rerun`` nothing changes. With it (every rank must pass one, on every
        iteration), the gradients are unscaled here if the caller did not, and one
        all-reduce of a one-element flag and one host read agree whether any rank found
        inf/NaN or reached its spike threshold (its loss, or the gradient norm, against
        its own spike rule's current threshold, compared on the device). Clean iterations
        go on to torch's step. On a flagged one every rank calls
        ``rerun`` once, its gradients are unscaled and checked afresh, the step uses them
        (so a non-reproduced fault is stepped over, a reproduced one skipped as torch
        skips), and :attr:`last_rerun` says whether this rank's result was reproduced
        (see :mod:`ampscope.rank.frontends.rerun` and docs/bad-data-or-hardware.md).

        Args:
            optimizer: As torch's.
            rerun: Zeroes the gradients, recomputes this iteration's loss from the same
                batch through this scaler's ``scale()`` and runs backward; returns the loss.
                Never forwarded to the optimizer (torch's scaler forbids ``closure``).
            rerun_rtol: Relative tolerance of the comparison; 0 compares bit for bit.
        """
        parent: Any = super()
        self._ampscope_stepping()
        if rerun is not None:
            # ShardedGradScaler's own group (torch's process_group); GradScaler's: the default.
            group = getattr(self, "process_group", None)
            if self._ampscope_capture is None:
                self._ampscope_rerun_closed(rerun, group)
            else:
                checks = _ScalerChecks(self, optimizer)
                self._ampscope_rerun(
                    checks,
                    optimizer,
                    rerun,
                    rerun_rtol,
                    group,
                    compat.scale_tensor(self),  # type: ignore[arg-type]
                )
        return parent.step(optimizer, *args, **kwargs)

    # -- torch hook points ---------------------------------------------------------------

    def scale(self, outputs: Any) -> Any:
        """As torch's ``scale()``; also keeps the loss (detached, on its device) for the
        record's ``stats.loss``: no copy, no sync."""
        stats = self._ampscope_stats
        if stats is not None:
            try:
                stats.add_loss(outputs)
            except Exception:
                self._ampscope_failed()
        return super().scale(outputs)  # type: ignore[misc]

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> Any:
        parent: Any = super()
        self._ampscope_unscales_nothing = True
        try:
            return parent._check_inf_per_device(optimizer)
        finally:
            self._ampscope_unscales_nothing = False

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
            self._ampscope_pair_closed_norms(optimizer)
            return result
        # Inline guards on the per-step path: _ampscope_guard's frame and argument packing
        # cost more than the try itself.
        try:
            info = capture.unscaling(optimizer)
        except Exception:
            self._ampscope_failed()
            info = None
        grads = None
        if info is not None and info.dtensor:
            result, local = unscale_local_shards(
                parent._unscale_grads_, optimizer, inv_scale, found_inf, allow_fp16
            )
            self._ampscope_guard(capture.record_local, optimizer, local, fresh=True)
        else:
            one_group = self._ampscope_one_group(optimizer, info, allow_fp16)
            if one_group is not None:  # torch's work, without its walk over the parameters
                result = compat.unscale_one_group_(one_group[0], inv_scale, found_inf)
                grads = one_group[0] if one_group[1] else None
            else:
                result = parent._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
            if self._ampscope_reduces_found_inf_in_place:
                self._ampscope_guard(capture.record_local, optimizer, result, fresh=False)
            # Otherwise torch's found-inf is the local one: nothing to keep.
        if self._ampscope_config.attribution:
            self._ampscope_named.pop(id(optimizer), None)  # a rerun unscales afresh
            # Inline guard, as above: one flag read per optimizer on a clean CPU iteration.
            try:
                if capture.flags_on_host(result):
                    self._ampscope_name_now(optimizer, result)
            except Exception:
                self._ampscope_failed()
        stats = self._ampscope_stats
        if stats is not None:
            # After torch's kernel: the norms are of the unscaled gradients. Sharded
            # gradients all-reduce here, on every rank, clean step or not, and even when
            # the capture failed above (info None: this rank sums NaN).
            try:
                stats.add_grads(optimizer, info, self._ampscope_unscales_nothing, grads)
            except Exception:
                self._ampscope_failed()
        return result

    def _ampscope_one_group(
        self, optimizer: torch.optim.Optimizer, info: OptimizerInfo | None, allow_fp16: bool
    ) -> tuple[list[torch.Tensor], bool] | None:
        """The optimizer's gradients when torch's ``_unscale_grads_`` would unscale them as
        one (device, dtype) group with nothing to refuse: this scaler's unscale is torch's
        own (not FSDP1's), unpatched and known code (:func:`~ampscope.rank.compat.
        unscale_unchanged`), the parameters share one device and dtype (``info.place``)
        and every gradient is present, dense and of that dtype, the first and the last on
        that device; else ``None``: torch's unscale runs, raising what it raises (fp16
        gradients under ``unscale_()``). A gradient of another dtype (the model converted
        since) refreshes ``info``. Also whether the list is in the order of the norms'
        plan (its parameters are the optimizer's, one by one): then the norms take it."""
        if not self._ampscope_lean_unscale or info is None or not compat.torch_unscale_unpatched():
            return None
        place = info.place
        if place is None:
            return None
        device, dtype = place
        if dtype is torch.float16 and not allow_fp16:
            return None
        plan = info.norm_plan
        planned = plan is not None and _same_params(optimizer.param_groups, plan.params)
        if planned:
            grads = [p.grad for p in plan.params]
        else:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        for grad in grads:
            if grad is None or grad.is_sparse or grad.dtype is not dtype:
                if grad is not None and grad.dtype is not dtype:
                    info.refresh(optimizer)
                return None
        if not grads or grads[0].device != device or grads[-1].device != device:
            return None
        return grads, planned

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """As torch's ``update()``, then records the step. On the CPU it reads the scale and
        growth tracker (host memory: no copy, no sync). On accelerators, one small stack
        and its non-blocking copy to pinned memory; never a sync. The first call also
        resolves the run id, which may broadcast it from rank 0 (a collective every
        rank reaches in its first update())."""
        parent: Any = super()
        capture = self._ampscope_capture
        if capture is None:
            self._ampscope_named.clear()  # closed within the iteration
            parent.update(new_scale)
            self._ampscope_check_replicas()  # a closed rank keeps its part in the collective
            return
        try:
            # The identity first: its collective (first update()) is made by every rank,
            # whatever fails after it.
            identity = self._ampscope_identity_now()
            pending = capture.before_update(
                self,  # type: ignore[arg-type]
                identity,
                new_scale is not None,
                self._ampscope_attribute if self._ampscope_config.attribution else None,
            )
        except Exception:
            self._ampscope_failed()
            pending = None
        self._ampscope_named.clear()  # this iteration's, taken or not
        parent.update(new_scale)
        config = self._ampscope_config
        if new_scale is None and (config.min_scale is not None or config.max_scale is not None):
            scale = compat.scale_tensor(self)  # type: ignore[arg-type]
            if scale is not None:
                scale.clamp_(min=config.min_scale, max=config.max_scale)
        # After the optimizer step(s) and torch's update: the weights the next forward reads.
        replicas = self._ampscope_check_replicas()
        fp8 = self._ampscope_take_fp8()
        if fp8 is not None and pending is not None:
            pending.extra, pending.fp8 = fp8  # copied with the step's own values
        rerun, self._ampscope_rerun_pending = self._ampscope_rerun_pending, None
        if pending is not None:
            pending.rerun = rerun
            pending.replicas = replicas
        try:
            origin = self._ampscope_take_origin()
            pending = capture.after_update(
                self,  # type: ignore[arg-type]
                pending,
                origin,
                self._ampscope_take_stats(),
            )
            if pending is not None:
                self._ampscope_telemetry.submit(pending)
        except Exception:
            self._ampscope_failed()

    # -- internals -----------------------------------------------------------------------

    def _ampscope_attribute(self, optimizer: torch.optim.Optimizer) -> Mapping[str, int]:
        """Non-finite element counts of a skipped step's gradients, by parameter name:
        those taken at unscale where the flags were host memory, else counted now (on an
        accelerator: kept to the parameters whose norm was inf/NaN before any clip);
        empty when counting fails (counted and logged once, never raised)."""
        named = self._ampscope_named.pop(id(optimizer), None)
        if named is not None:
            return named
        counts = self._ampscope_guard(count_nonfinite, optimizer, self._ampscope_names)
        return {} if counts is None else self._ampscope_named_before_clip(counts)

    def _ampscope_name_now(
        self, optimizer: torch.optim.Optimizer, found_per_device: Mapping[Any, torch.Tensor]
    ) -> None:
        """Count the non-finite elements right after the unscale, where reading the flags
        costs no sync (host memory): a clip between ``unscale_()`` and ``step()`` multiplies
        every gradient by its coefficient, NaN when one gradient held a NaN, and a count at
        ``update()`` would then name every parameter. Clean iterations read one flag.
        A flag of 0 is kept too (nothing to name): under FSDP1 another rank's inf/NaN
        reaches this rank's flag only in the all-reduce after this unscale, and this rank's
        gradients were finite here."""
        found = any(flag.item() for flag in found_per_device.values())
        self._ampscope_named[id(optimizer)] = (
            count_nonfinite(optimizer, self._ampscope_names) if found else {}
        )

    def __getstate__(self) -> dict[str, Any]:
        parent: Any = super()
        state: dict[str, Any] = parent.__getstate__()
        for name in OWN_ATTRIBUTES:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        parent: Any = super()
        parent.__setstate__(state)
        # An unpickled copy keeps torch's behaviour and state but has telemetry off:
        # sinks, threads and hooks do not travel.
        self._ampscope_init(TelemetryConfig(reporter=None))
        self._ampscope_capture = None
        self._ampscope_stats = None


class _ScalerChecks:
    """A scaler's check of one optimizer's gradients is torch's unscale."""

    __slots__ = ("_optimizer", "_scaler")

    def __init__(self, scaler: Any, optimizer: torch.optim.Optimizer) -> None:
        self._scaler = scaler
        self._optimizer = optimizer

    def found(self) -> Mapping[torch.device, torch.Tensor]:
        scaler, optimizer = self._scaler, self._optimizer
        found = compat.unscaled_found_inf(scaler, optimizer)
        if found is None:
            scaler.unscale_(optimizer)
            found = compat.unscaled_found_inf(scaler, optimizer)
            assert found is not None
        return found

    def forget(self) -> None:
        compat.forget_unscale(self._scaler, self._optimizer)
