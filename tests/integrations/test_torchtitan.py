"""``--override.imports ampscope.integrations.torchtitan.gradwatch`` with the real torchtitan,
on two gloo ranks through the test-only CPU launcher (``torchtitan_cpu.py``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from checks import exporter_ranks
from support import need_module, run_distributed
from torchtitan_workers import INJECT_RANK, INJECT_STEP, OVERRIDE, STEPS, titan_worker

need_module("torchtitan")
need_module("triton")  # torchtitan imports it on every device

TIMEOUT_S = 900.0
"""Deadlock guard for the distributed test (four torchtitan runs per rank on two cores)."""


NAN_PARAMS = ["tok_embeddings.weight"]
"""The NaN enters the embedding's output gradient: its weight's is the one it reaches."""


def _at_inject() -> list[bool]:
    return [step == INJECT_STEP for step in range(1, STEPS + 1)]


def _logged(run: dict[str, Any], name: str) -> list[float]:
    return [run["logged"][step][name] for step in range(1, STEPS + 1)]


@pytest.mark.distributed
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_torchtitan_two_ranks(report_to: str, tmp_path: Path) -> None:
    results = run_distributed(titan_worker, 2, args=("titan", str(tmp_path)), timeout=TIMEOUT_S)
    for rank, result in enumerate(results):
        stock, observe, skip, stop = (result[k] for k in ("stock", "observe", "skip", "raise"))
        # observe: torchtitan's own containers replaced, training bit-identical.
        assert stock["schedulers_class"] == "LRSchedulersContainer"
        assert observe["schedulers_class"] == "WatchedLRSchedulers"
        assert stock["error"] is None
        assert observe["error"] is None
        assert observe["bits"] == stock["bits"]
        assert observe["logged"] == stock["logged"]
        assert observe["optimizer_steps"] == stock["optimizer_steps"] == [STEPS]
        assert observe["setup"] == {
            "mode": "watch",
            "policy": "observe",
            "grad_dtype": "float32",
            "origin_group": {"first": 0, "size": 2},  # origin tracked: FSDP2 over both ranks
        }
        assert observe["skipped"] == observe["found"] == [False] * STEPS
        # The norm before torchtitan clipped the gradients: its own logged grad norm.
        pairs = zip(observe["grad_norm"], _logged(stock, "grad_norm"), strict=True)
        assert all(math.isclose(ours, theirs, rel_tol=1e-3) for ours, theirs in pairs)
        assert observe["step_restored"]
        # skip: both ranks skip the poisoned step; the LR schedulers hold on it.
        assert skip["error"] is None
        assert skip["finite"]
        assert skip["skipped"] == skip["found"] == _at_inject()
        assert skip["origin"] == (_at_inject() if rank == INJECT_RANK else [False] * STEPS)
        assert skip["skipped_steps"] == 1
        assert skip["optimizer_steps"] == [STEPS - 1]
        assert skip["scheduler_epoch"] == stock["scheduler_epoch"] - 1 == STEPS - 1
        lr, stock_lr = _logged(skip, "lr"), _logged(stock, "lr")
        assert lr[:INJECT_STEP] == stock_lr[:INJECT_STEP]
        assert lr[INJECT_STEP:] == stock_lr[INJECT_STEP - 1 : -1]
        # raise: both ranks stop at the poisoned step with the same words.
        assert stop["error"] is not None
        assert stop["error"].startswith("NonFiniteGradientsError: ")
        assert f"at step {INJECT_STEP}" in stop["error"]
        assert f"Origin rank(s): {INJECT_RANK}." in stop["error"]
        assert stop["optimizer_steps"] == [INJECT_STEP - 1]
        # torchtitan's clip gives the norms, in the model's order: the local (shard)
        # norms of the gradients it clips, NaN included; the watch makes no pass of its
        # own, not even in the first iteration, and still names what held the NaN.
        for run in (observe, skip):
            assert run["norm_names"] == run["param_names"]
            assert run["norms_as_seen"]
        assert skip["nonfinite"] == [NAN_PARAMS if at else [] for at in _at_inject()]
        assert observe["own_norm_passes"] == skip["own_norm_passes"] == 0
    assert results[0]["raise"]["error"] == results[1]["raise"]["error"]
    # The records reached the exporter, which names the skipped step's origin rank.
    for view in exporter_ranks(report_to, "titan-observe", 2, steps=STEPS):
        assert view["totals"]["skipped_steps"] == 0
    for rank, view in enumerate(exporter_ranks(report_to, "titan-skip", 2, steps=STEPS)):
        assert view["totals"]["skipped_steps"] == 1
        origin = sum(view["totals"]["found_inf_origin"].values())
        assert origin == (1 if rank == INJECT_RANK else 0)


def test_the_override_is_torchtitans_and_checks_its_options() -> None:
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.config import Configurable
    from torchtitan.config.override import OverrideConfig, apply_overrides, parse_cli_imports

    from ampscope.integrations.torchtitan import WatchedLRSchedulers

    entries = parse_cli_imports([f'{OVERRIDE}={{"policy": "skip", "run_id": "r"}}'])
    assert entries == [(OVERRIDE, {"policy": "skip", "run_id": "r"})]

    # apply_overrides walks a config tree; a one-field tree (Trainer.Config's node) will do.
    @dataclass(kw_only=True, slots=True)
    class Tree(Configurable.Config):
        lr_scheduler: LRSchedulersContainer.Config = field(
            default_factory=lambda: LRSchedulersContainer.Config(warmup_steps=3)
        )

    tree = Tree()
    lines = apply_overrides(OverrideConfig(imports=entries), tree)
    assert len(lines) == 1
    swapped = tree.lr_scheduler
    assert isinstance(swapped, WatchedLRSchedulers.Config)
    assert (swapped.warmup_steps, swapped.policy) == (3, "skip")
    assert swapped.watch_options == {"run_id": "r"}
    bad = parse_cli_imports([f'{OVERRIDE}={{"policy": "ignore"}}'])
    with pytest.raises(ValueError, match="policy"):
        apply_overrides(OverrideConfig(imports=bad), Tree())
    with pytest.raises(TypeError):
        apply_overrides(OverrideConfig(imports=[(OVERRIDE, {"init_scale": 2.0})]), Tree())


def _container(seed: int) -> tuple[Any, Any, Any]:
    """A one-process model, SGD and ``WatchedLRSchedulers`` as torchtitan builds them."""
    import torch

    import ampscope
    from ampscope.integrations.torchtitan import WatchedLRSchedulers

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizers = type("Optimizers", (list,), {})([optimizer])
    optimizers.model_parts = [model]
    schedulers = type("Schedulers", (), {})()
    schedulers.schedulers = [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)]
    watch = ampscope.GradWatch("observe", reporter=None)
    return model, optimizer, WatchedLRSchedulers(schedulers, optimizers, watch, False)


def _iterate(model: Any, optimizer: Any, container: Any, steps: int) -> list[tuple[float, Any]]:
    """``steps`` iterations clipping through torchtitan's ``clip_grad_norm_`` (at 0.01:
    every one clips); per iteration the total it returned and the record's grad_norm."""
    import torch
    from torchtitan.distributed import utils as dist_utils

    totals = []
    for _ in range(steps):
        model(torch.randn(3, 4)).square().mean().backward()
        params = list(model.parameters())
        totals.append(float(dist_utils.clip_grad_norm_(params, 0.01, foreach=True)))
        optimizer.step()
        container.step()
        optimizer.zero_grad()
    records = container.watch.telemetry.history()[-steps:]
    return list(zip(totals, [r.stats.grad_norm for r in records], strict=True))


def test_the_clip_gives_its_norms_whatever_other_containers_live() -> None:
    """One live container, then a second (never stepped, as an old trainer's not yet
    collected), then none: the record's grad_norm is the norm torchtitan's clip returned,
    before it clipped, never the clipped gradients' (0.01); no container is left owing
    norms to a clip that did not take them."""
    from norm_spies import NormSpies

    from ampscope.integrations import torchtitan

    first = _container(1)
    with NormSpies() as spies:
        one = _iterate(*first, steps=2)
        second = _container(2)
        two = _iterate(*first, steps=2)
        assert len(torchtitan._LIVE) == 2
    assert second[2].watch.telemetry.history() == []
    for total, grad_norm in one + two:
        assert total > 0.1
        assert math.isclose(grad_norm, total, rel_tol=1e-6)
    # The clip's pass gave every norm; the one pass is the second container's single
    # check (every live watch checks before a clip) of gradients it never had.
    assert spies.own_passes == 1
    first[2].close()
    second[2].close()
    # No live container: the wrapper is torchtitan's function, the watch (closed) idle.
    assert not torchtitan._LIVE
    none = _iterate(*first, steps=1)
    assert none[0][0] > 0.1
    assert len(first[2].watch.telemetry.history()) == 4
