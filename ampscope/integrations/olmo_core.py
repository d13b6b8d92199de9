"""OLMo-core: ``trainer_config.with_callback("ampscope", AmpscopeCallback())``.

OLMo-core trains bf16 (FSDP2 ``param_dtype``, or autocast) without a loss scaler, so the
callback installs a :class:`~ampscope.GradWatch` on the train module's model and
optimizer. Where it hooks into one step of ``Trainer._fit_epoch``:

* ``pre_epoch`` (the first): attaches the watch to ``train_module.model``, after the
  trainer's dry-run batch, whose backward must not reach the origin hooks;
* ``pre_step``: a new batch; the rank's loss of the last one is forgotten;
* ``train_module.model_forward`` (an instance attribute for the length of ``fit``): each
  micro-batch's CE loss is added up on the device, as ``train_batch`` adds it, before
  OLMo-core reduces it over the ranks (with a ``SkipStepOptimizer`` it all-reduces it in
  place at once, so ``trainer.get_metric("train/CE loss")`` is the job's mean, not the
  rank's: a loss spike could not name its rank). One add per micro-batch, no sync;
* ``pre_optim_step``: gradients are complete and reduced, not yet clipped. The watch
  takes this rank's own CE loss (the sum above; ``get_metric`` where no micro-batch went
  through ``model_forward``) and checks the gradients (``unscale_``: the non-finite
  check, the norms, under ``skip``/``raise`` the all-reduce every rank agrees on);
* ``train_module._clip_grad_norm`` (an instance attribute for the length of ``fit``),
  which ``optim_step()`` calls with ``max_grad_norm``: where ampscope repeats OLMo-core's
  clip (:mod:`~ampscope.integrations._clip_repeat`: the 2-norm over FSDP2 or DDP
  gradients of one layout, OLMo-core 3.0's code), that repeat clips, bit for bit, and its
  pass gives the watch its norms, so the check above makes no norm pass of its own;
* ``optim.step()``, called by ``train_module.optim_step()`` after clipping and the LR
  update, goes through ``watch.step(optim)`` (an instance attribute for the length of
  ``fit``): ``skip`` does not step, ``raise`` raises on every rank;
* ``post_train_batch``: ``watch.update()``, one record per step;
* ``on_error``: ``fit()`` raised; the exception is kept for ``close``;
* ``close`` (always, also after an error): the watch closes, the optimizer's, the
  scheduler's and the train module's own methods come back. After an error the rank ends
  ``failed`` with the exception, as a ``with`` block over the watch would end it, also
  when the caller catches it and goes on; a later ``fit()`` builds a new watch.

OLMo-core's schedulers are functions of ``trainer.global_step`` (or of the tokens seen),
which advance on a skipped step; under ``skip`` the callback holds them: it hands the
scheduler the step (and tokens) less those of the skipped steps, so the next step taken
gets the learning rate the skipped one would have had, as the other integrations hold
theirs. The count travels in the trainer's checkpoint (the callback's ``state_dict``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

try:
    from olmo_core.distributed.utils import get_local_tensor
    from olmo_core.optim import SkipStepOptimizer
    from olmo_core.train.callbacks import Callback
    from olmo_core.train.common import TRAIN_CE_LOSS_METRIC, MetricMergeStrategy
except ImportError as exc:  # pragma: no cover - exercised only without OLMo-core
    raise ImportError(
        "ampscope.integrations.olmo_core needs OLMo-core: pip install 'ampscope[olmo-core]'"
    ) from exc

from ampscope import GradWatch
from ampscope.integrations import _clip_repeat
from ampscope.integrations._step import StepThroughWatch
from ampscope.integrations._swap import Attacher, check_options, check_policy, make_watch
from ampscope.reporter.schema import Policy

logger = logging.getLogger("ampscope")

_SET_LR = "set_lr"
_MODEL_FORWARD = "model_forward"
_CLIP = "_clip_grad_norm"

KNOWN_CLIP = "d249ebae284fe514f0329328b5df803cb7864a3e6f5947573a9253a1e2ec2b65"
"""The fingerprint (:func:`~ampscope.integrations._clip_repeat.fingerprint`) of OLMo-core
3.0's ``TransformerTrainModule._clip_grad_norm``, which
:func:`~ampscope.integrations._clip_repeat.clip` repeats."""


class AmpscopeCallback(Callback):
    """Watches an OLMo-core run's gradients with a :class:`~ampscope.GradWatch`.

    Args:
        policy: ``"observe"`` (default: parameters bit-identical to the run without the
            callback), ``"skip"`` (a step whose gradients hold inf/NaN on any rank is
            skipped on every rank; the LR schedule holds) or ``"raise"``
            (:class:`~ampscope.NonFiniteGradientsError` on every rank, out of
            ``trainer.fit()``).
        max_consecutive_skips: Under ``skip``: raise at the N-th skipped step in a row.
        track_origin: ``None`` (default): on when the run has several ranks. Needs
            FSDP (``fully_shard``); OLMo-core's DDP is torch's composable ``replicate``,
            which origin tracking does not support (logged once, the rest works).
        **watch_options: Telemetry options of :class:`ampscope.GradWatch` (``run_id``,
            ``reporter``, ``sinks``, ``top_k``, ``stats``...).

    Attributes:
        watch: The watch, from ``fit()``'s start (``pre_train``) on; ``None`` before.
        skipped_steps: Steps the watch skipped, counted across checkpoint restarts.
    """

    def __init__(
        self,
        policy: Policy = "observe",
        *,
        max_consecutive_skips: int | None = None,
        track_origin: bool | None = None,
        **watch_options: Any,
    ) -> None:
        check_options(watch_options)
        self._config = check_policy(policy, max_consecutive_skips)
        self._options = watch_options
        self._track_origin = track_origin
        self.watch: GradWatch | None = None
        self.skipped_steps = 0
        self._skipped_tokens = 0
        self._tokens_before = 0
        self._attached = False
        self._checked = False  # pre_optim_step ran this step (not an intentional skip)
        self._attacher: Attacher | None = None
        self._stepper: StepThroughWatch | None = None
        self._scheduler: Any = None
        self._rank_loss: _RankLoss | None = None
        self._clip: _KeptClip | None = None
        self._spike_window: tuple[Any, Any] = (None, None)
        self._watch_state: dict[str, Any] | None = None  # from a checkpoint
        self._error: BaseException | None = None  # what fit() raised (on_error), for close

    # -- OLMo-core's Callback API --------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "skipped_steps": self.skipped_steps,
            "skipped_tokens": self._skipped_tokens,
        }
        if self.watch is not None:
            state["watch"] = self.watch.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self._skipped_tokens = int(state_dict.get("skipped_tokens", 0))
        self._watch_state = state_dict.get("watch")

    def pre_train(self) -> None:
        if self.watch is not None:  # fit() again: a new watch for the new run
            self.close()
        module = self.trainer.train_module
        optim = getattr(module, "optim", None)
        if not isinstance(optim, torch.optim.Optimizer):
            raise TypeError(
                f"ampscope: {type(module).__name__}.optim is {type(optim).__name__}; "
                "AmpscopeCallback needs a train module with one optimizer "
                "(TransformerTrainModule)"
            )
        watch = make_watch(self._config, self._options)
        if self._watch_state:
            watch.load_state_dict(self._watch_state)
        self.watch = watch
        # Built here, not in __init__: OLMo-core's with_callback() deep-copies callbacks.
        self._attacher = Attacher(self._track_origin)
        self._stepper = StepThroughWatch(watch, optim)
        self._tokens_before = self.trainer.global_train_tokens_seen
        self._rank_loss = _RankLoss.install(module)
        self._clip = _KeptClip.install(module, watch)
        if watch.policy == "skip":
            self._hold_scheduler(getattr(module, "scheduler", None))

    def pre_epoch(self) -> None:
        # After the trainer's dry-run batch: its backward must not count as step 1's.
        if self.watch is not None and self._attacher is not None and not self._attached:
            self._attached = True
            self._attacher.attach(self.watch, self.trainer.train_module.model)

    def pre_step(self, batch: dict[str, Any]) -> None:
        if self._rank_loss is not None:
            self._rank_loss.forget()  # the dry-run batch's, an evaluation's, the last step's

    def pre_optim_step(self) -> None:
        watch, stepper = self.watch, self._stepper
        if watch is None or stepper is None:
            return
        self._checked = True
        optim = stepper.optimizer
        if isinstance(optim, SkipStepOptimizer):
            # train_batch() appended this step's loss; optim_step() appends its grad norm.
            self._spike_window = (optim.latest_loss, optim.latest_grad_norm)
        loss = self._rank_loss.take() if self._rank_loss is not None else None
        if loss is None:
            loss = self.trainer.get_metric(TRAIN_CE_LOSS_METRIC)
        if loss is not None:
            watch.scale(loss)
        if self._clip is not None and self._clip.keeps_norms():
            watch.expect_clip()  # the clip's pass gives the norms
        # Before train_module.optim_step() clips: the gradients as backward left them.
        watch.unscale_(stepper.optimizer)

    def post_train_batch(self) -> None:
        watch = self.watch
        trainer = self.trainer
        tokens = trainer.global_train_tokens_seen - self._tokens_before
        self._tokens_before = trainer.global_train_tokens_seen
        if watch is None or not self._checked:
            return  # an intentional skip (steps_to_skip): no gradients, no record
        self._checked = False
        skipped = watch.last_step_skipped
        watch.update()
        if watch.policy != "skip":
            return
        optim = self._stepper.optimizer if self._stepper is not None else None
        if skipped:
            self.skipped_steps += 1
            self._skipped_tokens += tokens
            if isinstance(optim, SkipStepOptimizer):
                _forget_step(optim, *self._spike_window)
        # OLMo-core's own name for a skipped step (its SkipStepOptimizer records it);
        # ampscope's skip replaces its value: the optimizer did not step, once.
        if skipped or not isinstance(optim, SkipStepOptimizer):
            trainer.record_metric(
                "step skipped",
                float(skipped),
                namespace="optim",
                merge_strategy=MetricMergeStrategy.latest,
            )

    def on_error(self, exc: BaseException) -> None:
        # close() follows (OLMo-core's ungraceful shutdown): it ends the rank on this.
        self._error = exc

    def close(self) -> None:
        error, self._error = self._error, None
        if self._stepper is not None:
            self._stepper.remove()
            self._stepper = None
        if self._rank_loss is not None:
            self._rank_loss.remove()
            self._rank_loss = None
        if self._clip is not None:
            self._clip.remove()
            self._clip = None
        scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None and _SET_LR in vars(scheduler):
            delattr(scheduler, _SET_LR)  # the class's method again
        if self.watch is not None:
            self.watch.close_after(error)
        self._attached = False

    # -- internals -----------------------------------------------------------------------

    def _hold_scheduler(self, scheduler: Any) -> None:
        """Give ``scheduler.set_lr`` the trainer's step and tokens less the skipped ones
        (an instance attribute until ``close``); OLMo-core's schedulers read nothing else
        of the trainer but ``max_steps`` and ``max_tokens``, which stay."""
        if scheduler is None:
            return
        set_lr = scheduler.set_lr
        callback = self

        def held_set_lr(group: dict[str, Any], trainer: Any) -> Any:
            if not callback.skipped_steps:
                return set_lr(group, trainer)
            return set_lr(group, _HeldTrainer(trainer, callback))

        # Scheduler configs are plain dataclasses: the attribute shadows the method.
        object.__setattr__(scheduler, _SET_LR, held_set_lr)
        self._scheduler = scheduler


class _RankLoss:
    """This rank's CE loss of one batch, read from ``model_forward``'s output per micro-batch
    and added up as ``TransformerTrainModule.train_batch`` adds it (each micro-batch's CE
    loss is already divided by the rank's tokens for the loss), before OLMo-core reduces
    it. The sum stays on the device: one add per micro-batch, never a sync."""

    def __init__(self, module: Any, forward: Any) -> None:
        self._module = module
        self._total: torch.Tensor | None = None

        def model_forward(*args: Any, **kwargs: Any) -> Any:
            output = forward(*args, **kwargs)
            ce_loss = getattr(output, "ce_loss", None)  # None: logits only, no labels
            if isinstance(ce_loss, torch.Tensor):
                local = get_local_tensor(ce_loss.detach())
                self._total = local.clone() if self._total is None else self._total + local
            return output

        # An instance attribute shadows the method until remove(), as with the optimizer.
        setattr(module, _MODEL_FORWARD, model_forward)

    @classmethod
    def install(cls, module: Any) -> _RankLoss | None:
        """Wrap ``module.model_forward``; ``None`` for a train module without one."""
        forward = getattr(module, _MODEL_FORWARD, None)
        return cls(module, forward) if callable(forward) else None

    def forget(self) -> None:
        """Start a new batch."""
        self._total = None

    def take(self) -> torch.Tensor | None:
        """The batch's loss so far (``None``: no micro-batch went through), then forget it."""
        total, self._total = self._total, None
        return total

    def remove(self) -> None:
        """The train module's own ``model_forward`` again."""
        if _MODEL_FORWARD in vars(self._module):
            delattr(self._module, _MODEL_FORWARD)


class _KeptClip:
    """``train_module._clip_grad_norm`` through the watch's ``clip_with_norms_``: ampscope's
    repeat of OLMo-core's clip where it keeps the norms (:func:`_keeping_call`), OLMo-core's
    own method otherwise. An instance attribute shadows the method until :meth:`remove`."""

    def __init__(self, module: Any, watch: GradWatch, clip: Any) -> None:
        self._module = module
        self._own = vars(module).get(_CLIP)  # an instance attribute set before ours
        self._layouts: _clip_repeat.Layouts = {}
        self._params: tuple[Any, list[torch.Tensor], tuple[int, ...]] | None = None
        """The model, its parameters and their ids, as :meth:`keeps_norms` last read them."""
        self._call: _clip_repeat.KeepingCall | None = None
        """:meth:`keeps_norms`'s answer, which the clip that follows keeps to."""

        def _clip_grad_norm(
            max_grad_norm: float, norm_type: float = 2.0, foreach: bool | None = None
        ) -> torch.Tensor:
            call, self._call = self._call, None
            # The parameters keeps_norms() announced (expect_clip), whatever clips them.
            params = call.params if call is not None else []
            if call is not None and (max_grad_norm, norm_type, foreach) != (
                call.max_norm,
                call.norm_type,
                call.foreach,
            ):
                call = None  # another call than optim_step()'s: OLMo-core's own clip
            if call is not None:
                # Read here only (keeps_norms() decided without them): as OLMo-core reads
                # them, should a callback have replaced some since; one missing: its clip.
                call = _clip_repeat.with_grads(call)

            def run(keep: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
                if call is None:  # OLMo-core's own clip
                    total = clip(max_grad_norm, norm_type, foreach)
                    return total, None, total
                total, local, stage = _clip_repeat.clip(call)  # OLMo-core's, bit for bit
                return total, local if keep else None, stage

            # keep=False: the norms left to this clip are taken first (their sum over the
            # ranks from its total, every rank's collectives alike).
            return watch.clip_with_norms_(params, run, keep=call is not None)

        self._clip = _clip_grad_norm
        setattr(module, _CLIP, _clip_grad_norm)

    @classmethod
    def install(cls, module: Any, watch: GradWatch) -> _KeptClip | None:
        """Shadow ``module._clip_grad_norm`` when it is the code ampscope repeats; ``None``
        otherwise (another release, another train module: logged once by
        :func:`~ampscope.integrations._clip_repeat.recognised`)."""
        method = getattr(type(module), _CLIP, None)
        if method is None or not _recognised(method):
            return None
        return cls(module, watch, getattr(module, _CLIP))

    def keeps_norms(self) -> bool:
        """Whether the clip ``optim_step()`` is about to make keeps its norms (decided
        alike on every rank, from the train module's settings and the gradients' layout,
        learnt on first sight: no gradient is read here after that); the clip keeps to
        the answer, reading the gradients itself (one missing: OLMo-core's own clip)."""
        max_norm = self._module.max_grad_norm
        call = None
        if max_norm is not None:
            model = self._module.model
            params = self._params
            if params is None or params[0] is not model:
                # Once per fit: OLMo-core builds, shards and loads the model's parameters
                # (in place) before fit, and keeps them.
                listed = list(model.parameters())
                params = self._params = (model, listed, tuple(map(id, listed)))
            call = _keeping_call(
                self._layouts, model, max_norm, params=params[1:], read_grads=False
            )
        self._call = call
        return call is not None

    def remove(self) -> None:
        """The train module's own ``_clip_grad_norm`` again (when still ours; an instance
        attribute set before ours is put back). Idempotent."""
        if vars(self._module).get(_CLIP) is not self._clip:  # replaced since: leave it
            return
        if self._own is None:
            delattr(self._module, _CLIP)
        else:
            setattr(self._module, _CLIP, self._own)


_RECOGNISED: dict[Any, bool] = {}


def _recognised(method: Any) -> bool:
    """:func:`~ampscope.integrations._clip_repeat.recognised`, once per method."""
    known = _RECOGNISED.get(method)
    if known is None:
        what = f"OLMo-core's {method.__qualname__}"
        known = _RECOGNISED[method] = _clip_repeat.recognised(method, KNOWN_CLIP, what)
    return known


def _keeping_call(
    layouts: _clip_repeat.Layouts,
    model: Any,
    max_grad_norm: float,
    norm_type: float = 2.0,
    foreach: bool | None = None,
    params: tuple[list[torch.Tensor], tuple[int, ...]] | None = None,
    read_grads: bool = True,
) -> _clip_repeat.KeepingCall | None:
    """OLMo-core's clip of ``model``'s gradients, when ampscope's repeat keeps its norms:
    not under FSDP1 (OLMo-core calls its ``clip_grad_norm_``). ``params``: the model's
    parameters and their ids, already listed; ``read_grads``: as
    :func:`~ampscope.integrations._clip_repeat.keeping_call`'s."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):
        return None
    if params is None:
        listed = list(model.parameters())
        params = listed, tuple(map(id, listed))
    return _clip_repeat.keeping_call(
        layouts,
        params[0],
        max_grad_norm,
        norm_type,
        False,
        foreach,
        ids=params[1],
        read_grads=read_grads,
    )


def _forget_step(optim: Any, loss: Any, grad_norm_before: Any) -> None:
    """Take the step ampscope skipped out of a ``SkipStepOptimizer``'s rolling window.

    Its inf/NaN grad norm (or loss) would otherwise sit in the window's mean and
    standard deviation, every comparison with them would fail, and the optimizer would
    skip each following step until the value rolls out (``rolling_interval_length``
    steps): the one skip would become many. OLMo-core has no public way to drop an
    entry, so this is the one place ampscope edits its private state (the window's two
    lists). ``loss`` is the entry this step appended; ``grad_norm_before`` the newest
    grad norm before this step's.
    """
    losses, norms = optim._losses, optim._grad_norms
    if losses and losses[-1] is loss:
        losses.pop()
    if norms and norms[-1] is not grad_norm_before:
        norms.pop()


class _HeldTrainer:
    """The trainer as a scheduler sees it when skipped steps do not count."""

    def __init__(self, trainer: Any, callback: AmpscopeCallback) -> None:
        self._trainer = trainer
        self.global_step = trainer.global_step - callback.skipped_steps
        self.global_train_tokens_seen = trainer.global_train_tokens_seen - callback._skipped_tokens

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)
