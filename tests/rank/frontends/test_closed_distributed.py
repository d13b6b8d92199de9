"""A front-end closed on one rank keeps taking part in every collective the open ranks make.

One launch per world size (2 and 4 real gloo ranks) runs seven scenarios in sequence: a
``GradWatch`` under ``skip`` and under ``raise``, each without and with a rerun closure,
and a ``GradScaler``; every front-end checks the replicas at every iteration (an all-gather
over the DDP group), and the last rank closes its front-end after ``CLOSE_AFTER``
iterations, and rank 0's data turns NaN at ``BAD_STEP`` (on every pass: a rerun reproduces
it). No collective mismatch and no hang: under ``skip`` every rank skips that step and the
weights stay alike on every rank; under ``raise`` every rank raises at it, the closed one
included; the scaler's ranks go on to the end. Two more run FSDP2 (sharded gradients, the
norm's all-reduce) with the loop's own ``unscale_()`` and a clip before ``step()``, a
``GradWatch`` under ``skip`` (clipping as the loop does, and keeping the clip's norms, or
announcing a clip that then does not keep them or clips other parameters) and a
``GradScaler``: every rank skips the NaN step together.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from support import DEADLOCK_GUARD_S, run_distributed

pytestmark = pytest.mark.distributed

STEPS = 6
CLIPS = ("watch-clip", "watch-unkept", "watch-subset")
"""The sharded scenarios whose clip is announced (``expect_clip()``)."""
CLOSE_AFTER = 2
BAD_STEP = 4


def _scenario(rank: int, world_size: int, policy: str, rerun: bool) -> dict[str, Any]:
    import torch
    from torch import nn

    import ampscope

    torch.manual_seed(3)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = ampscope.GradWatch(policy, reporter=None)
    watch.attach(model, replica_check_every=1)
    calls = 0
    skipped: list[int] = []
    raised = None
    data = torch.Generator().manual_seed(rank)
    for step in range(1, STEPS + 1):
        if step == CLOSE_AFTER + 1 and rank == world_size - 1:
            watch.close()
        x = torch.randn(3, 4, generator=data)
        if rank == 0 and step == BAD_STEP:
            x[0, 0] = float("nan")

        def closure(x: Any = x) -> Any:
            nonlocal calls
            calls += 1
            opt.zero_grad()
            loss = model(x).square().mean()
            watch.scale(loss).backward()
            return loss

        opt.zero_grad()
        watch.scale(model(x).square().mean()).backward()
        before = [p.detach().clone() for p in model.parameters()]
        try:
            watch.step(opt, rerun=closure if rerun else None)
        except ampscope.NonFiniteGradientsError as error:
            raised = error.step
            break
        watch.update()
        if all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)):
            skipped.append(step)
    watch.close()
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    return {"calls": calls, "skipped": skipped, "raised": raised, "checksum": checksum}


def _scaler_scenario(rank: int, world_size: int) -> dict[str, Any]:
    import torch
    from torch import nn

    import ampscope

    torch.manual_seed(3)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampscope.GradScaler("cpu", init_scale=2.0**4, reporter=None)
    scaler.attach(model, replica_check_every=1)
    data = torch.Generator().manual_seed(rank)
    done = 0
    for step in range(1, STEPS + 1):
        if step == CLOSE_AFTER + 1 and rank == world_size - 1:
            scaler.close()
        opt.zero_grad()
        scaler.scale(model(torch.randn(3, 4, generator=data)).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        done += 1
    scaler.close()
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    return {"done": done, "checksum": checksum}


def _sharded_scenario(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    """FSDP2 with the norms on (their all-reduce of sharded gradients), the loop's own
    ``unscale_()`` and a clip (another all-reduce) before ``step()``. ``watch-clip``: the
    clip keeps its norms (``expect_clip()``, ``clip_with_norms_()``, as the torchtitan and
    OLMo-core integrations clip), so the open ranks' checks make no norm all-reduce;
    ``watch-unkept``: the announced clip does not keep them (as OLMo-core's own clip where a
    callback changed ``max_grad_norm``), and its total still stands for the all-reduce;
    ``watch-subset``: the announced clip is of other parameters than the optimizer's."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import ampscope
    from ampscope.rank import compat
    from ampscope.rank.gradients.clip import total_norm_with_norms

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    front: Any = (
        ampscope.GradScaler("cpu", init_scale=2.0**4, reporter=None)
        if kind == "scaler"
        else ampscope.GradWatch("skip", reporter=None)
    )
    front.attach(model)
    data = torch.Generator().manual_seed(rank)
    skipped: list[int] = []
    totals: list[float] = []
    for step in range(1, STEPS + 1):
        if step == CLOSE_AFTER + 1 and rank == world_size - 1:
            front.close()
        opt.zero_grad()
        x = torch.randn(3, 4, generator=data)
        if rank == 0 and step == BAD_STEP:
            x[0, 0] = float("nan")
        front.scale(model(x).square().mean()).backward()
        if kind in CLIPS:
            front.expect_clip()
        front.unscale_(opt)
        params = list(model.parameters())
        if kind == "watch-subset":
            params = params[1:]  # not the optimizer's parameters: nothing to keep
        if kind in CLIPS:

            def clip(keep: bool, params: list[Any] = params) -> Any:
                # torch's clip of DTensor gradients (its per-tensor path), keeping norms.
                grads = [p.grad for p in params]
                total, norms = total_norm_with_norms(grads, 2.0, False, foreach=False)
                total = total.full_tensor()
                torch.nn.utils.clip_grads_with_norm_(params, 1.0, total)
                return total, compat.local_tensor(norms) if keep else None, total

            keep = kind != "watch-unkept"
            totals.append(float(front.clip_with_norms_(params, clip, keep)))
        else:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        before = [p.detach().to_local().clone() for p in model.parameters()]
        front.step(opt)
        front.update()
        after = [p.detach().to_local() for p in model.parameters()]
        if all(torch.equal(a, b) for a, b in zip(before, after, strict=True)):
            skipped.append(step)
    records = front.telemetry.history() if rank == 0 else []
    front.close()
    grad_norms = [r.stats.grad_norm for r in records]
    return {"skipped": skipped, "totals": totals, "grad_norms": grad_norms}


def _rank(rank: int, world_size: int) -> dict[Any, dict[str, Any]]:
    import torch

    torch.set_num_threads(1)
    results: dict[Any, dict[str, Any]] = {
        (policy, rerun): _scenario(rank, world_size, policy, rerun)
        for policy in ("skip", "raise")
        for rerun in (False, True)
    }
    results["scaler"] = _scaler_scenario(rank, world_size)
    for kind in ("watch", *CLIPS, "scaler"):
        results[("sharded", kind)] = _sharded_scenario(rank, world_size, kind)
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_closed_front_end_keeps_the_collectives_paired(world_size: int) -> None:
    results = run_distributed(_rank, world_size, timeout=6 * DEADLOCK_GUARD_S)
    for rerun in (False, True):
        skip = [out[("skip", rerun)] for out in results]
        assert [s["skipped"] for s in skip] == [[BAD_STEP]] * world_size, rerun
        assert len({s["checksum"] for s in skip}) == 1, rerun  # the weights stay alike
        assert [s["raised"] for s in skip] == [None] * world_size
        stopped = [out[("raise", rerun)] for out in results]
        assert [s["raised"] for s in stopped] == [BAD_STEP] * world_size, rerun
        # Every rank reran the flagged step once, the closed one included.
        expected = [1 if rerun else 0] * world_size
        assert [s["calls"] for s in skip] == expected
        assert [s["calls"] for s in stopped] == expected
    scaler = [out["scaler"] for out in results]
    assert [s["done"] for s in scaler] == [STEPS] * world_size
    assert len({s["checksum"] for s in scaler}) == 1
    # Sharded gradients with the norms on, the loop unscaling and clipping itself: every
    # rank skips the NaN step together (the scaler backs off), the closed one included.
    for kind in ("watch", *CLIPS, "scaler"):
        sharded = [out[("sharded", kind)] for out in results]
        assert [s["skipped"] for s in sharded] == [[BAD_STEP]] * world_size, kind
    # The clip's total is the record's norm (the whole model's, over the ranks), kept or
    # not; the NaN step's is NaN. A clip of other parameters gives none: null.
    assert results[0][("sharded", "watch-subset")]["grad_norms"] == [None] * STEPS
    for kind in ("watch-clip", "watch-unkept"):
        first = results[0][("sharded", kind)]
        assert len(first["grad_norms"]) == STEPS
        for step, (total, grad_norm) in enumerate(
            zip(first["totals"], first["grad_norms"], strict=True), start=1
        ):
            if step == BAD_STEP:
                assert math.isnan(total), kind
                assert grad_norm is None, kind
            else:
                assert math.isclose(grad_norm, total, rel_tol=1e-5), kind
