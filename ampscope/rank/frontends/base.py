"""What every telemetry front-end shares: the scalers' mixin and the bf16/fp32 watch.

A front-end decides what one iteration was (a scaler's skip and scale, a watch's policy)
and hands a :class:`~ampscope.rank.capture.pending.PendingStep` to the same machinery: parameter
names, origin hooks, the identity, the telemetry thread and its sinks. This base owns
that machinery's life cycle (``attach``, ``close``, the first update()'s identity) and
the rule that telemetry never raises into training.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from ampscope.rank import compat
from ampscope.rank.config import TelemetryConfig, check_fp8_every, check_replica_check_every
from ampscope.rank.frontends.rerun import Checks, Closure, Rerun, RerunOutcome, agree_flagged
from ampscope.rank.gradients.clip import clip_grad_norm_with_norms, clippable
from ampscope.rank.gradients.names import ParamNames
from ampscope.rank.gradients.stats import GradStats, SquareSumReduce, TakenStats
from ampscope.rank.telemetry.identity import resolve_identity
from ampscope.rank.telemetry.outputs import build_sinks
from ampscope.rank.telemetry.pipeline import Telemetry
from ampscope.reporter import failure, pause
from ampscope.reporter.schema import Identity

if TYPE_CHECKING:
    from ampscope.rank.fp8.observer import Fp8Observer
    from ampscope.rank.replicas.check import ReplicaCheck, ReplicaOutcome

logger = logging.getLogger("ampscope")

_FrontEnd = TypeVar("_FrontEnd", bound="TelemetryFrontEnd")

NO_FLAGS: Mapping[str, torch.Tensor] = MappingProxyType({})

OWN_ATTRIBUTES = (
    "_ampscope_config",
    "_ampscope_telemetry",
    "_ampscope_capture",
    "_ampscope_names",
    "_ampscope_identity",
    "_ampscope_origin",
    "_ampscope_origin_handles",
    "_ampscope_errors",
    "_ampscope_stats",
    "_ampscope_fp8",
    "_ampscope_replicas",
    "_ampscope_closed_stats",
)
"""Attributes a front-end adds; dropped when it is pickled (threads, hooks, sinks)."""


def warn_if_torch_changed() -> None:
    """Warn once per process (the check is cached) when this torch breaks an assumption
    of :mod:`ampscope.rank.compat`."""
    problems = compat.check_torch()
    if problems:
        warnings.warn(
            "ampscope: this torch differs from what the instrumented scalers and the watch "
            "expect; telemetry may be wrong: " + "; ".join(problems),
            RuntimeWarning,
            stacklevel=3,
        )


class TelemetryFrontEnd(failure.ClosedByWith):
    """Shared state and life cycle of a front-end. Subclasses set ``_ampscope_capture``
    (anything with ``close()``; ``None`` when telemetry is off) after
    :meth:`_ampscope_start`."""

    _ampscope_config: TelemetryConfig
    _ampscope_telemetry: Telemetry
    _ampscope_capture: Any
    _ampscope_names: ParamNames
    _ampscope_identity: Identity | None
    _ampscope_origin: Any
    _ampscope_origin_handles: list[Any]
    _ampscope_errors: int
    _ampscope_stats: GradStats | None
    _ampscope_fp8: Fp8Observer | None
    _ampscope_replicas: ReplicaCheck | None
    _ampscope_closed_stats: GradStats | None

    def _ampscope_start(
        self, config: TelemetryConfig, enabled: bool, reduce: SquareSumReduce | None = None
    ) -> None:
        """Build the telemetry (no reporter, thread or records when not ``enabled``)."""
        self._ampscope_config = config
        self._ampscope_telemetry = Telemetry(
            sinks=build_sinks(config) if enabled else (),
            history=config.history,
            top_k=config.top_k,
            spike_rule=config.spike_rule,
            fault_rule=config.fault_rule,
        )
        self._ampscope_capture = None
        # Closed after observing: it still takes part in the ranks' rerun agreement.
        self._ampscope_closed = False
        self._ampscope_names = ParamNames()
        self._ampscope_identity = None
        self._ampscope_origin = None
        self._ampscope_origin_handles = []
        self._ampscope_errors = 0
        self._ampscope_fp8 = None
        self._ampscope_replicas = None
        self._ampscope_closed_stats = None
        """After ``close()``: the norms whose all-reduces (sharded gradients) this rank
        still makes with the open ranks (:meth:`GradStats.pair_closed`)."""
        self._ampscope_last_rerun: RerunOutcome | None = None
        self._ampscope_rerun_pending: RerunOutcome | None = None
        """The rerun of the iteration update() closes, for its record."""
        self._ampscope_stats = (
            GradStats(self._ampscope_names, reduce) if enabled and config.stats else None
        )
        # Collected without close(): flush and stop the threads off the collecting thread.
        # The callback holds the telemetry only, never the front-end.
        finalizer = weakref.finalize(self, self._ampscope_telemetry.close_soon)
        finalizer.atexit = False  # interpreter exit is the telemetry module's job

    # -- public API ----------------------------------------------------------------------

    @property
    def telemetry(self) -> Telemetry:
        """This front-end's telemetry: ``snapshot()``, ``history(n)``."""
        return self._ampscope_telemetry

    @property
    def closed_already(self) -> bool:
        return self._ampscope_telemetry.closed

    @property
    def last_rerun(self) -> RerunOutcome | None:
        """What the newest rerun found on this rank (``None`` before any): set by
        ``step(..., rerun=closure)`` on a flagged iteration."""
        return self._ampscope_last_rerun

    def attach(
        self,
        model: nn.Module,
        track_origin: bool = False,
        *,
        fp8_every: int | None = None,
        replica_check_every: int | None = None,
    ) -> None:
        """Name ``model``'s parameters in records; optionally track found-inf origin;
        observe its FP8 layers.

        Call once, after wrapping the model (FSDP1, ``fully_shard``, DDP) and before the
        first backward. Costs one walk over ``named_parameters()``. When the model holds
        torchao ``Float8Linear`` layers, records carry each layer's FP8 statistics on one
        iteration in ``fp8_every`` (docs/fp8.md). With FSDP1 it also
        tells the gradient norm (``stats``) how the gradients are sharded: a
        ``ShardedGradScaler`` not attached assumes a sharded strategy, a ``GradWatch`` not
        attached whole gradients.

        Args:
            model: The wrapped model whose parameters the optimizer(s) hold.
            track_origin: Install origin hooks on the model's gradient collectives, so
                records say which rank's own gradients held inf/NaN before the reduction
                (``found_inf_origin``). Costs one read-only pass per gradient bucket.
            fp8_every: Observe the ``Float8Linear`` layers on the first iteration and then
                one in this many; ``None``: the front-end's ``fp8_every`` option. An
                observed iteration costs three reductions and three elementwise passes
                over each cast tensor, on its device, and no sync.
            replica_check_every: Compare the parameters bit for bit with their replicas
                (DDP; FSDP2 on a replicate x shard mesh; FSDP1 ``HYBRID_SHARD``) after the
                optimizer step, in ``update()``, on one iteration in this many; 0: never;
                ``None``: the front-end's option. Every rank must attach with the same
                value. A check costs two kernels per 2**24 parameter elements, one small
                all-gather over the replica group and one host read; other iterations
                cost nothing (docs/silent-corruption.md). Attach again after replacing a
                parameter's ``.data``.

        Raises:
            TypeError, ValueError: from ``install_origin_hooks`` when the model runs no
                supported gradient collective; ValueError: ``fp8_every`` is not a
                positive int, or ``replica_check_every`` not an int >= 0.
        """
        every = check_fp8_every(self._ampscope_config.fp8_every if fp8_every is None else fp8_every)
        replica_every = check_replica_check_every(
            self._ampscope_config.replica_check_every
            if replica_check_every is None
            else replica_check_every
        )
        self._ampscope_names.attach(model)
        if self._ampscope_capture is not None:
            self._ampscope_attach_fp8(model, every)
            self._ampscope_attach_replicas(model, replica_every)
        stats = self._ampscope_stats
        if stats is not None:
            from ampscope.rank.gradients.origin_hooks import fsdp1_gradient_group
            from ampscope.rank.gradients.stats import sum_over

            try:
                fsdp1, group = fsdp1_gradient_group(model)
            except ValueError:  # several FSDP1 roots: origin tracking says so below
                fsdp1, group = False, None
            if fsdp1:
                # FSDP1 gradients are flat shards (summed over the group) or, NO_SHARD,
                # whole on every rank (not summed).
                stats.reduce = None if group is None else sum_over(group)
        if track_origin and self._ampscope_capture is not None:
            from ampscope.rank.gradients.origin import OriginFlags
            from ampscope.rank.gradients.origin_hooks import install_origin_hooks, origin_group

            if self._ampscope_origin is None:
                self._ampscope_origin = OriginFlags(norms=self._ampscope_stats is not None)
            self._ampscope_origin_handles.append(install_origin_hooks(model, self._ampscope_origin))
            self._ampscope_capture.registry.set_origin_group(
                origin_group(self._ampscope_origin_handles)
            )

    def note_batch(self, ids: Any) -> None:
        """Note this rank's sample or batch ids for the current iteration.

        Call any time between two ``update()`` calls, once per micro-batch if you like: the
        ids of an accumulated update add up, and ``update()`` puts them in the step's record
        (``batch``), so the exporter can name the ids behind any flagged step
        (``/api/v1/runs/{run}/suspect-batches``). Costs a list append on the training
        thread: no tensor work, no validation (the telemetry thread checks the ids).

        Args:
            ids: One id or an iterable of them: ints (exact up to 2**53) or printable strings
                of at most 128 characters, e.g. dataset indices or document hashes; a CPU
                tensor of integers is read with ``tolist()``. At most 256 ids per iteration
                are kept (``ampscope.reporter.schema.MAX_BATCH_IDS``), the rest counted in the
                record's ``batch.left_out``, as are invalid ids and the elements of a tensor on
                an accelerator (reading it would wait for the device).
        """
        if self._ampscope_capture is None:
            return
        try:
            self._ampscope_telemetry.batches.add(ids)
        except Exception:
            self._ampscope_failed()

    def paused(self, reason: str) -> pause.Pause:
        """Say that this rank stops stepping on purpose: a checkpoint save, an evaluation
        loop, the work after the last step.

        ``with scaler.paused("checkpoint"): save(...)``: while the block runs, the
        reporter's heartbeats say ``checkpoint``, and the exporter keeps the rank
        ``running`` (its API, web view and ``ampscope status`` say "paused (checkpoint)
        for N s") for up to its ``pause_limit_s`` (2 h by default) without a step, instead
        of calling it ``stalled`` after ``stall_after_s`` (10 min) and firing
        ``AmpscopeRankStalled``. Without a pause, a rank that takes no step is what that
        alert exists for (a hang), so only the loop can tell the exporter otherwise.

        Pauses belong to the rank's process, not to this front-end: the same as
        ``ampscope.paused(reason)``. They nest (the newest reason is said, the age of the
        oldest) and may be opened and ended on any thread. The returned pause also ends
        on ``end()`` (idempotent), for a start and an end in two callbacks. Costs a lock
        and a dict update, on this call and the end only; nothing per step; never raises.

        Args:
            reason: What the rank does meanwhile (``checkpoint``, ``eval``): letters,
                digits and ``_.:/@+=-``, at most 64 characters (others become ``-``).

        Returns:
            The open :class:`ampscope.reporter.pause.Pause`, a context manager.
        """
        return pause.paused(reason)

    def clip_grad_norm_(
        self,
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_``, whose pass over the gradients also gives this
        iteration's gradient norms (``stats``): the loop reads gradient memory once for
        both instead of twice.

        Same arguments, same result and the same clipped gradients, bit for bit. Call it
        where the loop clips, after ``unscale_()`` (as torch's scalers require), before
        ``step()``. From the next iteration on, ``unscale_()`` leaves the norms to this
        clip; an iteration that does not clip through here gets them at ``step()``, before
        the optimizer runs. The clip's norms are taken for the record when its parameters
        are exactly the optimizers' (any order), every gradient is present, dense, on one
        device and dtype, and ``norm_type`` is 2; otherwise the norms come from their own
        pass, as without this method. Records then hold the norms in the gradients' dtype
        (a bf16 model's are bf16, as the clip computes them).

        Returns:
            The total norm of the gradients before clipping, as torch's.
        """
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        keep = self._ampscope_stats is not None and bool(
            self._ampscope_guard(clippable, params, norm_type, foreach)
        )

        def clip(keep_norms: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
            total, norms = clip_grad_norm_with_norms(
                params, max_norm, norm_type, error_if_nonfinite, foreach, keep=keep_norms
            )
            return total, norms, total

        return self._ampscope_clip(params, clip, keep, sticky=True)

    def expect_clip(self) -> None:
        """The loop's clip comes right after the next checks (``unscale_()``), through
        :meth:`clip_with_norms_`: the checks leave every norm to it, those of sharded
        (DTensor) gradients included, whose all-reduce the clip's total replaces whether
        or not the clip keeps its norms (where it does not, their local norms are taken
        before it, and ``grad_norm`` is its total where its parameters are exactly the
        optimizers', else ``null``; where no clip comes, ``null`` too). For integrations
        that call the clip themselves; every rank must call it alike (it moves a
        collective), a closed front-end's too (it then pairs no norm all-reduce in
        ``unscale_()``). Free."""
        stats = self._ampscope_stats
        if stats is None:
            stats = self._ampscope_closed_stats
        if stats is not None:
            stats.clip_ahead = True

    def clip_with_norms_(
        self,
        params: list[torch.Tensor],
        clip: Callable[[bool], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]],
        keep: bool,
    ) -> torch.Tensor:
        """Run a loop's clip over ``params`` whose pass keeps the per-parameter norms, and
        take them as this iteration's norms instead of a pass of ampscope's own, where
        :meth:`expect_clip` announced it (else the checks normed the gradients already).
        Unlike :meth:`clip_grad_norm_`, later iterations do not defer their norms to it.

        Args:
            params: The clipped parameters, in the clip's order.
            clip: ``clip(keep_norms)`` clips and returns the total norm it returns, the
                per-parameter norms of the local gradients stacked in the order of
                ``params`` (``None`` unless ``keep_norms``), and the total norm the record
                counts (over the ranks that :meth:`expect_clip`'s sharded gradients span).
            keep: Whether ``clip`` can keep the norms (decided alike on every rank).

        Returns:
            What ``clip`` returns first. Its exceptions are the loop's; ampscope's are
            counted and logged, never raised.
        """
        return self._ampscope_clip(params, clip, keep, sticky=False)

    def _ampscope_clip(
        self,
        params: list[torch.Tensor],
        clip: Callable[[bool], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]],
        keep: bool,
        sticky: bool,
    ) -> torch.Tensor:
        """:meth:`clip_with_norms_`; ``sticky``: later iterations defer their norms to the
        clip (:meth:`GradStats.before_clip`)."""
        stats = self._ampscope_stats
        names = None
        if stats is not None:
            # Norms left to this clip are taken before it changes the gradients.
            names = self._ampscope_guard(stats.before_clip, params, keep, sticky=sticky)
        elif self._ampscope_closed_stats is not None:
            self._ampscope_closed_stats.clip_ahead = False  # expect_clip() is over
        total, norms, counted = clip(names is not None)
        if stats is not None:
            if names is not None and norms is not None:
                self._ampscope_guard(stats.after_clip, names, norms, counted)
            else:
                self._ampscope_guard(stats.after_unkept_clip, counted)
        return total

    def close(self, timeout: float = 1.0) -> None:
        """Flush pending records, close the sinks and remove hooks. Idempotent.

        The reporter then sends its final record: the exporter shows the rank as
        ``finished`` and no alert fires for it (``failed`` when training ended on an
        exception: see :mod:`ampscope.reporter.failure`). Training goes on working afterwards,
        without telemetry. Also runs at interpreter exit, and on a background thread when
        the object is garbage collected without it. Waits at most about ``timeout``
        seconds (default 1), even with the exporter down.
        """
        capture, self._ampscope_capture = self._ampscope_capture, None
        stats, self._ampscope_stats = self._ampscope_stats, None
        if capture is not None:
            self._ampscope_closed = True
            self._ampscope_closed_stats = stats
            capture.close()
        for handle in self._ampscope_origin_handles:
            handle.remove()
        self._ampscope_origin_handles = []
        fp8, self._ampscope_fp8 = self._ampscope_fp8, None
        if fp8 is not None:
            fp8.close()
        # The replica check stays: its all-gather is a collective the open ranks make every
        # ``replica_check_every`` iterations, and a closed rank must keep its part in it
        # (``update()`` runs it and drops the outcome), or they would wait for it forever.
        self._ampscope_telemetry.close(timeout)

    # -- internals -----------------------------------------------------------------------

    def _ampscope_rerun(
        self,
        checks: Checks,
        optimizer: torch.optim.Optimizer,
        closure: Closure,
        rtol: float,
        group: Any = None,
        scale: torch.Tensor | None = None,
    ) -> bool:
        """Agree whether the iteration is flagged and, if so, rerun it
        (:class:`~ampscope.rank.frontends.rerun.Rerun`): whether it was rerun. ``scale``:
        a scaler's scale tensor, compared on the device with the fault rule's clean scale
        (an overflow above it is weather, never rerun). Exceptions of the closure reach the
        caller, as any of the loop's own code."""
        if self._ampscope_rerun_pending is not None:
            # The closure recomputed every gradient and an optimizer already stepped on
            # them: a second rerun would compare a different iteration.
            raise RuntimeError(
                "ampscope: this iteration was already rerun for another optimizer; pass "
                "rerun= to one optimizer's step() per iteration (its closure recomputes "
                "every gradient)"
            )
        stats = self._ampscope_stats
        thresholds = None
        if stats is not None:
            thresholds = self._ampscope_telemetry.spike_thresholds
            thresholds.armed = True
        origin = self._ampscope_origin
        check = Rerun(
            checks,
            optimizer,
            stats,
            origin,
            rtol,
            group=group,
            thresholds=thresholds,
            on_failure=self._ampscope_failed,
            scale=scale,
            fault_threshold=self._ampscope_telemetry.fault_threshold(),
            consequences=self._ampscope_telemetry.nonfinite_applied,
        )
        if not check.flagged():
            return False
        batches = self._ampscope_telemetry.batches
        first_ids: tuple[list[Any], int] = ([], 0)

        def second_pass() -> Any:
            # One reset before the second pass: the record describes that pass alone
            # (Rerun.run already dropped the first pass's stats and origin flags).
            nonlocal first_ids
            fp8 = self._ampscope_fp8
            if fp8 is not None:
                fp8.restart()
            first_ids = batches.restart_pass()
            return closure()

        try:
            self._ampscope_last_rerun = self._ampscope_rerun_pending = check.run(second_pass)
        finally:
            batches.end_pass(first_ids)
        return True

    def _ampscope_rerun_closed(self, closure: Closure, group: Any = None) -> bool:
        """A closed front-end's part in the rerun: ranks that still observe agree on every
        iteration with a closure, so this one takes part with a zero flag and, when another
        rank flagged the iteration, calls the closure once (its collectives pair with
        theirs): whether it did. Nothing is compared: a closed front-end records nothing. A
        front-end disabled from the start (or unpickled) takes no part: all ranks are alike
        there."""
        if not self._ampscope_closed:
            return False
        if agree_flagged(torch.zeros(1), group) > 0:
            with torch.enable_grad():
                closure()
            return True
        return False

    def _ampscope_attach_fp8(self, model: nn.Module, every: int) -> None:
        """Observe ``model``'s ``Float8Linear`` layers (replacing an earlier attach's)."""
        from ampscope.rank.fp8.observer import Fp8Observer, float8_layers

        old, self._ampscope_fp8 = self._ampscope_fp8, None
        if old is not None:
            old.close()
        layers = float8_layers(model)
        if layers:
            self._ampscope_fp8 = Fp8Observer(layers, every, compat.float8_sharded_weights(model))

    def _ampscope_attach_replicas(self, model: nn.Module, every: int) -> None:
        """Check ``model``'s parameters against their replicas (replacing an earlier
        attach's check); nothing when ``every`` is 0 or no parameter has a replica."""
        self._ampscope_replicas = None
        if every:
            from ampscope.rank.replicas.check import ReplicaCheck

            try:
                check = ReplicaCheck(model, every)
            except Exception:
                # A model the check cannot lay out (two DDP wrappers in one container, ...):
                # the rest of attach() stands; identically on every rank (same model).
                logger.warning(
                    "ampscope: replica check off for this model (attach goes on)", exc_info=True
                )
                return
            self._ampscope_replicas = check if check.compares else None

    def _ampscope_pair_closed_norms(self, optimizer: torch.optim.Optimizer) -> None:
        """Where an open front-end all-reduces the norm of ``optimizer``'s sharded gradients,
        a closed one makes the same all-reduces (the open ranks would wait for it). Never
        raises."""
        stats = self._ampscope_closed_stats
        if stats is not None:
            try:
                stats.pair_closed(optimizer)
            except Exception:
                self._ampscope_failed()

    def _ampscope_check_replicas(self) -> ReplicaOutcome | None:
        """The replica check after this iteration's optimizer step (``None``: not a
        checking iteration, or nothing to compare). Call once per ``update()`` on every
        rank. Never raises."""
        check = self._ampscope_replicas
        if check is None:
            return None
        try:
            return check.after_step()
        except Exception:
            self._ampscope_failed()
            return None

    def _ampscope_take_fp8(self) -> tuple[torch.Tensor, Any] | None:
        """The closing iteration's FP8 values and their names (``None``: not observed);
        arms the next observed iteration. Never raises."""
        fp8 = self._ampscope_fp8
        if fp8 is None:
            return None
        try:
            return fp8.take()
        except Exception:
            self._ampscope_failed()
            return None

    def _ampscope_take_origin(self) -> Mapping[str, torch.Tensor]:
        """This iteration's origin flags (and fresh ones for the next); none untracked."""
        origin = self._ampscope_origin
        return NO_FLAGS if origin is None else origin.take()

    def _ampscope_take_stats(self) -> TakenStats | None:
        """This iteration's loss and norms (with the origin norms), for update(); ``None``
        with ``stats=False``. Call right after :meth:`_ampscope_take_origin`."""
        stats = self._ampscope_stats
        if stats is None:
            return None
        origin = self._ampscope_origin
        return stats.take(NO_FLAGS if origin is None else origin.take_squares())

    def _ampscope_identity_now(self) -> Identity:
        """The identity, resolved by the first call: a collective every rank reaches in
        its first update() (it may broadcast the run id from rank 0)."""
        identity = self._ampscope_identity
        if identity is None:
            identity = self._ampscope_identity = self._ampscope_resolve_identity()
        return identity

    def _ampscope_resolve_identity(self) -> Identity:
        # Attempted exactly once per front-end: a retry on a later update() could pair
        # this rank's broadcast with a different collective on the other ranks.
        try:
            return resolve_identity(self._ampscope_config.run_id)
        except Exception:
            logger.warning(
                "ampscope: could not agree on a run id with the other ranks; using a local one",
                exc_info=True,
            )
            return resolve_identity(self._ampscope_config.run_id, collective=False)

    def _ampscope_stepping(self) -> None:
        """``step()`` has begun: no clip comes before the optimizer runs, so the norms
        left to one are taken now (and none is left until ``update()``)."""
        stats = self._ampscope_stats
        if stats is not None:
            stats.defer = False
            if stats.waiting:
                self._ampscope_guard(stats.resolve)

    def _ampscope_named_before_clip(self, counts: dict[str, int]) -> dict[str, int]:
        """Non-finite ``counts`` taken after any clip the loop made (an accelerator names a
        skipped step's parameters there, not at the unscale, which would need a sync per
        iteration): a NaN total multiplies every gradient into NaN. Kept to the parameters
        whose norm, taken before the clip, was inf/NaN, and those no norm covers; their
        counts stay the clipped gradients'. Unchanged without norms (``stats=False``)."""
        stats = self._ampscope_stats
        if not counts or stats is None:
            return counts
        seen = self._ampscope_guard(stats.nonfinite_norm_names)
        if not seen:
            return counts
        # All of a rank's norms finite drops every name they cover: under FSDP1 another
        # rank's NaN set this rank's flag and the clip's summed total spread it here.
        bad, normed = seen
        return {name: n for name, n in counts.items() if name in bad or name not in normed}

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
