"""What the ``ampscope status`` tests share: the command run as a user runs it, and a real
scaler reporting to an exporter."""

from __future__ import annotations

import os
import subprocess
import sys


def run_status(*args: str, url: str | None = None) -> subprocess.CompletedProcess[str]:
    """``ampscope status ARGS`` in a subprocess; ``AMPSCOPE_URL`` is ``url`` or unset."""
    env = {k: v for k, v in os.environ.items() if k != "AMPSCOPE_URL"}
    if url is not None:
        env["AMPSCOPE_URL"] = url
    return subprocess.run(
        [sys.executable, "-m", "ampscope.cli", "status", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


def train_scaler(url: str, run: str, steps: int, overflow: set[int]) -> None:
    """A real ampscope GradScaler on CPU reporting ``run`` to ``url``; inf injected at the
    ``overflow`` steps. Its identity comes from the environment, as on a real rank."""
    import torch

    import ampscope
    from ampscope.reporter.http import HttpReporter

    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = ampscope.GradScaler(
        "cpu",
        init_scale=2.0**10,
        growth_interval=1000,
        reporter=HttpReporter(url, flush_interval=0.05),
        run_id=run,
    )
    for step in range(1, steps + 1):
        batch = torch.ones(2, 4)
        if step in overflow:
            batch[0, 0] = float("inf")
        scaler.scale(model(batch).pow(2).mean()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    scaler.close()
