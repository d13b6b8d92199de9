"""Replica fingerprints: exact (of the bits), per named piece, across bucket boundaries."""

from __future__ import annotations

import pytest
import torch

from ampscope.rank.replicas import fingerprint
from ampscope.rank.replicas.fingerprint import CHUNKS_PER_BUCKET, FingerprintPlan, Piece


def _pieces(tensors: dict[str, torch.Tensor]) -> list[Piece]:
    return [Piece(name, t, 0, t.numel()) for name, t in tensors.items()]


def _params(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"a.weight": (7, 5), "a.bias": (7,), "b.weight": (300, 3), "b.bias": (1,)}
    return {n: torch.randn(s, generator=gen).to(dtype) for n, s in shapes.items()}


def _flip(tensor: torch.Tensor, index: int, bit: int = 0) -> None:
    flat = tensor.view(-1)
    width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    flat.view(width)[index] ^= 1 << bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_one_flipped_bit_anywhere_changes_a_chunk_and_names_its_parameter(
    dtype: torch.dtype,
) -> None:
    params = _params(dtype)
    plan = FingerprintPlan(_pieces(params))
    clean = plan.chunks().clone()
    assert clean.dtype == torch.int64
    assert plan.size == CHUNKS_PER_BUCKET
    bits = params["a.weight"].element_size() * 8
    for name, index, bit in (("b.weight", 611, 0), ("a.bias", 3, bits - 1), ("b.bias", 0, 7)):
        _flip(params[name], index, bit)
        changed = (plan.chunks() != clean).nonzero().flatten().tolist()
        assert len(changed) == 1, (name, changed)
        named = [plan.pieces[i].name for i in plan.pieces_in(changed)]
        assert name in named
        # The per-piece pass tells the one that changed.
        before = plan.segments(plan.pieces_in(changed))
        _flip(params[name], index, bit)  # back
        after = plan.segments(plan.pieces_in(changed))
        differs = [n for n, x, y in zip(named, before, after, strict=True) if x != y]
        assert differs == [name]
        assert torch.equal(plan.chunks(), clean)


def test_a_change_a_float_sum_absorbs_still_changes_the_fingerprint() -> None:
    big = torch.tensor([1.0e8, 1.0, 0.0, 0.0])
    plan = FingerprintPlan(_pieces({"w": big}))
    clean = plan.chunks().clone()
    total = big.sum()
    _flip(big, 1)  # 1.0 -> 1.0 + 2**-23: lost in 1e8 + 1 in float32
    assert big.sum() == total
    assert not torch.equal(plan.chunks(), clean)


def test_a_piece_larger_than_a_bucket_spans_several(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fingerprint, "MAX_BUCKET", 256)
    params = _params()
    plan = FingerprintPlan(_pieces(params))
    assert plan.size == CHUNKS_PER_BUCKET * 4  # 35 + 7 + 900 + 1 = 943 int32 over 256
    clean = plan.chunks().clone()
    _flip(params["b.weight"], 899)  # its last element, in the last bucket
    changed = (plan.chunks() != clean).nonzero().flatten().tolist()
    assert len(changed) == 1
    assert changed[0] >= 3 * CHUNKS_PER_BUCKET  # in the last bucket
    assert "b.weight" in [plan.pieces[i].name for i in plan.pieces_in(changed)]


def test_pieces_of_a_flat_shard_are_named_apart() -> None:
    flat = torch.randn(40)
    plan = FingerprintPlan([Piece("x.weight", flat, 0, 30), Piece("x.bias", flat, 30, 10)])
    clean = plan.segments([0, 1]).clone()
    _flip(flat, 35)
    assert (plan.segments([0, 1]) != clean).tolist() == [False, True]


def test_one_byte_parameters_are_refused() -> None:
    with pytest.raises(TypeError, match="1-byte"):
        FingerprintPlan(_pieces({"mask": torch.zeros(4, dtype=torch.bool)}))


def _ops(plan: FingerprintPlan) -> list[str]:
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Count():
        plan.chunks()
    return seen


def test_a_check_runs_the_same_kernels_for_148_tensors_as_for_1480() -> None:
    gen = torch.Generator().manual_seed(1)
    few = {f"p{i}": torch.randn(64, generator=gen) for i in range(148)}
    many = {f"p{i}": torch.randn(64, generator=gen) for i in range(1480)}
    small, large = _ops(FingerprintPlan(_pieces(few))), _ops(FingerprintPlan(_pieces(many)))
    assert small == large
    assert len(small) <= 4  # the packed copy, the view, the sum


def test_a_channels_last_parameter_is_read_in_place() -> None:
    """A dense tensor in another memory format is viewed, not copied: a flip made after the
    plan was built is seen (a copy would be fingerprinted forever after)."""
    from ampscope.rank.replicas.fingerprint import FingerprintPlan, Piece, bit_view

    weight = torch.randn(4, 3, 5, 5).to(memory_format=torch.channels_last)
    assert not weight.is_contiguous()
    assert bit_view(weight).data_ptr() == weight.data_ptr()
    plan = FingerprintPlan([Piece("conv.weight", weight, 0, weight.numel())])
    clean = plan.chunks().clone()
    flipped = weight.permute(0, 2, 3, 1).contiguous().view(-1)  # storage order, a copy
    flipped.view(torch.int32)[7] ^= 1  # one low mantissa bit
    weight.copy_(flipped.view(4, 5, 5, 3).permute(0, 3, 1, 2))
    assert not torch.equal(plan.chunks(), clean)
