"""SharedParts: one object per distinct part, equal to what strict validation builds."""

from __future__ import annotations

from dataclasses import replace

from ampscope.rank.capture.layout import OptimizerSlot
from ampscope.rank.telemetry.shared_parts import SharedParts
from ampscope.reporter.schema import OptimizerDetail

ADAMW = OptimizerSlot(index=0, name="AdamW", fused=False, stepped=True, num_flags=1)
SGD = OptimizerSlot(index=1, name="SGD", fused=True, stepped=True, num_flags=1)


def test_flag_dicts_are_shared_per_combination() -> None:
    parts = SharedParts(k=3)
    first = parts.flags(("cuda:0", "cuda:1"), (False, True))
    assert first == {"cuda:0": False, "cuda:1": True}
    assert parts.flags(("cuda:0", "cuda:1"), (False, True)) is first
    assert parts.flags(("cuda:0", "cuda:1"), (False, False)) is not first


def test_optimizer_lists_are_shared_per_slots_and_flags() -> None:
    parts = SharedParts(k=3)
    # A capture hands a new tuple of the same slot objects every step.
    first = parts.optimizers((ADAMW, SGD), [False, True], False)
    assert parts.optimizers((ADAMW, SGD), [False, True], False) is first
    assert first == [
        OptimizerDetail(index=0, name="AdamW", found_inf=False, fused=False),
        OptimizerDetail(index=1, name="SGD", found_inf=True, fused=True),
    ]
    assert parts.optimizers((ADAMW, SGD), [False, False], False) is not first
    # Other slot objects, even equal ones, get their own list, with their own values.
    renamed = parts.optimizers((ADAMW, replace(SGD, name="Adam")), [False, True], False)
    assert [d.name for d in renamed] == ["AdamW", "Adam"]
    # Strictly validated parts are built afresh and not kept.
    strict = parts.optimizers((ADAMW, SGD), [False, True], True)
    assert strict == first
    assert strict is not first
    assert parts.optimizers((ADAMW, SGD), [False, True], False) is first


def test_named_parameters_are_the_k_most_counted() -> None:
    parts = SharedParts(k=2)
    named = parts.named({"a": 1, "b": 5, "c": 5}, False)
    assert [(p.name, p.count) for p in named] == [("b", 5), ("c", 5)]
    assert parts.named({"a": 1}, True)[0].count == 1
