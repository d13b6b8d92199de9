"""ampscope's repeat of torchtitan's and OLMo-core's gradient clips against the real ones,
on two gloo ranks: the same total and clipped gradients, bit for bit, and the norms the
watch's own pass computed before (each shard's, this stage's total)."""

from __future__ import annotations

import logging
import math

import pytest
from clip_repeat_workers import CLOSE_AFTER, LOOP_STEPS, clip_worker
from support import need_module, run_distributed

need_module("torchtitan")
need_module("triton")  # torchtitan imports it on every device
need_module("olmo_core")

SAME = {"total": True, "grads": True, "local": True, "stage": True, "nan": False}


@pytest.mark.distributed
def test_the_repeats_are_the_libraries_clips_bit_for_bit() -> None:
    results = run_distributed(clip_worker, 2)
    for result in results:
        assert result["recognised"] == [True, True]
        for case in ("torchtitan", "torchtitan_pp", "torchtitan_plain"):
            assert result[case] == SAME, case
        for case in ("olmo_core", "olmo_core_plain"):
            assert result[case] == SAME, case
        # A NaN gradient: the same NaN total and gradients; the shard's norm shows it.
        assert result["torchtitan_nan"] == result["olmo_core_nan"] == {**SAME, "nan": True}
        # Everything the repeat does not cover is the library's own function's.
        assert result["left"] == result["left_names"]
    # torchtitan's loop with rank 0's watch closed: every rank made the same collectives
    # (each sentinel all-reduce met its peer), and the open rank's records hold the norm
    # torchtitan's clip returned (kept from it, or the optimizer's own where it steps a
    # subset, until a rank closes), never the clipped gradients'.
    for name in ("observe", "skip", "observe-subset", "skip-subset"):
        loops = [result["loops"][name] for result in results]
        for loop in loops:
            assert loop["sentinels"] == [2.0 * step for step in range(LOOP_STEPS)], name
        open_rank = loops[1]
        assert len(open_rank["grad_norms"]) == LOOP_STEPS
        pairs = zip(open_rank["totals"], open_rank["grad_norms"], strict=True)
        for step, (total, grad_norm) in enumerate(pairs):
            assert total > 0.1
            if not name.endswith("subset"):
                assert math.isclose(grad_norm, total, rel_tol=1e-5), name
            elif step < CLOSE_AFTER:
                assert 0.01 < grad_norm < total, name
            else:  # the closed rank pairs the norm's all-reduce with NaN
                assert grad_norm is None, name
        assert len(loops[0]["grad_norms"]) == CLOSE_AFTER


def test_another_release_is_not_repeated(caplog: pytest.LogCaptureFixture) -> None:
    from ampscope.integrations import _clip_repeat

    def clip_grad_norm_(parameters: object, max_norm: float) -> None:
        """Another release's function."""

    with caplog.at_level(logging.INFO, logger="ampscope"):
        known = _clip_repeat.fingerprint(clip_grad_norm_)
        assert _clip_repeat.recognised(clip_grad_norm_, known, "the clip")
        assert not caplog.text
        assert not _clip_repeat.recognised(clip_grad_norm_, "0" * 64, "the clip")
        assert not _clip_repeat.recognised(len, known, "a builtin")  # no source to read
    assert "the clip is not the code ampscope repeats" in caplog.text
    assert "could not read a builtin" in caplog.text


def test_another_olmo_core_clip_stays_its_own(caplog: pytest.LogCaptureFixture) -> None:
    """A train module whose ``_clip_grad_norm`` is not OLMo-core 3.0's keeps its method; the
    watch norms in its own pass, as before."""
    from ampscope.integrations.olmo_core import _KeptClip

    class TrainModule:
        max_grad_norm = 1.0

        def _clip_grad_norm(self, max_grad_norm: float) -> str:
            return "its own"

    module = TrainModule()
    with caplog.at_level(logging.INFO, logger="ampscope"):
        assert _KeptClip.install(module, watch=None) is None  # type: ignore[arg-type]
    assert "_clip_grad_norm" not in vars(module)
    assert "TrainModule._clip_grad_norm is not the code ampscope repeats" in caplog.text


def test_an_error_of_ampscopes_leaves_the_clip_to_the_library(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from ampscope.integrations import _clip_repeat

    _clip_repeat._warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="ampscope"):
        # Not a parameter: reading its gradient fails inside ampscope, never in training.
        assert _clip_repeat.keeping_call({}, [object()], 1.0, 2.0, False, True) is None  # type: ignore[list-item]
        assert _clip_repeat.keeping_call({}, [object()], 1.0, 2.0, False, True) is None  # type: ignore[list-item]
    assert caplog.text.count("could not tell whether the clip keeps its norms") == 1


def test_a_changed_torch_clip_leaves_the_clip_to_the_library(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The repeat copies torch's ``get_total_norm``: where compat's check of torch's clip
    finds it changed, nothing is repeated."""
    import torch

    from ampscope.integrations import _clip_repeat
    from ampscope.rank import compat

    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    assert _clip_repeat.keeping_call({}, [param], 1.0, 2.0, False, True) is not None
    monkeypatch.setattr(compat, "_check_clip", lambda: ["changed"])
    compat.clip_unchanged.cache_clear()
    try:
        assert _clip_repeat.keeping_call({}, [param], 1.0, 2.0, False, True) is None
    finally:
        monkeypatch.undo()
        compat.clip_unchanged.cache_clear()


def test_the_olmo_core_clip_goes_back_as_it_was() -> None:
    """``remove()`` puts back an instance ``_clip_grad_norm`` set before ampscope's, and
    leaves one set after it alone."""
    from olmo_core.train.train_module.transformer.train_module import TransformerTrainModule

    from ampscope.integrations.olmo_core import _KeptClip

    class TrainModule:
        _clip_grad_norm = TransformerTrainModule._clip_grad_norm
        max_grad_norm = 1.0

    def before(*args: object) -> None: ...

    def after(*args: object) -> None: ...

    module = TrainModule()
    module._clip_grad_norm = before  # type: ignore[method-assign]
    kept = _KeptClip.install(module, watch=None)  # type: ignore[arg-type]
    assert kept is not None
    assert vars(module)["_clip_grad_norm"] is not before
    kept.remove()
    assert vars(module)["_clip_grad_norm"] is before
    kept = _KeptClip.install(module, watch=None)  # type: ignore[arg-type]
    assert kept is not None
    module._clip_grad_norm = after  # type: ignore[method-assign]
    kept.remove()
    assert vars(module)["_clip_grad_norm"] is after
    del module._clip_grad_norm
    kept = _KeptClip.install(module, watch=None)  # type: ignore[arg-type]
    assert kept is not None
    kept.remove()
    assert "_clip_grad_norm" not in vars(module)
