"""The replica check on a CUDA GPU (the CPU tests are tests/integration/
test_replica_divergence.py and test_fingerprint.py): fingerprints of CUDA tensors see one
flipped bit; three gloo ranks sharing the one GPU (DDP over CUDA tensors, an fp16
GradScaler) name the rank and the parameter; an iteration that does not check makes no
host-device sync. Skips without CUDA (CI has none)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support import DEADLOCK_GUARD_S, run_distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

EVERY, FLIP_STEP, FLIP_RANK, STEPS = 2, 3, 1, 8


def _flip(tensor: torch.Tensor, index: int) -> None:
    bits = tensor.detach().view(-1).view(torch.int16 if tensor.element_size() == 2 else torch.int32)
    bits[index] ^= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fingerprints_of_cuda_tensors_see_one_flipped_bit(dtype: torch.dtype) -> None:
    from ampscope.rank.replicas.fingerprint import FingerprintPlan, Piece

    params = {
        n: torch.randn(s, device="cuda").to(dtype) for n, s in (("w", (512, 64)), ("b", (9,)))
    }
    plan = FingerprintPlan([Piece(n, t, 0, t.numel()) for n, t in params.items()])
    clean = plan.chunks().cpu()
    assert torch.equal(plan.chunks().cpu(), clean)  # deterministic
    _flip(params["w"], 4097)
    changed = (plan.chunks().cpu() != clean).nonzero().flatten().tolist()
    assert len(changed) == 1
    assert [plan.pieces[i].name for i in plan.pieces_in(changed)] == ["w"]


def _rank(rank: int, world_size: int) -> dict[str, Any]:
    from torch import nn

    import ampscope
    from ampscope.rank.replicas.check import ReplicaCheck

    del world_size
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(64, 128), nn.Dropout(0.1), nn.Linear(128, 8)).cuda(),
        device_ids=[0],
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = ampscope.GradScaler("cuda", reporter=None, replica_check_every=EVERY)
    scaler.attach(model)
    data = torch.Generator(device="cuda").manual_seed(rank)
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        x = torch.randn(16, 64, device="cuda", generator=data)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        if rank == FLIP_RANK and step == FLIP_STEP:
            _flip(model.module[2].weight, 5)
        scaler.update()
    records = scaler.telemetry.history()
    scaler.close()
    # A call that does not check makes no host-device sync (the next one checks).
    check = ReplicaCheck(model, 2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        quiet = check.after_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    loud = check.after_step()
    return {
        "checks": [(r.step, r.replicas.model_dump()) for r in records if r.replicas is not None],
        "quiet": quiet,
        "loud_agree": None if loud is None else loud.agree,
    }


def test_three_ranks_on_one_gpu_name_the_flipped_rank_and_parameter() -> None:
    results = run_distributed(_rank, 3, timeout=6 * DEADLOCK_GUARD_S)
    for out in results:
        steps = [step for step, _ in out["checks"]]
        assert steps == list(range(EVERY, STEPS + 1, EVERY))
        for step, check in out["checks"]:
            if step < FLIP_STEP:
                assert check["agree"], check
            else:
                assert not check["agree"], check
                assert check["ranks"] == [FLIP_RANK]
                assert check["majority"]
                assert check["parameters"] == ["2.weight"]
        assert out["quiet"] is None
        assert out["loud_agree"] is False  # rank 1's weight still differs
