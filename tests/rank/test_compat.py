"""Fails loudly, naming what changed, when torch moves what ampscope reads."""

from __future__ import annotations

import pytest
import torch

from ampscope.rank import compat


def test_torch_still_matches_what_ampscope_reads() -> None:
    problems = compat.check_torch()
    assert problems == (), "torch changed under ampscope.rank.compat:\n" + "\n".join(problems)


def test_wrapper_prefixes_are_removed() -> None:
    assert compat.clean_param_name("_fsdp_wrapped_module.layers.0.w") == ("layers.0.w", False)
    assert compat.clean_param_name("_orig_mod.layers.0._checkpoint_wrapped_module.w") == (
        "layers.0.w",
        False,
    )
    assert compat.clean_param_name("_fsdp_wrapped_module._flat_param") == ("", True)
    assert compat.clean_param_name("layers.1._fsdp_wrapped_module._flat_param") == (
        "layers.1.",
        True,
    )


def test_check_names_what_a_changed_torch_broke(monkeypatch: pytest.MonkeyPatch) -> None:
    # The self-check must be able to fail: simulate a torch that renamed three things.
    from torch.amp.grad_scaler import GradScaler
    from torch.distributed.fsdp import FSDPModule

    def renamed(self: object, optimizer: object, inv_scale: object, found: object) -> None: ...

    monkeypatch.setattr(GradScaler, "_unscale_grads_", renamed)
    monkeypatch.delattr(FSDPModule, "set_custom_reduce_scatter")
    monkeypatch.delattr(compat.fsdp_default_hooks, "reduce_scatter_hook")
    compat.check_torch.cache_clear()
    try:
        problems = "\n".join(compat.check_torch())
    finally:
        compat.check_torch.cache_clear()
    assert "GradScaler._unscale_grads_ signature changed" in problems
    assert "set_custom_reduce_scatter no longer exists" in problems
    assert "no longer define reduce_scatter_hook" in problems


class _State:
    """Stands in for FSDP2's per-module state: only the attribute under test is set."""


class _Module:
    def __init__(self, state: _State) -> None:
        self._state = state

    def _get_fsdp_state(self) -> _State:
        return self._state


def test_fully_shard_param_groups_reads_both_torch_layouts() -> None:
    # torch 2.13 keeps a list of groups; torch 2.11 (seen on the GPU machine) one or None.
    listed, single, empty = _State(), _State(), _State()
    listed._fsdp_param_groups = ["g0", "g1"]  # type: ignore[attr-defined]
    single._fsdp_param_group = "g0"  # type: ignore[attr-defined]
    empty._fsdp_param_group = None  # type: ignore[attr-defined]
    read = compat.fully_shard_param_groups
    assert read(_Module(listed)) == ["g0", "g1"]  # type: ignore[arg-type]
    assert read(_Module(single)) == ["g0"]  # type: ignore[arg-type]
    assert read(_Module(empty)) == []  # type: ignore[arg-type]


def test_a_changed_clip_grad_norm_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The front-ends' clip repeats torch's pass: a torch whose clip computes its total
    norm differently is reported."""
    from torch.nn.utils import clip_grad

    def other_total(tensors: list[torch.Tensor], *args: object) -> torch.Tensor:
        return torch.linalg.vector_norm(torch.cat([t.flatten() for t in tensors]))

    assert compat._check_clip() == []
    monkeypatch.setattr(clip_grad, "_get_total_norm", other_total)
    assert any("clip_grad_norm_" in p for p in compat._check_clip())


def test_the_pinned_torchs_unscale_is_the_one_the_scalers_shortcut_does() -> None:
    """The scalers' unscale without torch's walk (``unscale_one_group_``) is taken only for
    torch code whose fingerprint is known: the pinned torch's must be (a new pin fails
    here until its fingerprint is read and added), and no other code is."""
    assert compat.unscale_unchanged()
    assert compat.torch_unscale_unpatched()


def test_another_unscale_is_not_the_shortcuts(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch code that differs in one line (a cast of bfloat16 gradients, say) is not
    recognised, where a check for a few lines of it would pass it."""
    from torch.amp.grad_scaler import GradScaler

    def unscale(self, optimizer, inv_scale, found_inf, allow_fp16):  # type: ignore[no-untyped-def]
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                to_unscale = param.grad
                if to_unscale.dtype == torch.bfloat16:
                    to_unscale = to_unscale.float()
        return GradScaler._unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16)

    monkeypatch.setattr(compat, "TORCH_UNSCALE", unscale)
    assert not compat.unscale_unchanged.__wrapped__()
    monkeypatch.undo()
    monkeypatch.setattr(torch.amp.GradScaler, "_unscale_grads_", unscale)
    assert not compat.torch_unscale_unpatched()
