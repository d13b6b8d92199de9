"""One rank of tests/rank/frontends/test_stop_distributed.py, run as a script:
``python stop_ranks.py [--no-numpy] [--no-gather]``, with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set. Prints one JSON line: the
``NonFiniteGradientsError`` this rank raised, and whether NumPy could be imported.

``--no-numpy`` hides NumPy before anything else is imported, as in an environment without
it: every finder on ``sys.meta_path`` is wrapped so that it finds nothing named ``numpy``.
Python's import system then does what it does for a package that is not installed:
``importlib.util.find_spec("numpy")`` is ``None`` and ``import numpy`` raises
``ModuleNotFoundError``; every way to NumPy goes through it (torch's C++ NumPy bridge
too, by ``PyImport_ImportModule``). torch then starts as it does without NumPy ("Failed to
initialize NumPy") and ``Tensor.numpy()`` raises. So this stands for a venv without NumPy
without building one.

``--no-gather`` makes every ``torch.distributed.all_gather`` raise: the reports cannot
be gathered.
"""

from __future__ import annotations

import importlib.abc
import json
import os
import sys
from typing import Any

STEPS = 3
INJECT = 1
BAD_RANK = 1


class _WithoutNumpy(importlib.abc.MetaPathFinder):
    """A finder that finds what ``inner`` finds, except NumPy."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name == "numpy" or name.startswith("numpy."):
            return None
        find = getattr(self.inner, "find_spec", None)
        return None if find is None else find(name, path, target)

    def invalidate_caches(self) -> None:
        invalidate = getattr(self.inner, "invalidate_caches", None)
        if invalidate is not None:
            invalidate()


def _numpy_importable() -> bool:
    try:
        import numpy  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    if "--no-numpy" in sys.argv:
        sys.meta_path[:] = [_WithoutNumpy(finder) for finder in sys.meta_path]
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ampscope

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if "--no-gather" in sys.argv:

        def refuse(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("all_gather refused (test)")

        dist.all_gather = refuse
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
    watch = ampscope.GradWatch("raise", reporter=None, run_id="stop-test")
    watch.attach(model, track_origin=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, Any] = {"rank": rank, "numpy": _numpy_importable()}
    try:
        for step in range(STEPS):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + step))
            if rank == BAD_RANK and step == INJECT:
                x = x * 3e38  # this rank's own gradients turn inf/NaN
            watch.scale(model(x).square().mean()).backward()
            watch.step(optimizer)
            watch.update()
            optimizer.zero_grad()
    except ampscope.NonFiniteGradientsError as error:
        out.update(
            message=str(error),
            step=error.step,
            origin_ranks=error.origin_ranks,
            gathered=error.gathered,
        )
    watch.close()
    # DDP's reducer holds the process group: drop it first, as torch's teardown expects.
    del model, optimizer, watch
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)
    # The answer is out. Leave without the interpreter's teardown of torch's C++ threads,
    # which once aborted a rank here after it had answered ("terminate called without an
    # active exception"): a crash in torch's exit path, not in what this test checks.
    os._exit(0)


if __name__ == "__main__":
    main()
