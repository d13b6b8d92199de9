"""One rank of the demo: a small MLP sharded with FSDP2, trained in fp16 under ampscope.

Runs in a process the runner spawns; every scenario is its own model, optimizer, scaler and
run id, stepped in turn on every iteration so all runs progress side by side.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ampscope import GradScaler
from ampscope.demo.scenarios import Scenario
from ampscope.reporter.http import HttpReporter

FEATURES = 32
HIDDEN = 64
BATCH = 32
OUTLIER_SAMPLES = 4
NAN_SAMPLE = 5
"""The sample of the last rank's batch that holds NaN in a scenario with ``nan_sample_at``."""


def sample_ids(step: int, rank: int, world_size: int) -> list[int]:
    """The ids the ranks note for ``step`` (``note_batch``): indices of one stream of
    samples, as a ``DistributedSampler`` deals them, ``BATCH`` per rank and step."""
    first = ((step - 1) * world_size + rank) * BATCH
    return list(range(first, first + BATCH))


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What every rank trains; identical on all ranks."""

    scenarios: tuple[Scenario, ...]
    run_ids: tuple[str, ...]
    """One per scenario, same order."""
    steps: int
    exporter_url: str
    progress_every: int
    step_delay: float
    """Seconds to sleep after each iteration, to stretch the run for a dashboard."""


@dataclass(frozen=True, kw_only=True)
class Progress:
    """A rank's state after ``step``, sent to the runner every ``progress_every`` steps."""

    rank: int
    step: int
    scales: tuple[float, ...]
    """Per scenario, in plan order."""
    skipped: tuple[int, ...]


def _build_model() -> torch.nn.Module:
    # Same seed on every rank: fully_shard keeps each rank's shard of its own copy.
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        OrderedDict(
            embed=torch.nn.Linear(FEATURES, HIDDEN),
            act1=torch.nn.ReLU(),
            hidden=torch.nn.Linear(HIDDEN, HIDDEN),
            act2=torch.nn.ReLU(),
            head=torch.nn.Linear(HIDDEN, 1),
        )
    )
    # fp16 compute and fp16 gradients, reduced in fp32: real fp16 overflows on CPU.
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


class ScenarioRun:
    """One scenario's model, optimizer and scaler on this rank."""

    def __init__(
        self, scenario: Scenario, run_id: str, plan: Plan, rank: int, world_size: int
    ) -> None:
        self.scenario = scenario
        self.rank = rank
        self.world_size = world_size
        self.steps = plan.steps
        self.model = _build_model()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.scaler = GradScaler(
            "cpu",
            init_scale=scenario.init_scale,
            growth_interval=scenario.growth_interval,
            reporter=HttpReporter(plan.exporter_url, flush_interval=0.25),
            run_id=run_id,
        )
        # Origin hooks see each rank's own gradients before the reduce-scatter mixes them.
        self.scaler.attach(self.model, track_origin=True)
        self.data = torch.Generator().manual_seed(1000 + rank)
        self.target = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(7))
        self.stale_state: dict[str, Any] | None = None
        self.corrupt_once = False
        """Set for one iteration: the head's backward turns this rank's gradients inf once."""
        if scenario.transient_fault_at is not None:
            head = self.model.get_submodule("head")
            head.register_full_backward_pre_hook(self._corrupt)

    def _corrupt(self, module: Any, grad_output: tuple[torch.Tensor, ...]) -> Any:
        # A one-time fault of this rank's device: the first backward only, not the rerun's.
        if not self.corrupt_once:
            return None
        self.corrupt_once = False
        return (grad_output[0] * float("inf"),)

    def _batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(BATCH, FEATURES, generator=self.data)
        y = x @ self.target / FEATURES**0.5
        if self.scenario.outliers_at(step, self.rank, self.world_size):
            x[:OUTLIER_SAMPLES] *= self.scenario.outlier_factor
        if self.rank == self.world_size - 1 and step == self.scenario.bad_batch_step(self.steps):
            x *= self.scenario.bad_batch_factor
        if self.scenario.corrupt_at(step, self.steps):
            x *= self.scenario.corrupt_factor
        last_rank = self.rank == self.world_size - 1
        if last_rank and step == self.scenario.nan_sample_step(self.steps):
            x[NAN_SAMPLE] = float("nan")
        return x, y

    def step(self, step: int) -> None:
        """One iteration: forward, scaled backward, step (with a rerun closure where the
        scenario asks), update (and the stale restore)."""
        x, y = self._batch(step)
        self.scaler.note_batch(sample_ids(step, self.rank, self.world_size))
        self.corrupt_once = self.rank == 0 and step == self.scenario.transient_fault_step(
            self.steps
        )
        loss = torch.nn.functional.mse_loss(self.model(x).float(), y)
        self.scaler.scale(loss).backward()
        if self.scenario.rerun:

            def recompute() -> torch.Tensor:
                # The closure's contract: zero the gradients, forward and backward through
                # scale() on the same batch, return the loss.
                self.optimizer.zero_grad(set_to_none=True)
                again = torch.nn.functional.mse_loss(self.model(x).float(), y)
                self.scaler.scale(again).backward()
                return again

            self.scaler.step(self.optimizer, rerun=recompute)
        else:
            self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        last_rank = self.rank == self.world_size - 1
        if last_rank and step == 1 and self.scenario.stale_restore_at is not None:
            self.stale_state = self.scaler.state_dict()
        if last_rank and step == self.scenario.restore_step(self.steps):
            assert self.stale_state is not None
            self.scaler.load_state_dict(self.stale_state)

    def scale(self) -> float:
        return float(self.scaler.get_scale())

    def skipped(self) -> int:
        return self.scaler.telemetry.snapshot().skipped_steps

    def close(self) -> None:
        self.scaler.close()


def train(rank: int, world_size: int, plan: Plan, on_progress: Callable[[Progress], None]) -> None:
    """Train every scenario of ``plan`` for ``plan.steps`` iterations on this rank.

    Needs the default process group. Calls ``on_progress`` every ``plan.progress_every``
    steps and after the last; each call reads every scaler's scale (a host sync on GPUs).
    """
    runs = [
        ScenarioRun(scenario, run_id, plan, rank, world_size)
        for scenario, run_id in zip(plan.scenarios, plan.run_ids, strict=True)
    ]
    try:
        for step in range(1, plan.steps + 1):
            for run in runs:
                run.step(step)
            if step % plan.progress_every == 0 or step == plan.steps:
                on_progress(
                    Progress(
                        rank=rank,
                        step=step,
                        scales=tuple(run.scale() for run in runs),
                        skipped=tuple(run.skipped() for run in runs),
                    )
                )
            if plan.step_delay > 0:
                time.sleep(plan.step_delay)
    finally:
        for run in runs:
            run.close()


def worker(rank: int, world_size: int, master_port: int, plan: Plan, queue: Any) -> None:
    """Process entry point: join the gloo group, train, report to the runner's queue."""
    # Keep two ranks from fighting over a laptop's cores.
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    # One node, as torchrun would start it: each rank its own local rank, so each names its
    # own device (<node>:<local_rank>) and an offence lands on the rank's device alone.
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{master_port}",
            rank=rank,
            world_size=world_size,
        )
        try:
            train(rank, world_size, plan, lambda report: queue.put(("progress", report)))
        finally:
            dist.destroy_process_group()
        queue.put(("done", rank))
    except BaseException:
        queue.put(("error", (rank, traceback.format_exc())))
        sys.exit(1)
