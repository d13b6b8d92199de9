"""bench.deepspeed_hooks: every variant runs its check on the backward it times, and the
report names each (the figures themselves are not asserted)."""

from __future__ import annotations

import pytest
import torch

from bench import deepspeed_hooks


@pytest.mark.parametrize("variant", deepspeed_hooks.VARIANTS[1:])
def test_each_variant_checks_the_backward_it_times(variant: str) -> None:
    torch.manual_seed(0)
    run = deepspeed_hooks._Backward(variant)
    flags = run.hooks or run.boundary or run.bucket
    assert flags is not None
    assert [flags is run.hooks, flags is run.boundary, flags is run.bucket].count(True) == 1
    taken: list[tuple[dict[str, bool], dict[str, int]]] = []
    take = flags.take

    def recorded() -> tuple[dict[str, bool], dict[str, int]]:
        taken.append(take())
        return taken[-1]

    flags.take = recorded  # type: ignore[method-assign]
    run.block(2)
    assert flags.errors == 0, "every check ran"
    assert taken == [({"cpu": False}, {})] * 2, "a clean model flags nothing"
    # The check the block times is the one that sees a fault: a NaN weight makes the
    # backward's gradients NaN, and the next block's check names them.
    name, param = next(iter(run.model.named_parameters()))
    with torch.no_grad():
        param.view(-1)[0] = float("nan")
    run.block(1)
    found, names = taken[-1]
    assert found == {"cpu": True}
    assert name in names


def test_the_report_names_every_checked_variant(capsys: pytest.CaptureFixture[str]) -> None:
    deepspeed_hooks.main(["--groups", "2", "--steps", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(",")[1].split(":")[0].strip() for line in lines] == list(
        deepspeed_hooks.VARIANTS[1:]
    )


def test_the_zero3_variant_checks_through_the_wrap() -> None:
    """bucket3 times DeepSpeed's own call of the name-mangled reduction: the wrap checks the
    bucket's gradients there and names a poisoned one by its ds_id."""
    torch.manual_seed(0)
    run = deepspeed_hooks._Backward("bucket3")
    assert run.zero3 is not None
    assert run.bucket is not None
    run.model.zero_grad(set_to_none=True)
    run.model(run.tokens, run.targets).backward()
    name, param = next(iter(run.model.named_parameters()))
    assert param.grad is not None
    param.grad.view(-1)[0] = float("nan")
    run.zero3.reduce()
    assert run.bucket.take() == ({"cpu": True}, {name: 1})
