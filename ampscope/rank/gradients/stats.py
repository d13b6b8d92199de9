"""The iteration's loss and gradient norms, gathered on the training thread at the least cost.

:class:`GradStats` sees three things per iteration, each where the front-end already is:

* ``scale(loss)``: the loss, detached (no copy, no kernel); with gradient accumulation
  the next ones are added into one device tensor (one add per extra micro-batch) and
  counted, so the record holds their mean.
* the unscale pass (a scaler's ``_unscale_grads_``, a watch's non-finite check): right
  after torch's kernel, one ``torch._foreach_norm`` over the optimizer's local gradients
  (one more read of gradient memory). Sharded gradients (FSDP1 flat shards,
  FSDP2/tensor-parallel DTensor shards) add a stack, a dot product and one all-reduce
  (sum) of that one-element squared norm per mesh layout, issued by every rank at the
  same place every iteration, clean or not, so no rank waits alone. Where the loop's clip
  keeps its norms (the front-end's ``clip_grad_norm_``; an integration's repeat of its
  library's clip, announced by ``expect_clip()``), the norms are left to that clip's pass
  and its total stands for the all-reduce (an announced clip that does not keep them: the
  local norms are taken before it, its total still stands for the sum).
* update(): :meth:`GradStats.take` hands the tensors to the pending step, which moves them
  like the scale: on the CPU the telemetry thread reads them (host memory; nothing
  writes them any more), on accelerators they join the step's one non-blocking copy.

Nothing here reads a device value on the host. The telemetry thread turns the values into
a :class:`~ampscope.reporter.schema.StepStats` (:mod:`ampscope.rank.telemetry.stats_record`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ampscope.rank import compat
from ampscope.rank.capture.registry import OptimizerInfo
from ampscope.rank.gradients.names import ParamNames
from ampscope.rank.gradients.norm_batches import NormBatches

SquareSumReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a 0-dim local squared norm over the ranks that hold the other shards."""


def sum_over(group: Any) -> SquareSumReduce:
    """A reduce that all-reduces (sum) a squared norm over ``group`` (``None``: the default
    group) when it has several ranks; decided per call, identically on every rank."""

    def reduce(square: torch.Tensor) -> torch.Tensor:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(square, op=dist.ReduceOp.SUM, group=group)
        return square

    return reduce


@dataclass(frozen=True)
class NormPlan:
    """How one optimizer's gradients become named norms; rebuilt when its parameter groups
    or the attached names change. Shared by every iteration's :class:`OptimizerNorms`."""

    names: tuple[str, ...]
    """One per norm, in the order of the norms (a parameter, or a FlatParameter's segment)."""
    segments: tuple[tuple[int, int, int | None], ...]
    """Per norm: (parameter index, offset, numel or ``None`` for the whole gradient)."""
    reductions: tuple[tuple[compat.FoundInfReduction, tuple[int, ...]], ...]
    """DTensor gradients: for each mesh layout, the norms whose squares it sums."""
    whole: tuple[int, ...]
    """With ``reductions``: the norms of gradients every rank holds whole (plain tensors,
    replicated DTensors), added once."""
    groups: int
    names_version: int
    simple: bool
    """One whole gradient per parameter, in order (no FlatParameter segments)."""
    params: tuple[torch.Tensor, ...]
    """The optimizer's parameters, in order: re-read, like the plan, only when a parameter
    group is added (as torch's optimizers change them). The plan lives on the optimizer's
    :class:`~ampscope.rank.capture.registry.OptimizerInfo`, as long as the capture does."""
    low_precision: bool
    """Some parameter (hence its gradient) is narrower than float32: norms in float32."""
    device: torch.device
    """Where the plain gradients' squared norm is all-reduced (the first parameter's
    device; the CPU without parameters)."""
    batches: NormBatches | None = None
    """A simple plan's norms as the CPU computes them (:class:`NormBatches`)."""


class OptimizerNorms:
    """One optimizer's norms of one iteration (immutable once built)."""

    __slots__ = ("count", "names", "norms", "packed", "scaled", "square")

    def __init__(
        self,
        names: tuple[str, ...],
        norms: tuple[torch.Tensor, ...],
        scaled: bool,
        square: torch.Tensor | None,
        packed: torch.Tensor | None = None,
    ) -> None:
        self.names = names
        self.packed = packed
        """The per-parameter norms already in one 1-D tensor (a clip's stacked norms);
        then ``norms`` is empty."""
        self.count = len(norms) if packed is None else len(packed)
        """How many per-parameter (segment) norms there are."""
        self.norms = norms
        """The per-parameter (segment) norms of the local gradients: float32 0-dim
        tensors, all on one device, not stacked (the host transport stacks them on the
        telemetry thread, the device transport in its copy)."""
        self.scaled = scaled
        """The norms are of the still scaled gradients (a fused optimizer's check, which
        unscales nothing): the telemetry thread divides them by the scale."""
        self.square = square
        """Sharded gradients: the squared norm of the optimizer's whole gradient, summed
        over the ranks (0-dim float32). ``None``: the local norms are the whole gradient's
        and the telemetry thread sums their squares."""


class TakenStats:
    """What :meth:`GradStats.take` hands to update(): tensors and how to read them.

    The tensors are fresh (nothing writes them after the iteration), except a single
    micro-batch's loss, a detached view of the loss the training loop holds.
    """

    __slots__ = ("loss", "loss_count", "optimizers", "origin")

    def __init__(
        self,
        loss: torch.Tensor | None,
        loss_count: int,
        optimizers: tuple[OptimizerNorms, ...],
        origin: Mapping[str, torch.Tensor],
    ) -> None:
        self.loss = loss
        self.loss_count = loss_count
        self.optimizers = optimizers
        self.origin = origin
        """Per device: this rank's own squared gradient norm, in the units its gradient
        collective saw them (scaled by the loss scale, undivided)."""

    def scalars(self) -> list[torch.Tensor]:
        """The one-value tensors, in the order the device transport copies them: the loss
        sum (if any), each sharded optimizer's squared norm, each device's origin squared
        norm. :meth:`named` reads them back."""
        out = [] if self.loss is None else [self.loss]
        out += [o.square for o in self.optimizers if o.square is not None]
        out += self.origin.values()
        return out

    def named(
        self, values: Sequence[float]
    ) -> tuple[float | None, list[float | None], Sequence[float]]:
        """The host values of :meth:`scalars`, in its order from ``values[0]``, by name:
        the loss sum (``None`` without a loss), per optimizer its summed squared norm
        (``None`` where the local norms are the whole gradient's), the origin squares."""
        at = 0
        loss = None
        if self.loss is not None:
            loss, at = values[0], 1
        squares: list[float | None] = []
        for optimizer in self.optimizers:
            if optimizer.square is None:
                squares.append(None)
            else:
                squares.append(values[at])
                at += 1
        return loss, squares, values[at : at + len(self.origin)]

    def norm_count(self) -> int:
        return sum(o.count for o in self.optimizers)


class GradStats:
    """Per-front-end gatherer of the loss and gradient norms (training thread only).

    Args:
        names: The front-end's parameter names (``attach``): the norms' names.
        reduce: Sums a squared norm over the data-parallel group for plain sharded
            gradients (FSDP1's ``ShardedGradScaler``); ``None``: plain gradients are whole.
    """

    def __init__(self, names: ParamNames, reduce: SquareSumReduce | None = None) -> None:
        self._names = names
        self.reduce = reduce
        """Settable: ``attach`` sets it from the model (FSDP1 sharded or ``NO_SHARD``)."""
        self._loss: torch.Tensor | None = None
        self._loss_count = 0
        self._optimizers: list[OptimizerNorms] = []
        self._empty: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.pack_on_cpu = False
        """Stack the norms on the training thread on the CPU too, as on accelerators
        (tests run the accelerators' path on the CPU)."""
        self.defer = True
        """Settable: whether :meth:`add_grads` may leave the norms to the loop's clip
        (a front-end turns it off inside ``step()``, after which no clip can come)."""
        self._clips = False
        """The last iteration clipped through the front-end (:meth:`clipped`): the next
        ones defer their norms to the clip, until one ends without it."""
        self.clip_ahead = False
        """Settable (:meth:`~ampscope.rank.frontends.base.TelemetryFrontEnd.expect_clip`):
        a clip that keeps its norms comes right after this check, so :meth:`add_grads`
        leaves the norms of every one-norm-per-parameter plan to it, sharded (DTensor)
        gradients included, from this iteration on; :meth:`before_clip` ends it. Every
        rank must set it alike: a sharded plan's all-reduce moves to the clip."""
        self._clipped = False
        self._from_clip = False
        """The deferred norms wait for a clip ``clip_ahead`` announced: their sum over
        the ranks is the clip's total, never an all-reduce of ampscope's own (a closed rank
        pairs none), whether or not the clip keeps them."""
        self._owed: tuple[tuple[str, ...], tuple[torch.Tensor, ...], bool] | None = None
        """Local norms taken before a clip that did not keep them (:meth:`before_clip`),
        whose squared sum over the ranks :meth:`after_unkept_clip` takes from the clip's
        total: their names, the norms, whether the clip's parameters are exactly theirs."""
        self._deferred: list[tuple[OptimizerInfo, NormPlan]] = []
        self._clip_names: dict[tuple[Any, ...], tuple[str, ...] | None] = {}
        """Per (parameter ids, plan ids): the clip's names in its order, or ``None``."""
        self._closed_sums: dict[tuple[int, int], bool] = {}
        """Per (optimizer id, parameter count): whether its norm is summed over ranks."""

    def add_loss(self, outputs: object) -> None:
        """Note what ``scale()`` got, when it is one loss value (a one-element tensor);
        anything else (several outputs) is not a loss and is left out. A detach, then an
        add per further call of the same iteration; no sync."""
        if not isinstance(outputs, torch.Tensor):
            return
        if outputs.ndim:  # a reshape is an op: only for a one-element vector
            if outputs.numel() != 1:
                return
            loss = outputs.detach().reshape(())
        else:
            loss = outputs.detach()
        if self._loss is None:
            self._loss = loss
        else:
            self._loss = self._loss + loss.to(self._loss.device)
        self._loss_count += 1

    def peek_loss(self) -> torch.Tensor | None:
        """The loss sum of this iteration so far (``None`` without a loss)."""
        return self._loss

    @property
    def loss_count(self) -> int:
        """How many losses :meth:`add_loss` summed this iteration so far."""
        return self._loss_count

    def peek_square(self) -> torch.Tensor | None:
        """The squared norm of the gradients normed so far this iteration, as the record's
        ``grad_norm`` counts them (sharded ones summed over the ranks): a 0-dim float32
        tensor on the first optimizer's device; ``None`` before any (norms of still scaled
        gradients are left out). A stack and a dot per optimizer; no sync."""
        parts = []
        for optimizer in self._optimizers:
            if optimizer.scaled:
                continue
            if optimizer.square is not None:
                parts.append(optimizer.square)
            elif optimizer.count:
                packed = optimizer.packed
                norms = torch.stack(optimizer.norms) if packed is None else packed.float()
                parts.append(torch.dot(norms, norms))
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        device = parts[0].device
        return torch.stack([part.to(device) for part in parts]).sum()

    def restart(self) -> torch.Tensor | None:
        """Forget this iteration so far, for a rerun that recomputes it: returns the loss
        sum it had (``None`` without a loss); the norms are dropped. No kernel, no sync."""
        loss, self._loss, self._loss_count = self._loss, None, 0
        self._optimizers = []
        self._deferred = []
        self._clipped = self.clip_ahead = self._from_clip = False
        self._owed = None
        return loss

    def add_grads(
        self,
        optimizer: torch.optim.Optimizer,
        info: OptimizerInfo | None,
        scaled: bool,
        grads: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, ...] | torch.Tensor | None:
        """Norm ``optimizer``'s local gradients (after their unscale, or ``scaled`` when
        the check unscaled nothing): one multi-tensor norm per device (on the CPU, a few
        ops whatever the number of gradients: :class:`NormBatches`). Sharded gradients add
        a stack, a dot and one all-reduce per mesh layout; every rank calls this for the
        same optimizers in the same order, and the all-reduces run whatever fails here
        (the local norms, the plan, or the capture, which then passes ``info=None``): this
        rank then contributes NaN, and the error is raised afterwards, so that no rank
        waits alone.

        ``grads``: the optimizer's gradients in the order of its parameters, all present
        and dense, where the caller has just read them (the scalers' unscale); else read
        here.

        Returns:
            In the common case (every parameter has a dense, whole, non-DTensor gradient,
            and nothing is summed over ranks) the norms, one per gradient, in which an
            inf/NaN element always shows as a non-finite norm: a tuple of 0-dim tensors or
            one vector, in an order of the plan's; else ``None``.
        """
        try:
            if info is None:
                raise RuntimeError("the capture could not register the optimizer")
            plan: NormPlan | None = info.norm_plan
            if (
                plan is None
                or plan.groups != info.groups
                or plan.names_version != self._names.version
            ):
                plan = info.norm_plan = self._build_plan(optimizer, info.groups)
        except Exception:
            self._sum_nothing(optimizer)
            raise
        if self.clip_ahead and not scaled and plan.simple and self.reduce is None:
            # The clip about to run norms these gradients (and sums sharded ones).
            self._deferred.append((info, plan))
            self._from_clip = True
            return None
        if not plan.reductions and self.reduce is None:
            if self._clips and self.defer and not scaled and plan.simple and info.place:
                # The loop clips through the front-end: its pass norms these gradients.
                self._deferred.append((info, plan))
                return None
            if plan.simple and not info.dtensor:
                # The common case, inlined: one dense gradient per parameter, named whole.
                if grads is None or len(grads) != len(plan.params):
                    grads = _dense([p.grad for p in plan.params])
                if grads is not None:
                    place = info.place
                    if (
                        place is not None
                        and place[0].type == "cpu"
                        and not self.pack_on_cpu
                        and plan.batches is not None
                    ):
                        packed = plan.batches.norms(grads, plan.low_precision)
                        self._optimizers.append(
                            OptimizerNorms(plan.batches.names, (), scaled, None, packed=packed)
                        )
                        return packed
                    each = compat.foreach_norm(grads, plan.low_precision)
                    if place is None:
                        each = _on_one_device(each)
                    else:
                        # One stacked vector from here on (one launch): the step keeps one
                        # small block in flight, not one per parameter.
                        packed = torch.stack(each)
                        self._optimizers.append(
                            OptimizerNorms(plan.names, (), scaled, None, packed=packed)
                        )
                        return each
                    self._optimizers.append(OptimizerNorms(plan.names, each, scaled, None))
                    return each
            self._optimizers.append(
                OptimizerNorms(plan.names, self._local_norms(plan, info), scaled, None)
            )
            return None
        self._add_summed(plan, info, scaled)
        return None

    def _add_summed(self, plan: NormPlan, info: OptimizerInfo, scaled: bool) -> None:
        """Sharded gradients' local norms and their squared norm summed over the ranks;
        the all-reduces run whatever fails (this rank then adds NaN, then raises)."""
        failure: Exception | None = None
        local: tuple[torch.Tensor, ...] | None
        try:
            local = self._local_norms(plan, info)
        except Exception as exc:
            failure, local = exc, None
        square = self._summed_square(plan, local)
        if failure is not None or local is None:
            raise failure or RuntimeError("no local gradient norms")
        self._optimizers.append(OptimizerNorms(plan.names, local, scaled, square))

    def _local_norms(self, plan: NormPlan, info: OptimizerInfo) -> tuple[torch.Tensor, ...]:
        """The plan's per-parameter (segment) norms of this rank's local gradients."""
        params = plan.params
        if plan.simple and not info.dtensor:
            # The common case: one dense gradient per parameter, named whole.
            grads = [p.grad for p in params]
            for grad in grads:
                if grad is None or grad.is_sparse:
                    break
            else:
                return _norms(grads, plan, info)  # type: ignore[arg-type]
        tensors: list[torch.Tensor] = []
        for index, offset, numel in plan.segments:
            param = params[index]
            grad = param.grad
            if grad is None:
                tensors.append(self._empty_like(param))
                continue
            local = compat.local_tensor(grad) if info.dtensor else grad
            if local.is_sparse:
                local = compat.sparse_values(local, coalesce=True)
            tensors.append(local if numel is None else local.reshape(-1).narrow(0, offset, numel))
        return _norms(tensors, plan, info)

    def _summed_square(
        self, plan: NormPlan, norms: tuple[torch.Tensor, ...] | None
    ) -> torch.Tensor:
        """The whole gradient's squared norm, summed over the ranks: one all-reduce per
        mesh layout (DTensors) or over the reduce's group. ``norms`` ``None`` (they
        failed): this rank adds NaN, and still takes part."""
        if plan.reductions:
            square: torch.Tensor | None = None
            for reduction, indices in plan.reductions:
                local = _local_square(norms, indices, reduction.mesh.device_type)
                summed = compat.reduce_square_sum(local, reduction)
                square = summed if square is None else square + summed
            assert square is not None
            if plan.whole:
                return square + _local_square(norms, plan.whole, square.device)
            return square
        assert self.reduce is not None
        every = tuple(range(len(plan.names)))
        return self.reduce(_local_square(norms, every, plan.device))

    def pair_closed(self, optimizer: torch.optim.Optimizer) -> None:
        """A closed front-end's part in the norm's all-reduces (:meth:`_summed_square`) the
        open ranks still make for ``optimizer``: the same all-reduces with NaN (that
        iteration's ``grad_norm`` is ``null`` on the open ranks, as for a rank whose norms
        fail), so no rank waits alone. Whether there are any is decided once per optimizer
        and parameter count (none for whole gradients: DDP, one rank)."""
        if self.clip_ahead:
            return  # the open ranks leave the sum to the clip (expect_clip)
        # O(parameter groups) per call; the parameters are walked once per key.
        key = (id(optimizer), sum(len(group["params"]) for group in optimizer.param_groups))
        sums = self._closed_sums.get(key)
        if sums is None:
            params = (p for group in optimizer.param_groups for p in group["params"])
            sums = self._closed_sums[key] = self.reduce is not None or any(
                compat.square_sum_reduction(param) is not None for param in params
            )
        if sums:
            self._sum_nothing(optimizer)

    def _sum_nothing(self, optimizer: torch.optim.Optimizer) -> None:
        """The all-reduces :meth:`_summed_square` makes for ``optimizer``, each with NaN:
        for a rank that cannot norm its gradients. Decided from the parameters alone (their
        mesh layouts), as every rank's plan decides them."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        layouts: dict[int, compat.FoundInfReduction] = {}
        for param in params:
            reduction = compat.square_sum_reduction(param)
            if reduction is not None:
                layouts.setdefault(_layout_key(reduction), reduction)
        if layouts:
            for reduction in layouts.values():
                compat.reduce_square_sum(
                    _local_square(None, (), reduction.mesh.device_type), reduction
                )
        elif self.reduce is not None:
            self.reduce(_local_square(None, (), _first_device(params)))

    def before_clip(
        self, params: list[torch.Tensor], keep: bool, *, sticky: bool = True
    ) -> tuple[str, ...] | None:
        """A clip is about to run over ``params``' gradients (each dense, none missing;
        :func:`~ampscope.rank.gradients.clip.clippable`). ``sticky`` (the front-end's own
        ``clip_grad_norm_``): from the next iteration on, :meth:`add_grads` leaves its
        norms to the clip; an integration's clip (``sticky=False``) is announced each
        iteration by ``expect_clip()`` instead.

        Returns the names of ``params``, in order, when the clip keeps its norms
        (``keep``) and they are exactly the parameters whose norms this iteration deferred
        (then :meth:`after_clip` takes the clip's); else ``None``, after norming the
        deferred gradients now, before the clip changes them: where ``expect_clip()``
        deferred sharded ones, their local norms only, whose sum over the ranks
        :meth:`after_unkept_clip` takes from the clip's total (no all-reduce of
        ampscope's own: a closed rank pairs none). Cost on a repeated call: a tuple of the
        parameters' ids, a dict lookup.
        """
        if sticky:
            self._clips = self._clipped = True
        self.clip_ahead = False
        deferred = self._deferred
        if not deferred:
            return None
        if not keep and not self._from_clip:
            self.resolve()
            return None
        ids = tuple(map(id, params))
        # The plans too: a rebuilt plan (new names, new parameters) is a new key.
        key = (ids, tuple((id(plan), plan.names_version, plan.groups) for _, plan in deferred))
        if key in self._clip_names:
            names = self._clip_names[key]
        else:
            if len(self._clip_names) >= _CLIP_KEYS:
                self._clip_names.clear()
            names = self._clip_names[key] = _names_in_order(ids, deferred)
        if keep and names is not None:
            return names
        if self._from_clip and any(plan.reductions for _, plan in deferred):
            self._take_local(names is not None)
        else:
            self.resolve()
        return None

    def _take_local(self, match: bool) -> None:
        """The deferred gradients' local norms, their sum over the ranks owed by the clip
        (:meth:`after_unkept_clip`); ``match``: the clip's parameters are exactly theirs."""
        deferred, self._deferred = self._deferred, []
        self._from_clip = False
        names: list[str] = []
        norms: list[torch.Tensor] = []
        for info, plan in deferred:
            names.extend(plan.names)
            norms.extend(self._local_norms(plan, info))
        self._owed = (tuple(names), tuple(norms), match)

    def after_unkept_clip(self, total: torch.Tensor | None) -> None:
        """The clip that did not keep its norms has run: the local norms
        :meth:`before_clip` took are this iteration's, with the square of its ``total``
        (summed over the ranks by the clip) as their squared sum where the clip's
        parameters were exactly theirs; else (or without a total) NaN: ``grad_norm`` is
        ``null``, as for a rank whose norms fail. One multiply; no sync."""
        owed, self._owed = self._owed, None
        if owed is None:
            return
        names, norms, match = owed
        if match and total is not None:
            square = total.detach().float()
            square = square * square
        else:
            square = torch.full((), math.nan, device=norms[0].device if norms else "cpu")
        self._optimizers.append(OptimizerNorms(names, norms, False, square))

    def after_clip(self, names: tuple[str, ...], norms: torch.Tensor, total: torch.Tensor) -> None:
        """Take the clip's per-parameter ``norms`` (stacked, in the order of ``names``)
        and ``total`` norm as the norms of the optimizers :meth:`before_clip` matched.
        One multiply on the device (the squared total); no sync."""
        self._deferred = []
        self._from_clip = False
        square = total.detach().float()
        self._optimizers.append(
            OptimizerNorms(names, (), False, square * square, packed=norms.detach())
        )

    @property
    def waiting(self) -> bool:
        """Some optimizer's norms wait for a clip (:meth:`resolve` takes them)."""
        return bool(self._deferred)

    def resolve(self) -> None:
        """Norm the gradients deferred to a clip that did not come (``step()``, before the
        optimizer runs) or did not keep its norms: as :meth:`add_grads` would have (sharded
        gradients with their all-reduces, every rank alike; those ``expect_clip()``
        deferred without: their ``grad_norm`` is ``null``), and stop deferring."""
        if self._from_clip and any(plan.reductions for _, plan in self._deferred):
            # The announced clip never came: no total, and no all-reduce either (a
            # closed rank pairs none after expect_clip()).
            self._take_local(False)
            self.after_unkept_clip(None)
        deferred, self._deferred = self._deferred, []
        self.clip_ahead = self._from_clip = False
        if not self._clipped:
            self._clips = False
        for info, plan in deferred:
            if plan.reductions:
                self._add_summed(plan, info, False)
                continue
            norms = self._local_norms(plan, info)
            self._optimizers.append(OptimizerNorms(plan.names, norms, False, None))

    def nonfinite_norm_names(self) -> tuple[set[str], set[str]] | None:
        """This iteration's per-parameter norms so far, read on the host: the names whose
        norm is inf/NaN, and every name normed (``None``: no norms yet). A device read
        (a sync on accelerators): call only where the host waits anyway, to name a
        skipped step's parameters. The norms are the gradients' right after the unscale,
        or the kept norms of a clip's pass, taken before it multiplied anything."""
        bad: set[str] = set()
        normed: set[str] = set()
        for optimizer in self._optimizers:
            if not optimizer.count:
                continue
            norms = optimizer.packed
            if norms is None:
                norms = torch.stack(optimizer.norms)
            values = norms.tolist()
            normed.update(optimizer.names)
            bad.update(
                n for n, v in zip(optimizer.names, values, strict=True) if not math.isfinite(v)
            )
        return (bad, normed) if normed else None

    def take(self, origin: Mapping[str, torch.Tensor]) -> TakenStats:
        """The iteration's values, then start the next iteration afresh (update())."""
        if self._deferred:
            self.resolve()
        if not self._clipped:
            self._clips = False
        self._clipped = self.clip_ahead = False
        self.after_unkept_clip(None)  # a clip that raised: nothing owed is left behind
        self.defer = True
        taken = TakenStats(self._loss, self._loss_count, tuple(self._optimizers), origin)
        self._loss, self._loss_count, self._optimizers = None, 0, []
        return taken

    def discard(self) -> None:
        """Forget the open iteration (its record could not be made)."""
        self._loss, self._loss_count, self._optimizers = None, 0, []
        self._deferred, self._clipped, self.defer = [], False, True
        self.clip_ahead = self._from_clip = False
        self._owed = None

    # -- internals -----------------------------------------------------------------------

    def _empty_like(self, param: torch.Tensor) -> torch.Tensor:
        local = compat.local_tensor(param)
        key = (local.device, local.dtype)
        empty = self._empty.get(key)
        if empty is None:
            empty = self._empty[key] = torch.empty(0, device=local.device, dtype=local.dtype)
        return empty

    def _build_plan(self, optimizer: torch.optim.Optimizer, groups: int) -> NormPlan:
        names: list[str] = []
        segments: list[tuple[int, int, int | None]] = []
        layouts: dict[int, tuple[compat.FoundInfReduction, list[int]]] = {}
        whole: list[int] = []
        params: list[torch.Tensor] = []
        index = 0
        for g, group in enumerate(optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                params.append(param)
                reduction = compat.square_sum_reduction(param)
                for segment in self._names.segments(param, g, i):
                    if reduction is not None:
                        key = _layout_key(reduction)
                        layouts.setdefault(key, (reduction, []))[1].append(len(segments))
                    else:
                        whole.append(len(segments))
                    names.append(segment.name)
                    segments.append((index, segment.offset, segment.numel))
                index += 1
        simple = segments == [(i, 0, None) for i in range(index)]
        batches = None
        if simple and params and not layouts and self.reduce is None:
            batches = NormBatches(tuple(names), tuple(params))
        return NormPlan(
            names=tuple(names),
            segments=tuple(segments),
            reductions=tuple((r, tuple(ix)) for r, ix in layouts.values()),
            whole=tuple(whole) if layouts else (),
            groups=groups,
            # Read after naming: a name lookup may re-walk the model (and bump it).
            names_version=self._names.version,
            simple=simple,
            params=tuple(params),
            device=_first_device(params),
            low_precision=any(p.dtype.itemsize < 4 for p in params if p.is_floating_point()),
            batches=batches,
        )


_CLIP_KEYS = 8
"""Distinct clip calls remembered (a loop clips one parameter list, or a few)."""


def _names_in_order(
    key: tuple[int, ...], deferred: list[tuple[OptimizerInfo, NormPlan]]
) -> tuple[str, ...] | None:
    """The names of the parameters whose ids are ``key``, in its order, when they are
    exactly the deferred optimizers' parameters; else ``None``."""
    by_id: dict[int, str] = {}
    for _, plan in deferred:
        for param, name in zip(plan.params, plan.names, strict=True):
            by_id[id(param)] = name
    if len(key) != len(by_id) or set(key) != by_id.keys():
        return None
    return tuple(by_id[k] for k in key)


def _layout_key(reduction: compat.FoundInfReduction) -> int:
    """One mesh layout's key: gradients of the same layout sum their squares in one
    all-reduce."""
    return hash((id(reduction.mesh), reduction.placements))


def _first_device(params: list[torch.Tensor]) -> torch.device:
    """Where plain gradients' squared norm is all-reduced: the first parameter's (local)
    device; the CPU without parameters."""
    return compat.local_tensor(params[0]).device if params else torch.device("cpu")


def _local_square(
    norms: tuple[torch.Tensor, ...] | None,
    indices: tuple[int, ...],
    device: torch.device | str,
) -> torch.Tensor:
    """The sum of the squares of ``norms[indices]`` (0-dim float32); NaN on ``device`` when
    the norms failed, 0 when there are none."""
    if norms is None:
        return torch.full((), math.nan, device=device)
    if not indices:
        return torch.zeros((), device=norms[0].device if norms else device)
    # Several mesh layouts (tensor parallelism): each one's norms.
    part = torch.stack(norms if len(indices) == len(norms) else [norms[i] for i in indices])
    return torch.dot(part, part)


def _norms(
    tensors: list[torch.Tensor], plan: NormPlan, info: OptimizerInfo
) -> tuple[torch.Tensor, ...]:
    """The tensors' L2 norms (float32, 0-dim), all on the first one's device."""
    if not tensors:
        return ()
    norms = compat.foreach_norm(tensors, plan.low_precision)
    return norms if info.place is not None else _on_one_device(norms)


def _dense(grads: list[torch.Tensor | None]) -> list[torch.Tensor] | None:
    """``grads`` when every one is present and dense; else ``None``."""
    for grad in grads:
        if grad is None or grad.is_sparse:
            return None
    return grads  # type: ignore[return-value]


def _on_one_device(norms: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The norms, moved to the first one's device (model parallelism on one rank)."""
    if not norms:
        return norms
    device = norms[0].device
    return tuple(n if n.device == device else n.to(device) for n in norms)
