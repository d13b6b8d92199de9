"""``ampscope.GradWatch``: the scalers' telemetry for bf16 and fp32 runs, with a policy.

A loop written for ``GradScaler`` runs on bf16 or fp32 by swapping the object::

    watch = ampscope.GradWatch(policy="skip")      # "observe" (default) | "skip" | "raise"
    watch.attach(model, track_origin=True)
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(batch)
        watch.scale(loss).backward()               # the loss itself: nothing is multiplied
        watch.unscale_(optimizer)                  # optional: checks now (e.g. before clipping)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        watch.step(optimizer)                      # steps, unless the policy says otherwise
        watch.update()                             # one record per iteration
        if not watch.last_step_skipped:
            lr_scheduler.step()

Costs per iteration (see ``bench/watch_single.py``): one fused non-finite check per
optimizer (torch's unscale kernel with an inverse scale of 1; one pass over gradient
memory); on the CPU with ``stats`` on, none on a clean iteration, which the gradient
norms, one read of gradient memory, decide alone. ``observe`` adds no host-device sync
and no collective. ``skip`` and ``raise`` add one all-reduce of a one-element tensor
per optimizer, on the process group, and one ``.item()`` to decide (none for fused
optimizers under ``skip``, which take the flag as ``found_inf`` and skip on the device).
``step(optimizer, rerun=closure)`` reruns a flagged iteration
(:mod:`ampscope.rank.frontends.rerun`, shared with the scalers): one all-reduce of a
one-element flag and one ``.item()`` per optimizer, which under ``skip``/``raise`` stand in
for the policy's on a clean iteration.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ampscope.rank.capture.registry import OptimizerInfo
from ampscope.rank.capture.watch import Checked, WatchCapture, agree
from ampscope.rank.config import TelemetryConfig, WatchConfig, WatchOptions, telemetry_config
from ampscope.rank.frontends import stop
from ampscope.rank.frontends.base import OWN_ATTRIBUTES, TelemetryFrontEnd, warn_if_torch_changed
from ampscope.rank.frontends.rerun import Closure
from ampscope.rank.frontends.stop import NonFiniteGradientsError
from ampscope.rank.gradients.attribution import count_nonfinite
from ampscope.rank.gradients.nonfinite import FoundInf, check_local
from ampscope.reporter import failure
from ampscope.reporter.schema import Policy

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["GradWatch", "NonFiniteGradientsError"]

RAISE_FLUSH_TIMEOUT_S = 2.0
"""How long a raising ``step()`` waits at most for the sinks to take the last record."""


class GradWatch(TelemetryFrontEnd):
    """Finds inf/NaN gradients in bf16/fp32 runs; observes, skips or stops. No scale.

    Speaks the scaler protocol: ``scale``, ``unscale_``, ``step``, ``update``,
    ``get_scale()`` (1.0), ``is_enabled``, ``state_dict``/``load_state_dict``,
    ``telemetry``, ``last_step_skipped``, ``attach``, ``close``. Every ``update()`` sends
    one record, built on a background thread, as the scalers do.

    Args:
        policy: ``"observe"``: record, change nothing: training is bit-identical to the
            loop without the watch (finite and infinite values; a NaN in a bf16/fp16
            gradient may come back as another NaN bit pattern). ``"skip"``: when any
            rank's gradients hold inf/NaN, every rank skips that iteration's
            ``optimizer.step()``. ``"raise"``: every rank raises
            :class:`NonFiniteGradientsError` from ``step()``.
        max_consecutive_skips: Under ``skip``: raise from the N-th consecutive skipped
            iteration's ``step()`` instead (its step is not taken).
        process_group: The ranks that agree under ``skip``/``raise`` (the gradients'
            data-parallel group); ``None``: the default group.
        enabled: ``False``: a pass-through (``step()`` steps, no checks, no records).
        **telemetry: The scalers' telemetry options but the scale clamps
            (:class:`~ampscope.rank.config.TelemetryConfig`,
            :class:`~ampscope.rank.config.WatchOptions`).
    """

    _ampscope_capture: WatchCapture | None

    def __init__(
        self,
        policy: Policy = "observe",
        *,
        max_consecutive_skips: int | None = None,
        process_group: dist.ProcessGroup | None = None,
        enabled: bool = True,
        **telemetry: Unpack[WatchOptions],
    ) -> None:
        self._watch = WatchConfig(
            policy=policy,
            max_consecutive_skips=max_consecutive_skips,
            process_group=process_group,
        )
        config = telemetry_config("GradWatch.__init__", telemetry, scale=False)
        warn_if_torch_changed()
        self._enabled = enabled
        self._consecutive_skips = 0
        self._closed_updates = 0
        self._closed_checked: dict[int, torch.Tensor | None] = {}
        """A closed watch's optimizers whose check ``unscale_()`` stood in for, this
        iteration: the policy's agreement made there (``None``: none was due)."""
        """update() calls since close(): a closed watch's raise names the ranks' step."""
        self._rerun_armed = False
        """A step() took a rerun closure: from then on the rerun's agreement replaces the
        policy's on clean iterations, so unscale_() leaves it to step()."""
        self._ampscope_start(config, enabled)
        self._ampscope_capture = WatchCapture(policy) if enabled else None

    # -- the scaler protocol -------------------------------------------------------------

    @property
    def policy(self) -> Policy:
        return self._watch.policy

    @property
    def max_consecutive_skips(self) -> int | None:
        return self._watch.max_consecutive_skips

    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        """Always 1.0: a watch scales nothing."""
        return 1.0

    def scale(self, outputs: Any) -> Any:
        """``outputs`` unchanged (a tensor or an iterable of them): no multiplication, no
        copy, no kernel. Exists so that a scaler loop runs as it is; keeps a one-element
        loss (detached) for the record's ``stats.loss``."""
        stats = self._ampscope_stats
        if stats is not None and self._ampscope_capture is not None:
            try:
                stats.add_loss(outputs)
            except Exception:
                self._ampscope_failed()
        return outputs

    def checked(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s gradients were checked since the last ``update()``
        (``unscale_()`` or ``step()``); ``False`` once the watch is closed."""
        capture = self._ampscope_capture
        return capture is not None and id(optimizer) in capture.iteration

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Check ``optimizer``'s gradients now, e.g. before clipping (nothing is scaled).

        Optional: ``step()`` checks if this was not called. Cost: one fused kernel per
        (device, dtype) group; under ``skip``/``raise`` also one all-reduce of a
        one-element tensor (once a ``step()`` took ``rerun=``, that agreement is left to
        ``step()``, where the rerun's replaces it). No sync.

        Raises:
            RuntimeError: called twice for ``optimizer`` since the last ``update()``, or
                after its ``step()``.
        """
        capture = self._ampscope_capture
        if capture is None:
            if self._ampscope_closed and id(optimizer) not in self._closed_checked:
                # Where the open ranks check: the norm's all-reduces (sharded gradients)
                # and, under skip/raise, the policy's agreement, in the same order.
                self._ampscope_pair_closed_norms(optimizer)
                due = self._watch.policy != "observe" and not self._rerun_armed
                self._closed_checked[id(optimizer)] = (
                    agree({}, self._watch.process_group, self._ampscope_failed) if due else None
                )
            return
        entry = capture.iteration.get(id(optimizer))
        if entry is not None:
            if entry.stepped:
                raise RuntimeError("unscale_() is being called after step().")
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        self._check(capture, optimizer, agree_now=not self._rerun_armed)

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        *args: Any,
        rerun: Closure | None = None,
        rerun_rtol: float = 0.0,
        **kwargs: Any,
    ) -> Any:
        """Check ``optimizer``'s gradients unless ``unscale_`` did, then apply the policy.

        ``observe``: ``optimizer.step(*args, **kwargs)``, as without the watch, and its
        return value. ``skip``: the step unless any rank found inf/NaN (then ``None``);
        one ``.item()`` decides, except for fused optimizers, which get the agreed flag
        as ``found_inf`` and skip on the device. ``raise``: the step, or
        :class:`NonFiniteGradientsError` on every rank after this iteration's record
        reached the sinks.

        With ``rerun`` (every rank of the process group passes one, on every iteration),
        a flagged iteration is rerun first, as the scalers' ``step(..., rerun=)`` does: one
        all-reduce of a one-element flag and one host read agree whether any rank's
        gradients or loss held inf/NaN or reached its spike threshold (its loss, or the
        gradient norm, against its own spike rule's current threshold, compared on the
        device); under ``skip``/``raise`` that agreement is also the policy's on a clean
        iteration, so it costs no more than the policy alone. Clean iterations never call
        ``rerun``. On a flagged one every rank calls it once, its gradients are checked
        afresh and the policy applies to them: a result that was not reproduced is stepped
        over with the rerun's gradients, a reproduced inf/NaN is skipped (``skip``) or
        raised (``raise``, the message then says whether the rerun reproduced it), and
        :attr:`last_rerun` says what this rank found (see
        :mod:`ampscope.rank.frontends.rerun` and docs/bad-data-or-hardware.md).

        Args:
            optimizer: The optimizer to step.
            *args: Passed to ``optimizer.step``, as ``**kwargs``.
            rerun: Zeroes the gradients, recomputes this iteration's loss from the same
                batch through this watch's ``scale()`` and runs backward; returns the
                loss. Never forwarded to the optimizer.
            rerun_rtol: Relative tolerance of the comparison; 0 compares bit for bit.

        Raises:
            NonFiniteGradientsError: policy ``raise`` and inf/NaN, or ``skip`` and the
                ``max_consecutive_skips``-th consecutive skipped iteration.
            RuntimeError: a second ``step()`` for ``optimizer`` before ``update()``, or a
                ``closure`` keyword (as torch's scaler).
        """
        capture = self._ampscope_capture
        if capture is None:
            if self._ampscope_closed and id(optimizer) not in self._closed_checked:
                self._ampscope_pair_closed_norms(optimizer)  # where the open ranks check
            rerun_flagged = False
            if rerun is not None:
                rerun_flagged = self._ampscope_rerun_closed(rerun, self._watch.process_group)
            # The open ranks agree on the policy on every iteration without a closure, and
            # after a flagged rerun: this rank takes part (clean), and skips or raises with
            # them, so their collectives stay paired and the weights alike.
            if (
                self._ampscope_closed
                and self._watch.policy != "observe"
                and (rerun is None or rerun_flagged)
            ):
                return self._closed_policy_step(optimizer, args, kwargs)
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradWatch is enabled.")
        self._ampscope_stepping()
        entry = capture.iteration.get(id(optimizer))
        if entry is not None and entry.stepped:
            raise RuntimeError("step() has already been called since the last update().")
        policy = self._watch.policy
        if rerun is not None:
            entry = self._rerun(capture, optimizer, rerun, rerun_rtol)
        elif entry is None:
            entry = self._check(capture, optimizer)
        if entry.agreed is None and policy != "observe":
            # Left to here by unscale_() or by the rerun (armed): the policy's agreement.
            entry.agreed = agree(entry.found, self._watch.process_group, self._ampscope_failed)
        entry.stepped = True
        agreed = entry.agreed
        if policy == "observe" or agreed is None:
            return optimizer.step(*args, **kwargs)
        if (
            entry.info is not None
            and entry.info.fused
            and policy == "skip"
            and self._watch.max_consecutive_skips is None
            and agreed.device.type != "cpu"
        ):
            entry.skipped = None  # decided on the device; read only when asked
            return _fused_step(optimizer, agreed, args, kwargs)
        if id(agreed) in capture.zero_ids or not agreed.item():
            return optimizer.step(*args, **kwargs)
        entry.skipped = True
        self._attribute(entry, optimizer)
        limit = self._watch.max_consecutive_skips
        if policy == "raise":
            self._stop("policy 'raise' stops at the first non-finite iteration")
        elif limit is not None and self._consecutive_skips + 1 >= limit:
            self._stop(f"{limit} consecutive iterations skipped (max_consecutive_skips={limit})")
        return None

    def _closed_policy_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """A closed watch's part in the policy under ``skip``/``raise``: the agreement's
        all-reduce with a zero flag; then the optimizer steps, or skips, or (``raise``, or
        ``max_consecutive_skips`` reached) the watch takes part in the open ranks' gather
        and raises the error they raise. Nothing is recorded. One all-reduce and one host
        read per iteration, as on the open ranks."""
        group = self._watch.process_group
        agreed = self._closed_checked.get(id(optimizer))
        if agreed is None:
            agreed = agree({}, group, self._ampscope_failed)
        if not agreed.item():
            self._consecutive_skips = 0
            return optimizer.step(*args, **kwargs)
        limit = self._watch.max_consecutive_skips
        reason = None
        if self._watch.policy == "raise":
            reason = "policy 'raise' stops at the first non-finite iteration"
        elif limit is not None and self._consecutive_skips + 1 >= limit:
            reason = f"{limit} consecutive iterations skipped (max_consecutive_skips={limit})"
        if reason is None:
            self._consecutive_skips += 1
            return None
        self._consecutive_skips = 0
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        reports, gathered = stop.gather(stop.unknown(rank), group)
        error = stop.build_error(
            reports,
            self.telemetry.snapshot().steps + self._closed_updates + 1,
            reason,
            gathered=gathered,
        )
        failure.note(error)
        raise error

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Close the iteration: one record. On the CPU the telemetry thread reads the
        flags (host memory, no sync); on accelerators one small stack and its non-blocking
        copy. The first call resolves the run id (a collective every rank reaches in its
        first update()).

        Raises:
            ValueError: ``new_scale`` given: a watch has no scale.
        """
        if new_scale is not None:
            raise ValueError("GradWatch has no scale to set; update() takes no new_scale")
        capture = self._ampscope_capture
        if capture is None:
            self._closed_updates += int(self._ampscope_closed)
            self._closed_checked.clear()
            self._ampscope_check_replicas()  # a closed rank keeps its part in the collective
            return
        if capture.closed_by_raise:
            capture.closed_by_raise = False
            if not capture.iteration:
                # The raise recorded this iteration already; the replica check still runs,
                # as on every rank that goes on (a closed one included), to keep its count.
                self._ampscope_check_replicas()
                return
        iteration, step = capture.iteration, capture.step + 1
        skipped = any(e.skipped for e in iteration.values())
        self._consecutive_skips = self._consecutive_skips + 1 if skipped else 0
        # After the optimizer step(s), on every rank whatever fails below (a collective).
        replicas = self._ampscope_check_replicas()
        try:
            # The identity first: its collective (first update()) is made by every rank,
            # whatever fails after it.
            identity = self._ampscope_identity_now()
            origin = self._ampscope_take_origin()
            pending = capture.close_iteration(
                identity,
                origin,
                self._counts(capture),
                self._ampscope_take_stats(),
                self._ampscope_take_fp8(),
            )
            pending.rerun, self._ampscope_rerun_pending = self._ampscope_rerun_pending, None
            pending.replicas = replicas
            self._ampscope_telemetry.submit(pending)
        except Exception:
            self._abandon(capture, iteration, step)

    @property
    def last_step_skipped(self) -> bool:
        """Whether the newest iteration skipped its optimizer step (policy ``skip``).

        After ``update()``: the iteration it closed; between ``step()`` and ``update()``:
        the current one. Free, except for fused optimizers under ``skip`` on an
        accelerator, whose flag it reads (one sync). ``False`` under ``observe``.
        """
        capture = self._ampscope_capture
        if capture is None:
            return False
        stepped = [e for e in capture.iteration.values() if e.stepped]
        if stepped:
            return any(
                bool(e.agreed.item()) if e.skipped is None and e.agreed is not None else e.skipped
                for e in stepped
            )
        last = capture.last_skipped
        if isinstance(last, list):
            capture.last_skipped = any(bool(flag.item()) for flag in last)
            return capture.last_skipped
        return last

    def state_dict(self) -> dict[str, Any]:
        """``{"consecutive_skips": n}`` (empty when disabled), for checkpoints."""
        return {"consecutive_skips": self._consecutive_skips} if self._enabled else {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`. A disabled watch's or a missing count is 0.

        Raises:
            ValueError: a loss scaler's state (``scale``...): a watch has no scale.
        """
        if "scale" in state_dict:
            raise ValueError("this is a loss scaler's state_dict; a GradWatch has no scale to load")
        self._consecutive_skips = int(state_dict.get("consecutive_skips", 0))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in OWN_ATTRIBUTES:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # An unpickled copy keeps the policy and its count, checks and applies it as
        # before, and keeps its records in its own history: sinks, the reporter, threads
        # and hooks do not travel.
        self.__dict__.update(state)
        self._ampscope_start(TelemetryConfig(reporter=None), False)
        self._ampscope_capture = WatchCapture(self._watch.policy) if self._enabled else None

    # -- internals -----------------------------------------------------------------------

    def _check(
        self, capture: WatchCapture, optimizer: torch.optim.Optimizer, *, agree_now: bool = True
    ) -> Checked:
        """Check ``optimizer``'s gradients and, under skip/raise and ``agree_now``, agree
        with the other ranks (else ``step()`` does, or the rerun's agreement stands in).

        Whatever fails in here on one rank, it makes the same collectives as the others
        (the norm's sums, the agreement) and takes part as clean: counted, logged once,
        never raised into training, and no rank waits alone.
        """
        info: OptimizerInfo | None
        try:
            info = capture.info(optimizer)
        except Exception:
            self._ampscope_failed()
            info = None
        found: FoundInf | None = None
        stats = self._ampscope_stats
        if stats is not None:
            # Sharded gradients all-reduce their squared norm here, on every rank alike.
            try:
                norms = stats.add_grads(optimizer, info, scaled=False)
                place = info.place if info is not None else None
                if norms is not None and place is not None and place[0].type == "cpu":
                    found = capture.clean_from_norms(norms, place[0])
            except Exception:
                self._ampscope_failed()
        clean = found is not None
        if found is None:
            try:
                found = {} if info is None else check_local(optimizer, info, capture.ones)
            except Exception:
                self._ampscope_failed()
                found = {}
        group = self._watch.process_group
        agreed = (
            agree(found, group, self._ampscope_failed)
            if agree_now and self._watch.policy != "observe"
            else None
        )
        entry = capture.iteration[id(optimizer)] = Checked(info, found, agreed)
        # Parameters are named where the host knows the flag for free (the CPU); on an
        # accelerator under skip/raise, once the agreed flag says so (step()).
        if not clean and self._ampscope_config.attribution:
            try:
                place = info.place if info is not None else None
                on_host = capture.flags_on_host(found, None if place is None else place[0])
                if on_host and any(flag.item() for flag in found.values()):
                    self._attribute(entry, optimizer)
            except Exception:
                self._ampscope_failed()
        return entry

    def _rerun(
        self,
        capture: WatchCapture,
        optimizer: torch.optim.Optimizer,
        closure: Closure,
        rtol: float,
    ) -> Checked:
        """Check ``optimizer``'s gradients unless unscale_() did, agree whether the
        iteration is flagged, rerun it if so: the check the step goes on with."""
        self._rerun_armed = True
        checks = _WatchChecks(self._check, capture, optimizer)
        group = self._watch.process_group
        if not self._ampscope_rerun(checks, optimizer, closure, rtol, group):
            entry = checks.entry()
            if entry.agreed is None and self._watch.policy != "observe":
                # No rank flagged anything, inf/NaN included: the policy's flag is 0,
                # known without another collective or read.
                entry.agreed = capture.zero(next(iter(entry.found), torch.device("cpu")))
            return entry
        return checks.entry()

    def _attribute(self, entry: Checked, optimizer: torch.optim.Optimizer) -> None:
        """Count the non-finite elements per parameter, once per check, when the local
        gradients held some. Reads the local flags (a sync on accelerators): call only
        where the host already knows, or on the skip/raise path."""
        if entry.nonfinite is not None or not self._ampscope_config.attribution:
            return
        counts = self._ampscope_guard(self._count_nonfinite, entry, optimizer)
        entry.nonfinite = counts if counts is not None else {}

    def _count_nonfinite(self, entry: Checked, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        if not any(flag.item() for flag in entry.found.values()):
            return {}
        return self._ampscope_named_before_clip(count_nonfinite(optimizer, self._ampscope_names))

    @staticmethod
    def _counts(capture: WatchCapture) -> Mapping[str, int]:
        merged: dict[str, int] = {}
        for entry in capture.iteration.values():
            if entry.nonfinite:  # counted only on non-finite iterations
                for name, count in entry.nonfinite.items():
                    merged[name] = merged.get(name, 0) + count
        return merged

    def _abandon(self, capture: WatchCapture, iteration: dict[int, Checked], step: int) -> None:
        """Close ``iteration`` without its record (call in ``except``; counted, logged
        once). It still counts, as on the other ranks: the next record's step, a raise's
        message and last_step_skipped stay the same on every rank."""
        capture.abandon(iteration, step)
        self._ampscope_rerun_pending = None
        if self._ampscope_stats is not None:
            self._ampscope_stats.discard()
        self._ampscope_failed()

    def _stop(self, reason: str) -> None:
        """Record the iteration, deliver it, agree on the words, raise. Every rank of the
        group calls this at the same ``step()`` and makes the same collectives whatever
        fails here: the identity's (in a first iteration), then the gather's."""
        capture = self._ampscope_capture
        assert capture is not None
        step = capture.step + 1
        self._consecutive_skips = 0
        capture.closed_by_raise = True
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        report = stop.unknown(rank)
        iteration = capture.iteration
        try:
            identity = self._ampscope_identity_now()
            origin = self._ampscope_take_origin()
            counts = self._counts(capture)
            outcome, self._ampscope_rerun_pending = self._ampscope_rerun_pending, None
            rerun: stop.RerunResult | None = None
            if outcome is not None and outcome.flagged:
                rerun = "transient" if outcome.transient else "reproducible"
            ids = self._ampscope_telemetry.batches.ids if rerun == "reproducible" else ()
            report = stop.RankReport(
                rank=rank,
                origin=any(bool(f.item()) for f in origin.values()) if origin else None,
                local=any(
                    bool(f.item()) for e in capture.iteration.values() for f in e.found.values()
                ),
                params=stop.own_params(counts),
                rerun=rerun,
                batch_ids=tuple(ids[: stop.MESSAGE_IDS]),
            )
            pending = capture.close_iteration(
                identity, origin, counts, self._ampscope_take_stats(), self._ampscope_take_fp8()
            )
            pending.rerun = outcome
            self._ampscope_telemetry.submit(pending)
            self._ampscope_telemetry.flush(RAISE_FLUSH_TIMEOUT_S)
        except Exception:
            self._abandon(capture, iteration, step)
        reports, gathered = stop.gather(report, self._watch.process_group)
        error = stop.build_error(reports, step, reason, gathered=gathered)
        failure.note(error)  # the rank ends failed, even when the loop catches it and exits
        raise error


class _WatchChecks:
    """A watch's check of one optimizer's gradients is its non-finite check, without the
    policy's agreement (the rerun's stands in for it on a clean iteration)."""

    __slots__ = ("_capture", "_check", "_optimizer")

    def __init__(
        self,
        check: Callable[..., Checked],
        capture: WatchCapture,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        self._check = check  # the watch's own check, bound
        self._capture = capture
        self._optimizer = optimizer

    def entry(self) -> Checked:
        entry = self._capture.iteration.get(id(self._optimizer))
        if entry is None:
            entry = self._check(self._capture, self._optimizer, agree_now=False)
        return entry

    def found(self) -> Mapping[torch.device, torch.Tensor]:
        return self.entry().found

    def forget(self) -> None:
        self._capture.iteration.pop(id(self._optimizer), None)


def _fused_step(
    optimizer: torch.optim.Optimizer,
    found_inf: torch.Tensor,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Step a fused optimizer that skips itself when ``found_inf`` is set, as torch's
    scaler hands it the flag (``grad_scale`` none: nothing to unscale). No sync.

    The flag goes in 0-dim, as torch's scaler makes it: fused Adam subtracts it from each
    0-dim step counter in place, which a one-element vector cannot broadcast into.
    """
    opt: Any = optimizer
    opt.grad_scale = None
    opt.found_inf = found_inf.reshape(())
    try:
        return optimizer.step(*args, **kwargs)
    finally:
        del opt.grad_scale
        del opt.found_inf
