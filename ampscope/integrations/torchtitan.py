"""torchtitan: one ``--override.imports`` entry, through torchtitan's own override mechanism.

::

    torchrun ... -m torchtitan.train --module llama3 --config llama3_8b \\
        --override.imports 'ampscope.integrations.torchtitan.gradwatch={"policy": "skip"}'

:func:`gradwatch` is a registered torchtitan override of ``LRSchedulersContainer.Config``,
the one component torchtitan builds with the optimizers container in hand: its
replacement, :class:`WatchedLRSchedulers`, builds the same LambdaLR schedulers and
installs a :class:`~ampscope.GradWatch` on the container's model parts and every one of
its optimizers. In each ``Trainer.train_step``:

* ``dist_utils.clip_grad_norm_``, which torchtitan calls once the gradients are reduced:
  the watch checks every optimizer's gradients first (``unscale_``: the non-finite check,
  the norms, under ``skip``/``raise`` the all-reduce every rank agrees on; a closed
  watch's check too, which keeps the ranks' collectives paired). Then, for a clip of
  exactly the watched model's parameters, the clip is ampscope's repeat of torchtitan's
  (:mod:`~ampscope.integrations._clip_repeat`: the 2-norm, no expert parallelism,
  gradients of one layout, torchtitan 0.3.0's code), bit for bit, whose pass gives the
  watch its norms, so the check makes no norm pass of its own; torchtitan's own function
  otherwise. ampscope wraps that function of
  ``torchtitan.distributed.utils`` for the life of the process; with no live watch the
  wrapper only calls it;
* ``optimizers.step()``: each optimizer's ``step()`` goes through ``watch.step()``
  (``skip`` does not step, ``raise`` raises on every rank);
* ``lr_schedulers.step()``: the schedulers step unless the watch skipped the iteration
  (they hold), then ``watch.update()``, one record per step.

Not covered: each rank's loss (torchtitan computes it in its loss component, another node
of the config, which one override cannot reach; records carry no loss and the loss spike
rule stays silent, the grad-norm rule works), and pipeline parallelism with several local
stages (the watch attaches to each stage; origin tracking of such a rank is untested).
"""

from __future__ import annotations

import inspect
import itertools
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

try:
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.config.override import derive, override
    from torchtitan.distributed import utils as dist_utils
except ImportError as exc:  # pragma: no cover - exercised only without torchtitan
    raise ImportError(
        "ampscope.integrations.torchtitan needs torchtitan: pip install 'ampscope[torchtitan]'"
    ) from exc

from ampscope import GradWatch
from ampscope.integrations import _clip_repeat
from ampscope.integrations._step import StepThroughWatch
from ampscope.integrations._swap import Attacher, check_options, check_policy, make_watch
from ampscope.reporter.schema import Policy

logger = logging.getLogger("ampscope")

KNOWN_CLIP = "ffd3da6eab3894f0a6a1e60114d1147311b39886571d19c23476ae0c9403d426"
"""The fingerprint (:func:`~ampscope.integrations._clip_repeat.fingerprint`) of torchtitan
0.3.0's ``clip_grad_norm_``, which :func:`~ampscope.integrations._clip_repeat.clip`
repeats."""

_LIVE: weakref.WeakSet[WatchedLRSchedulers] = weakref.WeakSet()
"""The containers whose watch checks before the next clip (one per trainer)."""
_ORDER = itertools.count()
"""Containers in the order they were built (alike on every rank)."""


class WatchedLRSchedulers(LRSchedulersContainer):
    """torchtitan's LR schedulers container, holding on skipped steps, with a watch.

    Attributes:
        watch: The :class:`~ampscope.GradWatch` on the optimizers container.
        skipped_steps: Iterations the watch skipped (the schedulers held).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(LRSchedulersContainer.Config):
        """``LRSchedulersContainer.Config`` and the watch's settings (see :func:`gradwatch`)."""

        policy: str = "observe"
        max_consecutive_skips: int | None = None
        track_origin: bool | None = None
        watch_options: dict[str, Any] = field(default_factory=dict)

        def build(self, *, optimizers: Any, training_steps: int) -> WatchedLRSchedulers:
            # LRSchedulersContainer.Config.build, named: slots dataclasses break super().
            schedulers = LRSchedulersContainer.Config.build(
                self, optimizers=optimizers, training_steps=training_steps
            )
            watch = make_watch(
                check_policy(self.policy, self.max_consecutive_skips),  # type: ignore[arg-type]
                self.watch_options,
            )
            return WatchedLRSchedulers(schedulers, optimizers, watch, self.track_origin)

    def __init__(
        self,
        schedulers: LRSchedulersContainer,
        optimizers: Any,
        watch: GradWatch,
        track_origin: bool | None,
    ) -> None:
        # The schedulers torchtitan built; LRSchedulersContainer.__init__ only sets them.
        self.schedulers = schedulers.schedulers
        self.watch = watch
        self.skipped_steps = 0
        self._optimizers = list(optimizers)
        self._steppers = [StepThroughWatch(watch, opt) for opt in self._optimizers]
        self._checked = False
        self.clip_layouts: _clip_repeat.Layouts = {}
        """What ampscope's repeat of torchtitan's clip learnt of the gradients' layout."""
        clip_ids = tuple(id(p) for part in optimizers.model_parts for p in part.parameters())
        stepped = {id(p) for opt in self._optimizers for g in opt.param_groups for p in g["params"]}
        self.clip_ids = clip_ids if set(clip_ids) == stepped else ()
        """The parameters torchtitan's ``train_step`` clips (its model parts', in order):
        a clip of exactly these is this container's (the optimizers hold them alive).
        Empty where the optimizers step others (the watch's norms are theirs, which the
        clip's total is not: the check norms them in its own pass)."""
        self.order = next(_ORDER)
        attacher = Attacher(track_origin)
        for part in optimizers.model_parts:
            attacher.attach(watch, part)
        _install_clip_hook()
        _LIVE.add(self)

    def checks_next(self) -> bool:
        """Whether the next :meth:`check` checks (once per iteration; a closed watch's too:
        its ``unscale_()`` still makes the open ranks' collectives at their place)."""
        return not self._checked

    def check(self, expect_clip: bool = False) -> None:
        """Check every optimizer's gradients now (before torchtitan clips them); once per
        iteration. ``expect_clip``: the clip that follows keeps its norms
        (:meth:`~ampscope.GradWatch.clip_with_norms_`), and the check leaves them to it."""
        if not self.checks_next():
            return
        self._checked = True
        if expect_clip:
            self.watch.expect_clip()
        for optimizer in self._optimizers:
            self.watch.unscale_(optimizer)

    def step(self) -> None:
        """Step the schedulers unless the watch skipped this iteration; close it."""
        watch = self.watch
        self._checked = False
        if watch.policy == "skip" and watch.last_step_skipped:
            self.skipped_steps += 1  # held: the next step gets this step's learning rate
        else:
            LRSchedulersContainer.step(self)
        watch.update()

    def close(self) -> None:
        """Close the watch and give the optimizers their ``step`` back. torchtitan has no
        hook for it at the trainer's end; ampscope closes the watch at interpreter exit."""
        _LIVE.discard(self)
        for stepper in self._steppers:
            stepper.remove()
        self.watch.close()


@override(
    target=LRSchedulersContainer.Config,
    description="ampscope: a GradWatch on the optimizers; LR schedulers hold on skipped steps",
)
def gradwatch(
    config: LRSchedulersContainer.Config,
    *,
    policy: Policy = "observe",
    max_consecutive_skips: int | None = None,
    track_origin: bool | None = None,
    **watch_options: Any,
) -> WatchedLRSchedulers.Config:
    """The override ``--override.imports 'ampscope.integrations.torchtitan.gradwatch={...}'``
    names; the JSON object holds its keyword arguments.

    Args:
        config: torchtitan's LR schedulers config: kept, field for field.
        policy: ``"observe"`` (default: numerics unchanged), ``"skip"`` or ``"raise"``.
        max_consecutive_skips: Under ``skip``: raise at the N-th skipped step in a row.
        track_origin: ``None`` (default): on when the run has several ranks.
        **watch_options: Telemetry options of :class:`ampscope.GradWatch` (``run_id``,
            ``top_k``, ``stats``...; ``reporter`` and ``sinks`` are objects, which a command
            line cannot give: the reporter follows ``AMPSCOPE_URL``).

    Raises:
        ValueError, TypeError: a bad policy or option, when torchtitan applies the
            override (before it builds anything).
    """
    check_options(watch_options)
    check_policy(policy, max_consecutive_skips)
    return derive(
        config,
        WatchedLRSchedulers.Config,
        policy=policy,
        max_consecutive_skips=max_consecutive_skips,
        track_origin=track_origin,
        watch_options=dict(watch_options),
    )


def _install_clip_hook() -> None:
    """Wrap ``torchtitan.distributed.utils.clip_grad_norm_`` once per process: each live
    watch checks the gradients before the clip changes them. Where the clip is of exactly
    a live container's model parameters (the newest such container's) and
    :mod:`~ampscope.integrations._clip_repeat` repeats torchtitan's clip (the 2-norm, no
    expert parallelism...), the clip is that repeat, whose pass gives that watch its
    norms: its check makes none of its own (nor the all-reduce of their sharded squares).
    Decided from the clip's arguments and the containers built, alike on every rank
    (never from how many old containers are still uncollected)."""
    clip = dist_utils.clip_grad_norm_
    if getattr(clip, "ampscope_checks", False):
        return
    known = _clip_repeat.recognised(
        clip, KNOWN_CLIP, "torchtitan.distributed.utils.clip_grad_norm_"
    )
    signature = inspect.signature(clip) if known else None

    def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
        live = list(_LIVE)
        keeper, call = None, None
        if signature is not None and live:
            keeper, call = _keeper(live, signature, args, kwargs)
        for schedulers in live:
            schedulers.check(expect_clip=schedulers is keeper)
        if keeper is None or call is None:
            return clip(*args, **kwargs)  # as before ampscope repeated the clip
        kept = call

        def run(keep: bool) -> tuple[Any, Any, Any]:
            total, local, stage = _clip_repeat.clip(kept)  # torchtitan's, bit for bit
            return total, local if keep else None, stage

        return keeper.watch.clip_with_norms_(kept.params, run, keep=True)

    clip_grad_norm_.ampscope_checks = True  # type: ignore[attr-defined]
    clip_grad_norm_.__wrapped__ = clip  # type: ignore[attr-defined]
    dist_utils.clip_grad_norm_ = clip_grad_norm_


def _keeper(
    live: list[WatchedLRSchedulers],
    signature: inspect.Signature,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[WatchedLRSchedulers | None, _clip_repeat.KeepingCall | None]:
    """The container whose watch takes this clip's norms (the newest whose model
    parameters are exactly the clip's, about to check) and the repeat's call; ``None``
    where there is none. O(live containers) and a tuple of the parameters' ids."""
    params = args[0] if args else kwargs.get("parameters")
    if not isinstance(params, list):
        return None, None
    ids = tuple(map(id, params))
    owners = [schedulers for schedulers in live if schedulers.clip_ids == ids]
    if not owners:
        return None, None
    keeper = max(owners, key=lambda schedulers: schedulers.order)
    if not keeper.checks_next():
        return None, None
    call = _keeping_call(keeper.clip_layouts, signature, args, kwargs, ids)
    return (keeper, call) if call is not None else (None, None)


def _keeping_call(
    layouts: _clip_repeat.Layouts,
    signature: inspect.Signature,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    ids: tuple[int, ...] | None = None,
) -> _clip_repeat.KeepingCall | None:
    """``clip_grad_norm_(*args, **kwargs)``, when ampscope's repeat keeps its norms: not
    under expert parallelism (torchtitan norms its expert and dense gradients apart), the
    parameters a list (a generator is left whole to torchtitan)."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    arguments = bound.arguments
    params = arguments["parameters"]
    if arguments["ep_enabled"] or not isinstance(params, list):
        return None
    return _clip_repeat.keeping_call(
        layouts,
        params,
        arguments["max_norm"],
        arguments["norm_type"],
        arguments["error_if_nonfinite"],
        arguments["foreach"],
        arguments["pp_mesh"],
        ids=ids,
    )
