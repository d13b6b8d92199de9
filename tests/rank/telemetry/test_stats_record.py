"""The stats' squared gradient norm on the telemetry thread: the float64 scratch vector
gives the very bits of the cast-and-dot it replaced, for every norm dtype and count."""

from __future__ import annotations

import pytest
import torch

from ampscope.rank.gradients.stats import OptimizerNorms
from ampscope.rank.telemetry import stats_record
from ampscope.rank.telemetry.stats_record import SMALL, _Float64Scratch, _square_sum


def _reference(norms: torch.Tensor) -> float:
    """What the telemetry thread computed before the scratch vector: float32, then float64."""
    wide = norms.float().double()
    return float(torch.dot(wide, wide).item())


def _optimizer(count: int, packed: torch.Tensor | None = None) -> OptimizerNorms:
    names = tuple(f"p{i}" for i in range(count))
    if packed is None:
        return OptimizerNorms(names, tuple(torch.zeros(()) for _ in range(count)), False, None)
    return OptimizerNorms(names, (), False, None, packed=packed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_packed_norms_of_every_dtype_give_the_bits_of_the_cast_and_dot(dtype: torch.dtype) -> None:
    scratch = _Float64Scratch()
    generator = torch.Generator().manual_seed(11)
    for count in (SMALL + 1, 148, 300, 148):  # counts change, and come back
        for _ in range(3):
            packed = (torch.rand(count, generator=generator, dtype=torch.float64) * 1e3).to(dtype)
            expected = _reference(packed)
            assert _square_sum(_optimizer(count, packed), None, 0, scratch) == expected
    assert stats_record.SMALL == SMALL


def test_slices_of_one_host_copy_read_each_optimizers_own_norms() -> None:
    """The device transport's host copy holds every optimizer's norms back to back: each
    sum reads its own slice, whether the whole copy or a part of it."""
    generator = torch.Generator().manual_seed(3)
    first, second = 100, 148
    host = torch.rand(first + second, generator=generator) * 50
    scratch = _Float64Scratch()
    assert _square_sum(_optimizer(first), host, 0, scratch) == _reference(host[:first])
    assert _square_sum(_optimizer(second), host, first, scratch) == _reference(host[first:])
    whole = torch.rand(second, generator=generator)
    assert _square_sum(_optimizer(second), whole, 0, scratch) == _reference(whole)


def test_separate_float64_norms_are_summed_in_float64_unrounded() -> None:
    """Norms kept one tensor each (a parameter without a gradient, DTensor or sparse
    gradients) in float64, as a float64 model's are: summed without a float32 rounding on
    the way, as the telemetry thread always did; only the packed vector is read in float32."""
    generator = torch.Generator().manual_seed(5)
    scratch = _Float64Scratch()
    for count in (SMALL + 1, 149, 700):
        values = torch.rand(count, generator=generator, dtype=torch.float64) / 3
        norms = tuple(values.unbind())
        optimizer = OptimizerNorms(tuple(f"p{i}" for i in range(count)), norms, False, None)
        expected = float(torch.dot(values, values).item())
        assert expected != _reference(values), "the float32 rounding would show"
        assert _square_sum(optimizer, None, 0, scratch) == expected


def test_the_scratch_vector_holds_no_stale_values() -> None:
    scratch = _Float64Scratch()
    ones, twos = torch.ones(150), torch.full((150,), 2.0)
    assert _square_sum(_optimizer(150, ones), None, 0, scratch) == 150.0
    assert _square_sum(_optimizer(150, twos), None, 0, scratch) == 600.0
    assert _square_sum(_optimizer(150, ones), None, 0, scratch) == 150.0


def test_a_few_norms_are_summed_exactly_from_any_of_their_forms() -> None:
    """Up to SMALL norms are summed on the host with fsum: the same value from the host
    copy, a packed vector or the separate 0-dim norms."""
    import math

    values = [0.1 * (i + 1) for i in range(SMALL)]
    as_float32 = torch.tensor(values, dtype=torch.float32)
    expected = math.fsum(v * v for v in as_float32.tolist())
    scratch = _Float64Scratch()
    separate = OptimizerNorms(
        tuple(f"p{i}" for i in range(SMALL)), tuple(as_float32.unbind()), False, None
    )
    assert _square_sum(separate, None, 0, scratch) == expected
    assert _square_sum(_optimizer(SMALL, as_float32), None, 0, scratch) == expected
    host = torch.cat([torch.ones(3), as_float32])
    assert _square_sum(_optimizer(SMALL), host, 3, scratch) == expected
