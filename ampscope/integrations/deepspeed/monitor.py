"""The DeepSpeed monitor that :func:`instrument` builds (the recipe:
:mod:`ampscope.integrations.deepspeed`).

DeepSpeed's engine scales the loss, reduces the gradients, checks them and decides the
skip inside ``engine.step()``; ampscope observes and never changes a number (training is
bit-identical with and without it). At every gradient-accumulation boundary, on every
rank, one record through the same pipeline as the scalers' and the watch's (reporter,
sinks, ``monitor.telemetry``):

* read from DeepSpeed (:mod:`~ampscope.integrations.deepspeed.engine`): whether the
  gradients held inf/NaN after the reduction (``optimizer.overflow``) and whether the
  step was applied (``was_step_applied()``), the loss scale before and after the step
  (fp16), the global gradient norm (``get_global_grad_norm()``);
* from ampscope's own checks (:mod:`~ampscope.integrations.deepspeed.origin`): the origin,
  whether this rank's own gradients held inf/NaN before the reduction
  (``found_inf_origin``) and which parameters (``nonfinite_params``), over all the
  micro-batches of the step; at fp32 ZeRO-0, where DeepSpeed has no overflow flag and no
  norm and where the boundary check runs, whether the reduced gradients held inf/NaN (the
  same on every rank of a data-parallel group; a pipeline stage checks its own parameters
  only); the rank's
  own loss (``engine.backward``'s argument, unscaled; the mean over micro-batches); the
  batch ids noted with ``note_batch``.
* from ampscope's replica check (:mod:`ampscope.rank.replicas`), on one boundary in
  ``replica_check_every`` (default 100), after DeepSpeed's ``step()`` (applied or skipped):
  the engine's module parameters compared bit for bit with the other ranks of DeepSpeed's
  data-parallel group (``seq_data_parallel_group``; an MoE expert's:
  ``expert_data_parallel_group``), at ZeRO 0, 1 and 2, where every rank holds them whole
  after the step. ZeRO-3 partitions them: nothing is compared, and the log says so once.
  At ZeRO 1-2 the fp32 master copy is partitioned, so a corruption of the owner's master
  copy reaches every replica through the all-gather unseen (docs/silent-corruption.md).

DeepSpeed's ``PipelineEngine`` (``deepspeed.initialize`` with a ``PipelineModule``; ZeRO 0-1)
trains a whole batch in ``train_batch()``, whose ``backward()`` and ``step()`` are disabled:
``instrument`` wraps the optimizer step that ``train_batch()`` takes instead, on every rank,
and the records are the same. Each rank checks and names its own stage's parameters (the
origin names the stage's parameters that held inf/NaN); the loss is the last stage's (its
micro-batches' mean; the other stages compute none); the norm and the skip are DeepSpeed's,
the same on every stage; the replica check compares a stage's parameters within its own
data-parallel group (``seq_data_parallel_group`` is the pipeline grid's). Note batch ids
before ``train_batch()``. Records carry no stage number (the schema has none): the rank
says which stage it is (``engine.grid``). A release that moved that step is refused at
``instrument()`` with a ``NotImplementedError`` (the Trainer and Accelerate log it once).

fp16 records (the ``fp16`` section, or ``torch_autocast`` in float16, whose torch
``GradScaler`` scales) read as a loss scaler's (``setup.mode == "scaler"``: scale before
and after, the backoff or growth event, the growth tracker), so the scale rules apply as
they do to ``GradScaler``'s. bf16 and fp32 records read as a watch's (no scale). The
policy is what DeepSpeed does with an inf/NaN step: ``skip``, or ``observe`` when the
config sets ``"bf16": {"check_grad_overflow": false}`` or DeepSpeed is seen applying one.
Each record says what its step did (``PendingStep.applied``): a step applied on inf/NaN
gradients, fp16 or not, counts in ``nonfinite_applied`` (the critical
``nonfinite_update_applied`` verdict), judged from the global norm and ampscope's own checks rather
than from DeepSpeed's ``overflow``, which says ``False`` there; a step the
``torch_autocast`` ``GradScaler`` skipped (its scale fell) is a skip, although the engine
says it applied it at ZeRO-0.

Costs of the origin, checked right before DeepSpeed reduces (no sync; no Python per
parameter and micro-batch on a recognised engine): at ZeRO-0/1, where DeepSpeed reduces only at the
accumulation boundary, one multi-tensor check of every ``.grad`` there and nothing per
micro-batch (at fp32 ZeRO-0, where DeepSpeed has no overflow flag and no norm, the same
check again right after the reduction, on the reduced ``.grad``: the global flag on every
rank); at ZeRO-2 and ZeRO-3, one multi-tensor check per gradient bucket, before DeepSpeed
reduces it; on paths not recognised (ZeRO-2/3 offload, ZenFlow, ``BF16_Optimizer``, ...), one fused
non-finite kernel per parameter and micro-batch in a tensor hook.

What is read where, per optimizer step (:mod:`~ampscope.integrations.deepspeed.step_reads`): on
the training thread, right after ``step()``, only what DeepSpeed holds on the host
(``was_step_applied()``, ``overflow`` when a bool, fp16's ``cur_scale`` and its scaler's
counters), and no host read of a device value: the flag vectors (copied and zeroed on the
device), DeepSpeed's norm when a tensor, the ``torch_autocast`` ``GradScaler``'s scale
before and after ``step()`` (device copies) and the loss go into one float64 vector whose
host copy starts without blocking (pinned memory and an event, as the scalers' device
transport). On the telemetry thread: the wait for that copy, the step's decisions (found,
applied, the switch to ``observe`` and its warning, the growth tracker) and the record. A
checking step adds the replica check's two kernels per 2**24 parameter elements and, per
replica group (the data-parallel group, and each MoE expert data-parallel group), one
small all-gather and one host read (training thread).

Not available under DeepSpeed: the classifying rerun (``step(..., rerun=closure)``: the
engine's ``step()`` takes no closure and DeepSpeed has already reduced, and under ZeRO-2/3
freed, the gradients a rerun would compare), the per-parameter gradient norms on spikes and
``grad_norm_origin`` (the origin checks flag, they take no norms); the replica check at ZeRO-3
(each rank holds a different slice of every parameter: no replica).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ampscope.integrations._swap import check_options, is_distributed
from ampscope.integrations.deepspeed import engine as ds
from ampscope.integrations.deepspeed import reduction
from ampscope.integrations.deepspeed.origin import (
    BoundaryGradientFlags,
    BucketGradientFlags,
    OwnGradientFlags,
)
from ampscope.integrations.deepspeed.step_reads import Flags, HostStep, StepReads
from ampscope.rank.capture import layout
from ampscope.rank.capture.layout import OptimizerSlot
from ampscope.rank.capture.pending import PendingStep
from ampscope.rank.config import (
    DEFAULT_REPLICA_CHECK_EVERY,
    SCALE_CLAMPS,
    check_replica_check_every,
    telemetry_config,
)
from ampscope.rank.frontends.base import TelemetryFrontEnd, warn_if_torch_changed
from ampscope.rank.gradients.stats import OptimizerNorms, TakenStats
from ampscope.reporter.schema import Policy, Setup

if TYPE_CHECKING:
    from ampscope.rank.replicas.check import ReplicaOutcome

__all__ = ["DeepSpeedMonitor", "instrument", "monitor_of"]

logger = logging.getLogger("ampscope")

_STATE = "_ampscope_monitor"
"""Attribute on the engine that holds its monitor (instrumenting twice changes nothing)."""


class _Closable:
    """The monitor's capture slot: something to close (the base's life cycle)."""

    def __init__(self, monitor: DeepSpeedMonitor) -> None:
        self._monitor = monitor

    def close(self) -> None:
        self._monitor._stop_observing()


class DeepSpeedMonitor(TelemetryFrontEnd):
    """Observes a DeepSpeed engine: one record per rank and optimizer step. Built by
    :func:`instrument`; not meant to be constructed by hand.

    Speaks the front-ends' public API: ``telemetry``, ``note_batch``, ``close``.
    """

    def __init__(self, *, track_origin: bool | None, telemetry: dict[str, Any]) -> None:
        config = telemetry_config("instrument", telemetry, scale=True)
        warn_if_torch_changed()
        self._ampscope_start(config, True)
        self._ampscope_capture = _Closable(self)
        self._track_origin = track_origin
        self.engine: Any = None
        """The engine observed; ``None`` until bound (the Trainer and Accelerate bind it
        when ``accelerator.prepare()`` builds it)."""
        self._fp16 = False
        """Records read as a loss scaler's: ``"fp16"``, or ``torch_autocast`` in fp16."""
        self._autocast = False
        """DeepSpeed's ``torch_autocast`` fp16 mode: a torch ``GradScaler`` scales."""
        self._scaled_norm = False
        self._policy: Policy = "skip"
        self._warned_applied = False
        self._setups: dict[Policy, Setup] = {}
        self._steps = 0
        self._dtypes = ""
        self._slot: OptimizerSlot | None = None
        self._flags: Flags | None = None
        self._reduced: BoundaryGradientFlags | None = None
        """The reduced gradients' check, where DeepSpeed gives no global verdict."""
        self._unwrap_reduction: Any = None
        self._device = "cpu"
        self._on = _cpu()
        self._refused = False
        """:meth:`attach` was refused a PipelineEngine (logged once)."""

    def attach(
        self,
        model: nn.Module,
        track_origin: bool = False,
        *,
        fp8_every: int | None = None,
        replica_check_every: int | None = None,
    ) -> None:
        """Observe ``model`` when it is a DeepSpeed engine (and none is observed yet);
        anything else is left alone: the engine's module names the parameters. The
        Trainer and Accelerate integrations call it with what ``prepare()`` returned.
        ``replica_check_every``: as for :func:`instrument`'s option of that name (``None``:
        the option's value); the ZeRO-3 note of :meth:`attach_replicas` applies. A
        ``PipelineEngine`` that :meth:`bind` refuses is logged once and left alone.

        Raises:
            ValueError: ``replica_check_every`` is not an int >= 0.
        """
        if replica_check_every is not None:
            check_replica_check_every(replica_check_every)
        if self._refused:
            return
        if self.engine is None and is_engine(model) and self._ampscope_capture is not None:
            try:
                self.bind(model)
            except NotImplementedError as refused:  # a PipelineEngine ampscope cannot see
                self._refused = True
                logger.warning("%s; training goes on unobserved", refused)
                return
            self.attach_replicas(replica_check_every)

    def bind(self, engine: Any) -> None:
        """Start observing ``engine``: wrap its ``backward`` and ``step`` (a
        ``PipelineEngine``'s: the optimizer step its ``train_batch()`` takes), set up the
        origin check (before the boundary's reduction at ZeRO-0/1, pipeline engines
        included, before each bucket's at ZeRO-2/3, a hook per parameter on engines not
        recognised and pipelines with tied weights), name the parameters. Once, before its
        first backward.

        Raises:
            RuntimeError: an engine is already observed.
            NotImplementedError: a ``PipelineEngine`` whose optimizer step is not where
                ampscope knows it (another DeepSpeed release); nothing is hooked.
        """
        if self.engine is not None:
            raise RuntimeError("this monitor already observes an engine")
        # A PipelineEngine steps inside train_batch(): its optimizer step is observed instead
        # of step() (refused here, before anything is hooked, where a release moved it).
        own_pipeline_step = ds.pipeline_step(engine) if ds.is_pipeline(engine) else None
        self.engine = engine
        self._read_precision(engine)
        module = _module(engine)
        self._dtypes = "+".join(
            sorted({str(p.dtype).removeprefix("torch.") for p in module.parameters()})
        )
        self._slot = OptimizerSlot(
            index=0,
            name=type(engine.optimizer).__name__,
            fused=False,
            stepped=True,
            num_flags=1,
        )
        self._ampscope_names.attach(module)
        self._ampscope_attach_fp8(module, self._ampscope_config.fp8_every)
        track = self._track_origin
        if is_distributed() if track is None else track:
            self._flags = self._origin_flags(engine, module)
        self._on = _first_device(module)
        self._device = str(self._on)
        if own_pipeline_step is not None:
            self._own_step = own_pipeline_step
            ds.route_pipeline_step(engine, self._pipeline_step)
        else:
            self._own_step = engine.step
            self._own_backward = engine.backward
            engine.step = self._step
            engine.backward = self._backward
        setattr(engine, _STATE, self)

    def attach_replicas(self, every: int | None = None) -> None:
        """Compare the bound engine's module parameters with their replicas after the
        boundary ``step()`` on one in ``every`` of them (``None``: the monitor's
        ``replica_check_every`` option; 0: never). At ZeRO 0-2 every rank of DeepSpeed's
        data-parallel group holds them whole (MoE experts: their expert data-parallel
        group); ZeRO-3 partitions them (each rank a different slice), so nothing is
        compared there and the log says so once. Every rank must call it alike (the
        check's all-gathers pair up by call order). Never raises."""
        engine = self.engine
        if every is None:
            every = self._ampscope_config.replica_check_every
        asked = every != DEFAULT_REPLICA_CHECK_EVERY  # the default says so at INFO only
        self._ampscope_replicas = None
        if engine is None or not every:
            return
        try:
            if ds.zero_stage(engine) >= 3:
                logger.log(
                    logging.WARNING if asked else logging.INFO,
                    "ampscope: replica checks are not made under DeepSpeed ZeRO-3: the "
                    "parameters are partitioned, every rank holds a different slice "
                    "(replica_check_every=%d is ignored)",
                    every,
                )
                return
            from ampscope.rank.replicas.check import ReplicaCheck
            from ampscope.rank.replicas.groups import deepspeed_sets

            sets = deepspeed_sets(ds.replicated_parameters(engine, _module(engine)))
            check = ReplicaCheck(None, every, sets=sets)
        except Exception:
            # Identically on every rank (same engine): the check is off, training goes on.
            logger.warning("ampscope: replica check off for this engine", exc_info=True)
            return
        self._ampscope_replicas = check if check.compares else None

    def _read_precision(self, engine: Any) -> None:
        self._autocast = ds.autocast_scaler(engine) is not None
        self._autocast_clean = 0
        self._fp16 = ds.fp16(engine) or self._autocast
        self._scaled_norm = ds.autocast_norm_is_scaled(engine)
        self._policy = "skip" if self._fp16 or ds.checks_overflow(engine) else "observe"

    def _origin_flags(self, engine: Any, module: nn.Module) -> Flags:
        """The origin check right before DeepSpeed's reduction: one check at the boundary
        where DeepSpeed reduces only there (ZeRO-0/1), one per bucket at ZeRO-2 and ZeRO-3,
        elsewhere (ZeRO-2/3 offload, ZenFlow, paths not recognised) one tensor hook per
        parameter."""
        # Only the gradients DeepSpeed steps on: one it does not step (a parameter not given
        # to deepspeed.initialize) says nothing of the step, and is never zeroed: its sum
        # over the steps can overflow in fp16 without anything wrong with a step.
        named = list(module.named_parameters())
        stepped = ds.stepped_parameters(engine)
        checked = [(n, p) for n, p in named if stepped is None or id(p) in stepped]
        if not checked:  # the optimizer holds copies, not the module's parameters: all
            checked = named
        if reduction.reduces_at_boundary_only(engine):
            boundary = BoundaryGradientFlags(checked)
            after = None
            if not ds.gives_global_verdict(engine):
                # ZeRO-0 fp32: no overflow flag, no norm. The same check of the reduced
                # gradients gives every rank the global flag (found_inf_global).
                self._reduced = BoundaryGradientFlags(checked)
                after = self._reduced.check
            self._unwrap_reduction = reduction.check_before_reduction(engine, boundary.check, after)
            return boundary
        if reduction.reduces_per_bucket(engine):
            buckets = BucketGradientFlags(checked, reduction.param_id(engine))
            self._unwrap_reduction = reduction.check_each_bucket(engine, buckets.check)
            return buckets
        if reduction.reduces_per_partition_bucket(engine, module.parameters()):
            partitions = BucketGradientFlags(checked, reduction.partition_param_id)
            self._unwrap_reduction = reduction.check_each_partition_bucket(engine, partitions.check)
            return partitions
        return OwnGradientFlags(checked)

    def get_scale(self) -> float:
        """DeepSpeed's loss scale now (fp16); 1.0 under bf16/fp32 or before an engine."""
        return 1.0 if self.engine is None else ds.loss_scale(self.engine)

    # -- the engine's calls --------------------------------------------------------------

    def _backward(self, loss: Any, *args: Any, **kwargs: Any) -> Any:
        stats = self._ampscope_stats
        if stats is not None:
            try:
                stats.add_loss(loss)
            except Exception:
                self._ampscope_failed()
        return self._own_backward(loss, *args, **kwargs)

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        engine = self.engine
        boundary = ds.optimizer_step_call(engine)
        if self._ampscope_capture is None:
            result = self._own_step(*args, **kwargs)
            if boundary:  # a closed rank keeps its part in the replica check's collective
                self._ampscope_check_replicas()
            return result
        before = self._ampscope_guard(ds.scale_now, engine) if boundary else None
        if boundary and self._flags is not None and not ds.inside_no_sync(engine):
            # Never raises; nothing when the reduction checked. Not where step() is about to
            # raise (inside no_sync/coalesce_grad_reduction): the block's own check comes later.
            self._flags.check_now()
        result = self._own_step(*args, **kwargs)
        if boundary:
            # After DeepSpeed's step (its all-gather included), applied or skipped, on
            # every rank whatever fails below: the check's all-gather is a collective.
            replicas = self._ampscope_check_replicas()
            try:
                self._record(1.0 if before is None else before, replicas)
            except Exception:
                self._ampscope_failed()
                self._discard_flags()
        return result

    def _discard_flags(self) -> None:
        """Drop the flags of a step whose record failed, so that the next step reports its
        own gradients, not this one's inf/NaN as its own."""
        for flags in (self._flags, self._reduced):
            if flags is not None:
                self._ampscope_guard(flags.take_on_device)

    def _pipeline_step(self, *args: Any, **kwargs: Any) -> Any:
        """A ``PipelineEngine``'s optimizer step, inside ``train_batch()`` on every rank
        (the boundary forced): this stage's losses noted as :meth:`_backward` notes them
        (the last stage's; the engine's ``backward()`` is not called), then the step
        observed as :meth:`_step` observes it."""
        stats = self._ampscope_stats
        if stats is not None and self._ampscope_capture is not None:
            try:
                for loss in ds.pipeline_losses(self.engine):
                    stats.add_loss(loss)
            except Exception:
                self._ampscope_failed()
        return self._step(*args, **kwargs)

    def _record(self, before: float | torch.Tensor, replicas: ReplicaOutcome | None = None) -> None:
        """Close the optimizer step DeepSpeed just took (training thread): DeepSpeed's host
        state read, every device value on its way to the host unread (:class:`StepReads`);
        the telemetry thread decides and lays out the record (:meth:`lay_out`)."""
        engine = self.engine
        self._steps += 1
        identity = self._ampscope_identity_now()  # a collective in the first step
        stats = self._ampscope_stats
        taken = None if stats is None else stats.take({})
        loss = None if taken is None else taken.loss
        reads = StepReads(engine, before, self._flags, self._reduced, loss, self._on)
        pending = PendingStep(
            identity,
            self._steps,
            time.time(),
            False,
            optimizers=(self._slot,) if self._slot is not None else (),
            local_devices=(self._device,),
            origin_devices=reads.origin_devices,
        )
        pending.deferred = (self, reads, taken)
        pending.replicas = replicas
        fp8 = self._ampscope_take_fp8()
        if fp8 is not None:
            pending.extra, pending.fp8 = fp8
        self._ampscope_telemetry.submit(pending)

    def lay_out(self, pending: PendingStep, reads: StepReads, taken: TakenStats | None) -> None:
        """Decide what the step did from its host values and lay out its record (the
        telemetry thread, :meth:`PendingStep.read`, in step order: the policy, the warning
        and the growth tracker count steps here)."""
        step = reads.read()
        own = any(step.origin.values())
        # torch_autocast: torch's GradScaler skips exactly the steps it backs off on, and
        # at ZeRO-0 the engine still says it applied them (was_step_applied, skipped_steps).
        scaler_skipped = self._autocast and step.after < step.before
        applied = step.applied and not scaler_skipped
        # What really happened: DeepSpeed's overflow, or a non-finite global norm (which
        # DeepSpeed computes even where it does not check: check_grad_overflow=false), or
        # this rank's own gradients, or the reduced ones (ZeRO-0 fp32: no overflow, no
        # norm; every rank sees them), or the GradScaler's skip.
        found = step.overflow or not ds.finite(step.norm) or own or step.reduced or scaler_skipped
        if found and applied:
            # That is what DeepSpeed does with them: the setup says so from now on, and
            # each such step counts in nonfinite_applied (pending.applied), fp16 or not.
            self._policy = "observe"
            if not self._warned_applied:
                self._warned_applied = True
                logger.warning(
                    "ampscope: DeepSpeed applied optimizer step %d on inf/NaN gradients "
                    "(DeepSpeed's overflow flag: %s)",
                    pending.step,
                    step.overflow,
                )
        before, after = step.before, step.after
        if self._autocast:
            # DeepSpeed updates its GradScaler once per parameter group (ZeRO 1-2) or
            # sub-group (ZeRO-3) in a step, so torch's tracker counts those, and a growth
            # on any but the last leaves it non-zero: count the steps here instead.
            self._autocast_clean = 0 if found or after != before else self._autocast_clean + 1
            tracker = self._autocast_clean
        else:
            tracker = ds.growth_tracker(step.counters, found, before, after) if self._fp16 else 0
        flag = float(found)
        pending.values = layout.head(before, [flag, flag]) + layout.tail(
            after, float(tracker), [float(v) for v in step.origin.values()]
        )
        pending.nonfinite = step.named
        pending.setup = self._setup()
        pending.applied = applied
        pending.stats = None if taken is None else self._stats_of(taken, step)

    def _setup(self) -> Setup:
        setup = self._setups.get(self._policy)
        if setup is None:
            setup = self._setups[self._policy] = Setup(
                mode="scaler" if self._fp16 else "watch",
                policy=self._policy,
                grad_dtype=self._dtypes or None,
            )
        return setup

    def _stats_of(self, taken: TakenStats, step: HostStep) -> TakenStats:
        """The step's stats as CPU tensors (the host transport's, which the record's
        builder reads): the loss and DeepSpeed's norm, squared (telemetry thread)."""
        norm = step.norm
        optimizers: tuple[OptimizerNorms, ...] = ()
        if norm is not None:
            square = torch.tensor(norm * norm if ds.finite(norm) else norm, dtype=torch.float64)
            # torch_autocast at ZeRO 1-3: the norm of the gradients still scaled by the
            # GradScaler (the record's builder divides it by the scale before the step).
            optimizers = (OptimizerNorms((), (), self._scaled_norm, square),)
        loss = None if step.loss is None else torch.tensor(step.loss, dtype=torch.float64)
        return TakenStats(loss, taken.loss_count, optimizers, {})

    def _stop_observing(self) -> None:
        if self._flags is not None:
            self._flags.remove()
            self._flags = None
        self._reduced = None
        if self._unwrap_reduction is not None:
            self._unwrap_reduction()
            self._unwrap_reduction = None


def instrument(
    engine: Any,
    *,
    track_origin: bool | None = None,
    **scaler_options: Any,
) -> DeepSpeedMonitor:
    """Observe ``engine`` (a ``deepspeed.DeepSpeedEngine``, or a ``PipelineEngine``): one
    record per rank at every gradient-accumulation boundary. Call once on every rank, after
    ``deepspeed.initialize`` and before the first ``engine.backward`` (``train_batch``);
    calling it again returns the same monitor, also once closed (then it records nothing,
    and a warning says so: a second monitor would add its own part to the replica check's
    collective on this rank only).

    With ``replica_check_every=N`` among the options (default 100; 0: off), every rank
    compares the engine's module parameters bit for bit with the rest of DeepSpeed's
    data-parallel group after one boundary ``step()`` in ``N`` (ZeRO 0-2; not at ZeRO-3,
    whose parameters are partitioned). Every rank must use the same ``N``.

    Wraps ``engine.backward`` (notes the rank's loss) and ``engine.step`` (reads what
    DeepSpeed decided after a boundary step) as instance attributes; for origin tracking,
    at ZeRO-0/1 ``engine.allreduce_gradients`` too (a check before the boundary's
    reduction), at ZeRO-2 its optimizer's ``reduce_ipg_grads`` and at ZeRO-3 its
    ``__reduce_and_partition_ipg_grads`` (a check before each bucket's), elsewhere one
    tensor hook per parameter. DeepSpeed's numerics are unchanged.
    A ``PipelineEngine`` (whose ``backward()`` and ``step()`` are disabled): the optimizer
    step its ``train_batch()`` takes is wrapped instead, and the last stage's micro-batch
    losses are read there; each stage checks and names its own parameters.

    Args:
        engine: The engine ``deepspeed.initialize`` returned.
        track_origin: ``None`` (default): on when the process group has more than one
            rank; ``False``: no origin checks, no hooks and no wraps (records carry no
            origin and name no parameters).
        **scaler_options: Telemetry options of :class:`ampscope.GradScaler` (``run_id``,
            ``reporter``, ``sinks``, ``top_k``, ``stats``, ``replica_check_every``...).
            The loss scaling stays
            DeepSpeed's: ``min_scale``/``max_scale`` are refused.

    Returns:
        The monitor: ``monitor.telemetry.snapshot()``, ``monitor.note_batch(ids)``,
        ``monitor.close()``.

    Raises:
        TypeError: ``engine`` is not a DeepSpeed engine, or an unknown option.
        ValueError: a bad option value, or a scale clamp.
        NotImplementedError: a ``PipelineEngine`` of a DeepSpeed release whose optimizer
            step is not where ampscope knows it (the message says what to do instead).
    """
    existing = monitor_of(engine)
    if existing is not None:
        if existing._ampscope_closed:
            logger.warning(
                "ampscope: instrument() found this engine's monitor closed; it records "
                "nothing more for this engine (one monitor per engine, for the life of the "
                "engine)"
            )
        return existing
    if not is_engine(engine):
        raise TypeError(f"instrument() needs a DeepSpeed engine, not {type(engine).__name__}")
    monitor = make_monitor(track_origin, scaler_options)
    try:
        monitor.bind(engine)
    except NotImplementedError:
        monitor.close()  # nothing bound: its telemetry stops with it
        raise
    monitor.attach_replicas()
    return monitor


def make_monitor(track_origin: bool | None, scaler_options: dict[str, Any]) -> DeepSpeedMonitor:
    """A monitor with the user's telemetry options, no engine bound yet.

    Raises:
        TypeError: an unknown option; ValueError: a bad value, or a scale clamp.
    """
    check_options(scaler_options)
    clamps = [name for name in SCALE_CLAMPS if scaler_options.get(name) is not None]
    if clamps:
        raise ValueError(f"DeepSpeed's loss scaling is its own; {', '.join(clamps)} do not apply")
    options = {k: v for k, v in scaler_options.items() if k not in SCALE_CLAMPS}
    return DeepSpeedMonitor(track_origin=track_origin, telemetry=options)


def monitor_of(engine: Any) -> DeepSpeedMonitor | None:
    """The monitor observing ``engine``, if any."""
    monitor = getattr(engine, _STATE, None)
    return monitor if isinstance(monitor, DeepSpeedMonitor) else None


def is_engine(obj: Any) -> bool:
    """Whether ``obj`` is a DeepSpeed engine (duck-typed: DeepSpeed is never imported)."""
    return all(
        callable(getattr(obj, name, None))
        for name in ("was_step_applied", "is_gradient_accumulation_boundary", "backward", "step")
    )


def _module(engine: Any) -> nn.Module:
    module = getattr(engine, "module", engine)
    return module if isinstance(module, nn.Module) else engine


@functools.cache
def _cpu() -> torch.device:
    return torch.device("cpu")


def _first_device(module: nn.Module) -> torch.device:
    for param in module.parameters():
        return param.device
    return _cpu()
