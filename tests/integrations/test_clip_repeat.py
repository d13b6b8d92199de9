"""ampscope's repeat of torchtitan's and OLMo-core's gradient clips against the real ones,
on two gloo ranks: the same total and clipped gradients, bit for bit, and the norms the
watch's own pass computed before (each shard's, this stage's total)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
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


class _CountedParameter(torch.nn.Parameter):
    """A parameter that counts the reads of its ``.grad`` (by Python code; torch's
    kernels read the gradient in C++)."""

    reads = 0

    @property  # type: ignore[override]
    def grad(self) -> torch.Tensor | None:
        _CountedParameter.reads += 1
        return torch.Tensor.grad.__get__(self)  # type: ignore[attr-defined,no-any-return]

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        torch.Tensor.grad.__set__(self, value)  # type: ignore[attr-defined]


def test_a_decision_ahead_of_the_clip_reads_no_gradient_once_the_layout_is_known() -> None:
    """OLMo-core decides before its check whether the clip keeps its norms, and reads the
    gradients again when it clips: with ``read_grads=False`` the decision on a known
    parameter list reads none (the layout learnt on first sight and the arguments decide
    alone); :func:`with_grads` reads them at the clip and hands a missing one to the
    library. A caller that decides at the clip (torchtitan) still reads them then."""
    from ampscope.integrations import _clip_repeat

    params = [_CountedParameter(torch.ones(3)) for _ in range(4)]
    for param in params:
        param.grad = torch.ones(3)
    layouts: _clip_repeat.Layouts = {}
    ids = tuple(map(id, params))
    _CountedParameter.reads = 0
    first = _clip_repeat.keeping_call(
        layouts, params, 1.0, 2.0, False, None, ids=ids, read_grads=False
    )
    assert first is not None
    assert len(first.grads) == 4
    assert _CountedParameter.reads == 4  # first sight: the layout needs the gradients
    _CountedParameter.reads = 0
    call = _clip_repeat.keeping_call(
        layouts, params, 1.0, 2.0, False, None, ids=ids, read_grads=False
    )
    assert call is not None
    assert call.grads == []
    assert _CountedParameter.reads == 0
    ready = _clip_repeat.with_grads(call)
    assert ready is not None
    assert all(g is p.grad for g, p in zip(ready.grads, params, strict=True))
    assert _CountedParameter.reads == 4 + 4
    params[2].grad = None  # e.g. a callback's, between the decision and the clip
    assert _clip_repeat.with_grads(call) is None
    # Reading at the decision (torchtitan's caller) still sees the missing gradient.
    assert _clip_repeat.keeping_call(layouts, params, 1.0, 2.0, False, None, ids=ids) is None


def test_olmo_core_clip_with_a_gradient_missing_keeps_the_records_and_the_weights() -> None:
    """A parameter without a gradient on one step (unused, or dropped by a callback): the
    decision ahead of the clip, made from the known layout, said keep; the clip finds the
    gradient missing and runs OLMo-core's own clip. The weights are OLMo-core's, bit for
    bit, and every record's ``grad_norm`` is the total OLMo-core's clip returned."""
    from olmo_core.train.train_module.transformer.train_module import TransformerTrainModule

    import ampscope
    from ampscope.integrations.olmo_core import _KeptClip

    class TrainModule:
        _clip_grad_norm = TransformerTrainModule._clip_grad_norm
        max_grad_norm = 0.5

        def __init__(self, model: torch.nn.Module) -> None:
            self.model = model

    def make() -> torch.nn.Module:
        torch.manual_seed(5)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    missing_at = 2
    ours, stock = make(), make()
    module = TrainModule(ours)
    watch = ampscope.GradWatch(reporter=None)
    watch.attach(ours)
    kept = _KeptClip.install(module, watch)
    assert kept is not None
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, stock)]
    totals = []
    for step in range(5):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
        for model in (ours, stock):
            loss = model(x).square().mean()
            if model is ours:
                watch.scale(loss)
            loss.backward()
            if step == missing_at:
                model[2].bias.grad = None
        totals.append(TransformerTrainModule._clip_grad_norm(TrainModule(stock), 0.5).item())
        if kept.keeps_norms():
            watch.expect_clip()
        watch.unscale_(opts[0])
        module._clip_grad_norm(0.5)  # type: ignore[call-arg]
        watch.step(opts[0])
        watch.update()
        opts[1].step()
        for opt in opts:
            opt.zero_grad()
    kept.remove()
    norms = [r.stats.grad_norm if r.stats else None for r in watch.telemetry.history()]
    watch.close()
    assert norms == pytest.approx(totals, rel=1e-6)
    for a, b in zip(ours.parameters(), stock.parameters(), strict=True):
        assert torch.equal(a, b)
