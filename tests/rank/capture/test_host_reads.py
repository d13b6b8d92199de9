"""A sync census on the CPU: the training thread's host reads of tensor values
(``aten._local_scalar_dense``, what ``item()``/``bool(t)``/``float(t)`` dispatch to, counted
by ``support.HostReads``) of the scalers and the watch on the device transport (the
accelerators' route, forced on the CPU): ampscope adds none to torch's own."""

from __future__ import annotations

import torch
from helpers import Net, batch, use_device_transport
from support import HostReads

import ampscope
from ampscope.rank.capture.watch import WatchCapture


def _reads(front: torch.amp.GradScaler, steps: int = 3) -> int:
    """The reads of ``steps`` iterations after a warm-up one (which resolves the identity)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    count = 0
    for step in range(steps + 1):
        with HostReads() as census:
            front.scale(model(batch(step))).backward()
            front.step(opt)
            front.update()
        opt.zero_grad()
        count += census.count if step else 0
    return count


def test_a_scaler_reads_on_the_host_only_what_torch_reads() -> None:
    stock = _reads(torch.amp.GradScaler("cpu"))
    ours = ampscope.GradScaler("cpu", reporter=None)
    use_device_transport(ours)
    assert _reads(ours) == stock > 0, "torch's step() reads found_inf: the census sees it"
    ours.close()


def test_a_watch_reads_only_what_its_policy_needs() -> None:
    """Under ``observe`` none; under ``skip`` one per step, the skip decision itself (as
    torch's scaler's ``step()`` reads its found-inf). Attribution adds none on clean
    steps: on the device transport the local flags are named at a skipped ``step()``,
    never read at the check (the CPU's host transport reads them there, host memory)."""
    expected = {
        ("observe", False): 0,
        ("observe", True): 0,
        ("skip", False): 3,
        ("skip", True): 3,
    }
    for (policy, attribution), reads in expected.items():
        watch = ampscope.GradWatch(
            reporter=None, run_id="census", policy=policy, attribution=attribution
        )
        watch._ampscope_capture = WatchCapture(policy, read_on_host=False)
        assert _reads(watch) == reads, (policy, attribution)
        watch.close()
