"""The step's value layout: what the captures write is what the records' builder reads."""

from __future__ import annotations

import math

import torch

from ampscope.rank.capture import layout
from ampscope.rank.capture.layout import OptimizerSlot

ADAM = OptimizerSlot(index=0, name="AdamW", fused=False, stepped=True, num_flags=2)
SGD_NOT_STEPPED = OptimizerSlot(index=1, name="SGD", fused=False, stepped=False, num_flags=1)


def test_values_read_back_by_name() -> None:
    # Two optimizers (2 + 1 flags), two local devices, two origin devices, stats after.
    values = layout.head(1024.0, [0.0, 1.0, 0.0, 1.0, 0.0])
    values += layout.tail(512.0, 0.0, [0.0, 1.0])
    values += [3.5]  # a stats scalar (device transport)
    named = layout.decode(values, (ADAM, SGD_NOT_STEPPED), ("cuda:0", "cuda:1"), ("a", "b"))
    assert named.scale_before == 1024.0
    assert named.optimizer_found == [True, False]
    assert named.stepped_on_nonfinite is True
    assert named.local == (True, False)
    assert (named.scale_after, named.growth_tracker) == (512.0, 0)
    assert named.origin == (False, True)
    assert values[named.stats_at :] == [3.5]


def test_only_a_stepped_optimizer_makes_a_step_nonfinite() -> None:
    values = layout.head(8.0, [0.0, 0.0, 1.0]) + layout.tail(8.0, 3.0, [])
    named = layout.decode(values, (ADAM, SGD_NOT_STEPPED), (), ())
    assert named.optimizer_found == [False, True]
    assert named.stepped_on_nonfinite is False
    assert (named.scale_after, named.growth_tracker, named.stats_at) == (8.0, 3, len(values))


def test_a_clean_head_is_the_head_of_zero_flags() -> None:
    clean = layout.clean_head(64.0, (ADAM, SGD_NOT_STEPPED), ("cpu",))
    assert clean == layout.head(64.0, [0.0] * 4)
    assert layout.flag_count((ADAM, SGD_NOT_STEPPED), ("cpu",)) == 4


def test_tensors_follow_the_same_layout() -> None:
    # The device transport stacks tensors in the encoders' order; its host copy reads
    # back like the host transport's floats.
    scale, tracker = torch.tensor(4.0), torch.tensor(2.0)
    flags = [torch.tensor(0.0), torch.tensor(1.0)]
    stacked = torch.stack(layout.head(scale, flags) + layout.tail(scale, tracker, []))
    floats = layout.head(4.0, [0.0, 1.0]) + layout.tail(4.0, 2.0, [])
    assert stacked.tolist() == floats
    assert stacked[len(flags) + 1 + layout.SCALE_AFTER].item() == 4.0


def test_a_watch_writes_a_scale_of_one_and_no_tracker() -> None:
    assert (layout.WATCH_SCALE, layout.WATCH_TRACKER) == (1.0, 0.0)


def test_a_host_copy_is_cut_into_values_norms_and_extra() -> None:
    parts = layout.copy_parts(10, 3, 2)
    assert parts == layout.CopyParts(values=slice(0, 5), norms=slice(5, 8), extra=slice(8, 10))
    assert layout.copy_parts(6, 0, 2) == layout.CopyParts(slice(0, 4), None, slice(4, 6))
    assert layout.copy_parts(6, 2, 0) == layout.CopyParts(slice(0, 4), slice(4, 6), None)
    assert layout.copy_parts(6, 0, 0) == layout.CopyParts(slice(0, 6), None, None)


def _plain_decode(
    values: list[float], slots: tuple[OptimizerSlot, ...], local: int, origin: int
) -> tuple:
    """The layout read the long way: one value at a time."""
    at, found = 1, []
    for slot in slots:
        found.append(any(v > 0 for v in values[at : at + slot.num_flags]))
        at += slot.num_flags
    stepped = any(hit and slot.stepped for slot, hit in zip(slots, found, strict=True))
    local_flags = tuple(v > 0 for v in values[at : at + local])
    at += local
    after, tracker = values[at], int(values[at + 1])
    origin_flags = tuple(v > 0 for v in values[at + 2 : at + 2 + origin])
    return (values[0], found, stepped, local_flags, after, tracker, origin_flags, at + 2 + origin)


def test_decode_matches_the_layout_read_value_by_value() -> None:
    """Slots of one, several and no flags, stepped or not; NaN flags are not set (as ever)."""
    import random

    rng = random.Random(9)
    shapes = [
        (OptimizerSlot(index=0, name="a", fused=False, stepped=True, num_flags=1),),
        (
            OptimizerSlot(index=0, name="a", fused=True, stepped=True, num_flags=3),
            OptimizerSlot(index=1, name="b", fused=False, stepped=False, num_flags=1),
            OptimizerSlot(index=2, name="c", fused=False, stepped=True, num_flags=0),
        ),
        (),
    ]
    for slots in shapes:
        for _ in range(200):
            local, origin = rng.randrange(3), rng.randrange(3)
            flags = [
                rng.choice([0.0, 1.0, 2.0, math.nan, -1.0])
                for _ in range(layout.flag_count(slots, ["d"] * local))
            ]
            values = layout.head(8.0, flags) + layout.tail(
                4.0, 3.0, [rng.choice([0.0, 1.0, math.nan]) for _ in range(origin)]
            )
            decoded = layout.decode(values, slots, ["d"] * local, ["o"] * origin)
            assert tuple(decoded) == _plain_decode(values, slots, local, origin)
