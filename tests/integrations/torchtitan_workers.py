"""torchtitan training runs through the test-only CPU launcher, for spawned ranks.

Each run is torchtitan's ``llama3_debugmodel`` from its own config registry and command
line (short sequences, fp32 parameters: bf16 matmuls are slow on CPUs without bf16
units), with or without ampscope's one ``--override.imports`` entry, and returns plain
values: the parameters as float32 bit patterns, what torchtitan logged per step and the
records of the watch.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import torch
from norm_spies import NormSpies

STEPS = 5
INJECT_STEP = 3
"""torchtitan's 1-based ``trainer.step`` at which rank :data:`INJECT_RANK` gets a NaN."""
INJECT_RANK = 1
OVERRIDE = "ampscope.integrations.torchtitan.gradwatch"


def argv(dump_folder: str, policy: str | None, run_id: str, device: str = "cpu") -> list[str]:
    """torchtitan's command line for one run (``policy=None``: without ampscope). On the
    GPU: torchtitan's own FSDP setup (``spmd_types``) and its deterministic mode, so that
    two runs can be compared bit for bit."""
    args = [
        "--module", "llama3",
        "--config", "llama3_debugmodel",
        "--training.steps", str(STEPS),
        "--training.seq_len", "32",
        "--training.local_batch_size", "2",
        "--training.mixed_precision_param", "float32",
        "--debug.seed", "7",
        "--dump_folder", dump_folder,
    ]  # fmt: skip
    if device == "cpu":
        args += ["--parallelism.spmd_backend", "partial_dtensor"]  # see torchtitan_cpu
    else:
        args += ["--debug.deterministic"]
    if policy is not None:
        options = {"policy": policy, "run_id": f"{run_id}-{policy}"}
        args += ["--override.imports", f"{OVERRIDE}={json.dumps(options)}"]
    return args


def titan_run(
    rank: int,
    world_size: int,
    policy: str | None,
    run_id: str,
    dump_folder: str,
    inject: bool,
    device: str = "cpu",
    inject_rank: int = INJECT_RANK,
) -> dict[str, Any]:
    """One ``trainer.train()``; ``device="cuda"``: torchtitan unpatched on the GPU."""
    from torchtitan_cpu import build_trainer

    trainer = build_trainer(
        argv(f"{dump_folder}/{policy}-{rank}", policy, run_id, device), cpu=device == "cpu"
    )
    logged: dict[int, dict[str, float]] = {}
    log = trainer.metrics_processor.log

    def record(step: int, loss: float, max_loss: float, grad_norm: float, **kw: Any) -> Any:
        extra = kw.get("extra_metrics") or {}
        logged[step] = {"loss": loss, "grad_norm": grad_norm, "lr": extra["lr/AdamW"]}
        return log(step, loss, max_loss, grad_norm, **kw)

    trainer.metrics_processor.log = record

    def poison(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        # Before FSDP's reduce-scatter: only this rank's own gradient holds the NaN.
        if inject and rank == inject_rank and trainer.step == INJECT_STEP and output.requires_grad:
            output.register_hook(lambda grad: grad * float("nan"))

    model = trainer.model_parts[0]
    model.tok_embeddings.register_forward_hook(poison)
    error = None
    spies = NormSpies() if policy is not None else None
    try:
        with spies or contextlib.nullcontext():
            trainer.train()
    except Exception as exc:  # policy "raise": the test compares the ranks' messages
        error = f"{type(exc).__name__}: {exc}"
    schedulers = trainer.lr_schedulers
    params = [p.full_tensor() for p in model.parameters()]
    optimizer = trainer.optimizers.optimizers[0]
    result: dict[str, Any] = {
        "error": error,
        "bits": [p.detach().float().view(torch.int32).flatten().tolist() for p in params],
        "finite": all(bool(p.isfinite().all()) for p in params),
        "logged": logged,
        "optimizer_steps": sorted({int(s["step"]) for s in optimizer.state.values()}),
        "scheduler_epoch": schedulers.schedulers[0].last_epoch,
        "schedulers_class": type(schedulers).__name__,
    }
    watch = getattr(schedulers, "watch", None)
    if watch is not None:
        records = watch.telemetry.history()
        result.update(
            skipped=[r.skipped for r in records],
            found=[r.found_inf_global for r in records],
            origin=[any(r.found_inf_origin.values()) for r in records],
            grad_norm=[r.stats.grad_norm if r.stats else None for r in records],
            setup=records[-1].setup.model_dump(),
            skipped_steps=schedulers.skipped_steps,
            policy=watch.policy,
            nonfinite=[sorted(p.name for p in r.nonfinite_params) for r in records],
            own_norm_passes=spies.own_passes if spies else None,
            # Per iteration: the norms the records got are each local gradient's norm,
            # in the model's order, as torchtitan's clip saw them.
            norms_as_seen=spies.taken == spies.seen if spies else None,
            norm_names=list(spies.names) if spies else None,
            # ampscope names parameters without activation checkpointing's wrapper.
            param_names=[
                name.replace("_checkpoint_wrapped_module.", "")
                for name, _ in model.named_parameters()
            ],
        )
        schedulers.close()
        # Each optimizer's step is torchtitan's again (the LR scheduler's counting wrapper).
        result["step_restored"] = all(
            not hasattr(vars(o).get("step"), "__self__") for o in trainer.optimizers.optimizers
        )
    trainer.close()
    return result


def titan_worker(rank: int, world_size: int, run_id: str, dump_folder: str) -> dict[str, Any]:
    """stock and observe clean, skip and raise poisoned."""
    return {
        "stock": titan_run(rank, world_size, None, run_id, dump_folder, inject=False),
        "observe": titan_run(rank, world_size, "observe", run_id, dump_folder, inject=False),
        "skip": titan_run(rank, world_size, "skip", run_id, dump_folder, inject=True),
        "raise": titan_run(rank, world_size, "raise", run_id, dump_folder, inject=True),
    }
