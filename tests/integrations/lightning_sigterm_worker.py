"""A Lightning run stopped by SIGTERM, run as its own process by ``test_lightning.py``.

``python lightning_sigterm_worker.py OUT`` trains a small bf16 model on the CPU with
``AmpscopeCallback`` and Lightning's ``OnExceptionCheckpoint`` (reporting wherever
``AMPSCOPE_URL`` says, run id ``AMPSCOPE_RUN_ID``), writes ``OUT/started`` at its sixth
batch, and goes on stepping until it is stopped. Lightning installs its SIGTERM handler
after the callback built its reporter, and chains the one it replaced (ampscope's):
Lightning then stops at the batch's end with its ``SIGTERMException``, which the checkpoint
callback saves on (``OUT/on_exception.ckpt``), and the process exits normally.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint

from ampscope.integrations.lightning import AmpscopeCallback


class Module(pl.LightningModule):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.out = out

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if batch_idx == 5:
            (self.out / "started").touch()
        time.sleep(0.01)  # a step that takes a while: SIGTERM lands within one
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(out: Path) -> None:
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.randn(400_000, 4), batch_size=8)
    trainer = pl.Trainer(
        accelerator="cpu",
        precision="bf16-mixed",
        max_epochs=1,
        logger=False,
        default_root_dir=str(out),
        enable_progress_bar=False,
        callbacks=[AmpscopeCallback(), OnExceptionCheckpoint(dirpath=str(out))],
    )
    trainer.fit(Module(out), data)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
