"""OLMo-core training runs, unpatched, imported by the tests and by spawned ranks.

Each run trains the same tiny llama-like model (FSDP over the gloo ranks, bf16
parameters, fp32 gradient reduction, AdamW, grad clipping, a linear LR schedule) with
OLMo-core's own ``Trainer`` on deterministic tokens, and returns plain values: the
parameters as float32 bit patterns, OLMo-core's logged metrics per step and the records
of the ampscope watch.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
from norm_spies import NormSpies

STEPS = 8
INJECT_STEP = 4
"""OLMo-core's 1-based ``global_step`` at which rank :data:`INJECT_RANK`'s gradient gets a NaN."""
INJECT_RANK = 1
SEQUENCE = 16
INSTANCES = 2
"""Instances per rank and step (one micro-batch)."""
VOCAB = 64
_CLIP = "_clip_grad_norm"
"""The train module's method that ampscope shadows for the length of ``fit``."""


def reset_world_mesh() -> None:
    # One process trains several runs; OLMo-core keeps one device mesh per process and
    # refuses to build a second one (as a real job trains once) unless it is reset.
    from olmo_core.distributed import parallel

    parallel._WORLD_MESH = None


def _loader(rank: int, world_size: int, work_dir: Path) -> Any:
    from olmo_core.data import DataCollator
    from olmo_core.data.data_loader import TextDataLoaderBase

    class Tokens(TextDataLoaderBase):
        """Deterministic random tokens, different per rank and step."""

        @property
        def total_batches(self) -> int:
            return STEPS

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

        def reshuffle(self, epoch: int | None = None, **kwargs: Any) -> None:
            self._epoch = epoch or 1

        def _iter_batches(self) -> Any:
            for step in range(STEPS):
                generator = torch.Generator().manual_seed(1000 * step + rank)
                ids = torch.randint(0, VOCAB, (INSTANCES, SEQUENCE), generator=generator)
                yield {"input_ids": ids}

        def get_mock_batch(self) -> dict[str, Any]:
            return {"input_ids": torch.randint(0, VOCAB, (INSTANCES, SEQUENCE))}

    return Tokens(
        collator=DataCollator(pad_token_id=0),
        work_dir=work_dir,
        global_batch_size=INSTANCES * SEQUENCE * world_size,
        dp_world_size=world_size,
        dp_rank=rank,
        fs_local_rank=rank,
    )


def olmo_run(
    rank: int,
    world_size: int,
    policy: str | None,
    run_id: str,
    work_dir: str,
    *,
    inject: bool,
    skip_step_optimizer: bool = False,
    device: str = "cpu",
    inject_rank: int = INJECT_RANK,
    late_bookkeeping_rank: int | None = None,
    bad_batch_at: int | None = None,
) -> dict[str, Any]:
    """One ``Trainer.fit()``; ``policy=None``: without ampscope. ``device``: ``"cuda"`` for
    the GPU machine's one-rank NCCL run (tests/integrations/test_gpu_frameworks.py).
    ``late_bookkeeping_rank``: that rank checks the reduced metrics a step late, as a
    loaded machine can make it (:func:`check_metrics_late`). ``bad_batch_at``: the forward
    of that ``global_step`` raises ``RuntimeError("a bad batch")`` (a data error)."""
    from olmo_core.config import DType
    from olmo_core.distributed.parallel import DataParallelType
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig, LinearWithWarmup, SkipStepAdamWConfig
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.callbacks import Callback
    from olmo_core.train.train_module import (
        TransformerDataParallelConfig,
        TransformerTrainModuleConfig,
    )
    from olmo_core.utils import seed_all

    from ampscope.integrations.olmo_core import AmpscopeCallback

    os.environ.setdefault("OLMO_SHARED_FS", "1")
    reset_world_mesh()
    root = Path(work_dir) / f"{run_id}-{policy}-rank{rank}"
    seed_all(1234)
    model = TransformerConfig.llama_like(
        d_model=32, vocab_size=VOCAB, n_layers=2, n_heads=2, hidden_size_multiple_of=16
    ).build(init_device="meta")
    optim: Any = (
        # A short window; a sigma so wide that only inf/NaN makes it skip a step.
        SkipStepAdamWConfig(lr=1e-2, rolling_interval_length=6, sigma_factor=10**6)
        if skip_step_optimizer
        else AdamWConfig(lr=1e-2)
    )
    train_module = TransformerTrainModuleConfig(
        rank_microbatch_size=INSTANCES * SEQUENCE,
        max_sequence_length=SEQUENCE,
        optim=optim,
        max_grad_norm=1.0,
        scheduler=LinearWithWarmup(warmup_steps=2, alpha_f=0.1),
        dp_config=TransformerDataParallelConfig(
            name=DataParallelType.fsdp, param_dtype=DType.bfloat16, reduce_dtype=DType.float32
        ),
    ).build(model, device=torch.device(device))

    class Probe(Callback):
        """Every metric OLMo-core logs, by step."""

        def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
            if not hasattr(self, "metrics"):
                self.metrics: dict[int, dict[str, float]] = {}
            self.metrics[step] = dict(metrics)

    built: list[Any] = []  # the trainer, once built

    def poison(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        # Before FSDP's reduce-scatter: only this rank's own gradient holds the NaN.
        step = built[0].global_step if built else 0  # 0: the trainer's dry-run batch
        if step and step == bad_batch_at:
            raise RuntimeError("a bad batch")
        if inject and rank == inject_rank and step == INJECT_STEP:
            output.register_hook(lambda grad: grad * float("nan"))

    model.embeddings.register_forward_hook(poison)
    config = TrainerConfig(
        save_folder=str(root / "save"),
        work_dir=str(root / "work"),
        max_duration=Duration.steps(STEPS),
        metrics_collect_interval=1,
        no_checkpoints=True,
        # A poisoned run without ampscope ends in OLMo-core's own check of the reduced loss
        # ("nan loss encountered"). On gloo that check runs in the bookkeeping thread and
        # each rank's training thread sees its error at its own next look: a loaded rank
        # can leave fit() a step after the other, and its next training step's collectives
        # then meet the other's closing full_tensor() (a size mismatch that aborts one rank,
        # "Connection reset by peer" on the other). Checked on the training thread, as with
        # NCCL alone, the error ends every rank at the same step.
        async_bookkeeping=False if inject and policy is None else None,
    ).with_callback("probe", Probe())
    if policy is not None:
        ampscope = AmpscopeCallback(policy=policy, run_id=f"{run_id}-{policy}")  # type: ignore[arg-type]
        config = config.with_callback("ampscope", ampscope)
    trainer = config.build(train_module, _loader(rank, world_size, root))
    built.append(trainer)
    if rank == late_bookkeeping_rank:
        check_metrics_late(trainer)
    # with_callback() deep-copies the callbacks added before: the trainer's are the ones.
    probe = trainer.callbacks["probe"]
    callback = trainer.callbacks.get("ampscope")
    error = None
    spies = NormSpies() if policy is not None else None
    try:
        with spies or contextlib.nullcontext():
            trainer.fit()
    except Exception as exc:  # policy "raise": the test compares the ranks' messages
        error = f"{type(exc).__name__}: {exc}"
    optimizer = train_module.optim
    assert optimizer is not None
    params = [p.full_tensor() for p in train_module.model.parameters()]  # type: ignore[operator]
    result: dict[str, Any] = {
        "error": error,
        "bits": [p.detach().float().view(torch.int32).flatten().tolist() for p in params],
        "finite": all(bool(p.isfinite().all()) for p in params),
        "metrics": getattr(probe, "metrics", {}),
        "left_at_step": trainer.global_step,
        "optimizer_steps": sorted({int(s["step"]) for s in optimizer.state.values()}),
        "step_is_class_method": "step" not in vars(optimizer),
        "scheduler_restored": "set_lr" not in vars(train_module.scheduler),
        "forward_restored": "model_forward" not in vars(train_module),
    }
    if callback is not None:
        watch = callback.watch
        assert watch is not None
        records = watch.telemetry.history()
        result.update(
            skipped=[r.skipped for r in records],
            found=[r.found_inf_global for r in records],
            origin=[any(r.found_inf_origin.values()) for r in records],
            grad_norm=[r.stats.grad_norm if r.stats else None for r in records],
            loss=[r.stats.loss if r.stats else None for r in records],
            setup=records[-1].setup.model_dump(),
            closed=watch.telemetry.closed,
            skipped_steps=callback.skipped_steps,
            nonfinite=[sorted(p.name for p in r.nonfinite_params) for r in records],
            own_norm_passes=spies.own_passes if spies else None,
            # Per iteration: the norms the records got are each local gradient's norm,
            # in the model's order, as OLMo-core's clip saw them.
            norms_as_seen=spies.taken == spies.seen if spies else None,
            norm_names=list(spies.names) if spies else None,
            param_names=[name for name, _ in train_module.model.named_parameters()],
            clip_restored=_CLIP not in vars(train_module),
        )
    return result


def olmo_worker(rank: int, world_size: int, run_id: str, work_dir: str) -> dict[str, Any]:
    """The four runs the tests compare: stock and observe clean, skip and raise poisoned."""
    return {
        "stock": olmo_run(rank, world_size, None, run_id, work_dir, inject=False),
        "observe": olmo_run(rank, world_size, "observe", run_id, work_dir, inject=False),
        "skip": olmo_run(rank, world_size, "skip", run_id, work_dir, inject=True),
        "raise": olmo_run(rank, world_size, "raise", run_id, work_dir, inject=True),
    }


def bad_batch_worker(rank: int, world_size: int, run_id: str, work_dir: str) -> dict[str, Any]:
    """A run whose batch at ``INJECT_STEP`` raises a data error, which the worker catches."""
    return olmo_run(
        rank, world_size, "observe", run_id, work_dir, inject=False, bad_batch_at=INJECT_STEP
    )


def check_metrics_late(trainer: Any) -> None:
    """Make ``trainer`` check a non-finite loss a step late where it checks in the
    bookkeeping thread, as a loaded machine can: its reduced metrics are held until the
    training thread has begun the step after the one it was in when they arrived, so that
    it passes one more look for the bookkeeping error than a rank whose thread kept up.
    Where the trainer checks on the training thread (synchronous bookkeeping) nothing can
    lag and nothing waits. Patches this trainer only (an instance attribute)."""
    from olmo_core.train.common import TRAIN_CE_LOSS_METRIC

    check = trainer._check_and_pass_on_metrics  # what _log_metrics hands the thread

    def late_check(metrics: dict[int, dict[str, float]]) -> None:
        losses = [m.get(TRAIN_CE_LOSS_METRIC, 0.0) for m in metrics.values()]
        if threading.current_thread() is not threading.main_thread() and not all(
            math.isfinite(loss) for loss in losses
        ):
            # Waits on the training thread's own progress, never on time: should that step
            # never begin, run_distributed's deadlock guard ends the run and says so.
            until = trainer.global_step + 1
            while trainer.global_step < until:
                time.sleep(0.01)
        check(metrics)

    trainer._check_and_pass_on_metrics = late_check


def skip_step_worker(rank: int, world_size: int, run_id: str, work_dir: str) -> dict[str, Any]:
    """OLMo-core's SkipStepAdamW, poisoned, without ampscope and with ``skip``; the run
    without ampscope dies of its NaN loss, with :data:`INJECT_RANK`'s bookkeeping late."""
    return {
        policy or "stock": olmo_run(
            rank,
            world_size,
            policy,
            run_id,
            work_dir,
            inject=True,
            skip_step_optimizer=True,
            late_bookkeeping_rank=INJECT_RANK if policy is None else None,
        )
        for policy in (None, "skip")
    }
