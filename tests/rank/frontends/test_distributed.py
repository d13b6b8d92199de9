"""Real 2-rank gloo runs: numerics parity with torch's stock scalers, local attribution.

One launch per setup; each worker trains ampscope's and torch's scaler side by side.
"""

from __future__ import annotations

from typing import Any

import pytest
from dist_setups import INJECT_STEPS, STEPS, ddp_worker, fsdp1_worker, fsdp2_worker
from support import run_distributed

pytestmark = pytest.mark.distributed

EXPECTED_SKIPS = [step in INJECT_STEPS for step in range(STEPS)]


def _assert_parity(result: dict[str, Any]) -> None:
    assert result["params_equal"], "parameters differ from torch's stock scaler"
    assert result["params_changed"], "training did not change the parameters"
    assert result["ours_scales"] == result["torch_scales"]
    assert result["ours_skips"] == result["torch_skips"] == EXPECTED_SKIPS
    assert result["record_skips"] == EXPECTED_SKIPS
    assert result["record_scales"] == result["torch_scales"]
    assert "growth" in result["events"], "growth_interval=3 should have grown the scale"
    assert [e == "backoff" for e in result["events"]] == EXPECTED_SKIPS
    assert result["snapshot_steps"] == STEPS
    assert result["snapshot_skipped"] == len(INJECT_STEPS)
    assert result["totals"]["skipped_steps"] == len(INJECT_STEPS)


def _assert_local_on_rank1_only(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        flagged = [step for step, local in enumerate(result["local"]) if local.get("cpu")]
        assert flagged == (sorted(INJECT_STEPS) if rank == 1 else []), f"rank {rank}"
        assert result["snapshot_local"] == {"cpu": len(INJECT_STEPS) if rank == 1 else 0}


def _named_at_injections(result: dict[str, Any], name: str) -> None:
    for step in range(STEPS):
        expected = {name: 1} if step in INJECT_STEPS else {}
        assert result["nonfinite"][step] == expected, f"step {step}"


def _assert_shared_identity(results: list[dict[str, Any]]) -> None:
    runs = {r["identity"]["run"] for r in results}
    assert len(runs) == 1, f"ranks disagree on the generated run id: {runs}"
    assert [r["identity"]["rank"] for r in results] == [0, 1]
    assert all(r["identity"]["world_size"] == 2 for r in results)


def test_fsdp1_parity_and_attribution() -> None:
    results = run_distributed(fsdp1_worker)
    for key, name in (
        ("use_orig_params=False", "0.bias"),
        ("use_orig_params=True", "2.weight"),
    ):
        per_rank = [r[key] for r in results]
        for result in per_rank:
            _assert_parity(result)
        _assert_local_on_rank1_only(per_rank)
        _named_at_injections(per_rank[1], name)
        assert all(n == {} for n in per_rank[0]["nonfinite"]), "rank 0 holds no inf"
        _assert_shared_identity(per_rank)


def test_fsdp2_parity_and_attribution() -> None:
    results = run_distributed(fsdp2_worker)
    for result in results:
        assert result["grad_type"] == "DTensor"
        _assert_parity(result)
        _assert_parity(result["tp"])
        _assert_parity(result["fused"])
    _assert_local_on_rank1_only(results)
    _assert_local_on_rank1_only([r["fused"] for r in results])
    _named_at_injections(results[1]["fused"], "2.weight")
    _named_at_injections(results[1], "2.weight")
    assert all(n == {} for n in results[0]["nonfinite"])
    _assert_shared_identity(results)
    # 2-D mesh: rank 1's NaN in its tensor-parallel shard is local to rank 1 only.
    tp = [r["tp"] for r in results]
    assert "Shard" in tp[0]["placements"]
    _assert_local_on_rank1_only(tp)
    _named_at_injections(tp[1], "0.weight")


def test_ddp_parity_local_and_origin() -> None:
    results = run_distributed(ddp_worker)
    for result in results:
        _assert_parity(result)
        # DDP reduces gradients inside backward: after it every rank holds the inf, so
        # every rank's local check fires, and the origin flag says where it came from.
        flagged = [step for step, local in enumerate(result["local"]) if local.get("cpu")]
        assert flagged == sorted(INJECT_STEPS)
        for step in INJECT_STEPS:
            assert "0.weight" in result["nonfinite"][step]
            assert not any(name.startswith("module.") for name in result["nonfinite"][step])
    for rank, result in enumerate(results):
        origin = [step for step, flags in enumerate(result["origin"]) if flags.get("cpu")]
        assert origin == (sorted(INJECT_STEPS) if rank == 1 else []), f"rank {rank}"
    _assert_shared_identity(results)
