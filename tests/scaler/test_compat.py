"""Fails loudly, naming what changed, when torch moves what ampscope reads."""

from __future__ import annotations

from ampscope.scaler import compat


def test_torch_still_matches_what_ampscope_reads() -> None:
    problems = compat.check_torch()
    assert problems == (), "torch changed under ampscope.scaler.compat:\n" + "\n".join(problems)


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
