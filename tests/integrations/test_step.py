"""``StepThroughWatch``: a library's own ``optimizer.step()`` call under a watch's policy."""

from __future__ import annotations

import torch

import ampscope
from ampscope.integrations._step import StepThroughWatch


def _model_and_optimizer() -> tuple[torch.nn.Linear, torch.optim.SGD]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.5)


def test_the_library_call_goes_through_the_policy_and_the_method_comes_back() -> None:
    model, optimizer = _model_and_optimizer()
    watch = ampscope.GradWatch("skip", reporter=None)
    stepper = StepThroughWatch(watch, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)  # wraps ours
    before = model.weight.detach().clone()
    model(torch.ones(1, 3)).sum().backward()
    model.weight.grad[0, 0] = float("nan")  # type: ignore[index]
    optimizer.step()  # the library's call: skipped
    assert watch.last_step_skipped
    watch.update()
    assert torch.equal(model.weight, before)
    optimizer.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()  # clean: stepped
    watch.update()
    scheduler.step()
    assert not torch.equal(model.weight, before)
    assert [r.skipped for r in watch.telemetry.history()] == [True, False]
    stepper.remove()
    # The scheduler wrapped ours and stays; the closed watch then passes the step through.
    assert "step" in vars(optimizer)
    assert not hasattr(vars(optimizer)["step"], "__self__")
    stepper.remove()  # idempotent
    watch.close()


def test_remove_restores_the_class_method() -> None:
    _, optimizer = _model_and_optimizer()
    watch = ampscope.GradWatch(reporter=None)
    stepper = StepThroughWatch(watch, optimizer)
    assert "step" in vars(optimizer)
    stepper.remove()
    assert "step" not in vars(optimizer)
    watch.close()
