"""One rank of the two-node end-to-end job, started by torchrun (see test_e2e_two_nodes.py).

Trains two of the demo's runs with the demo's FSDP2 trainer. Both faults sit on the node
whose agent sets ``TWO_NODE_FAULTY=1``, so that only a comparison across nodes finds them:
- ``<run id>-hotspot``: that node's local rank 0 gets outlier samples every 2nd step (30
  overflows) and the other node's local rank 0 every 12th (5): within either node one rank
  holds all detections, across the job only the faulty node's rank holds >= 80%;
- ``<run id>-desync``: both ranks of that node reload the scaler state of step 1 at step 24,
  so each node's ranks agree with each other and disagree with the other node's.

Run ids come from TORCHELASTIC_RUN_ID (torchrun's --rdzv-id), the exporter from AMPSCOPE_URL
and the node label from AMPSCOPE_NODE, as a real job's would.

After the last step the ranks linger, their scalers open (heartbeating, in state running),
until the file named by TWO_NODE_RELEASE exists: a closed scaler sends its final record, the
rank turns finished, and every alert on it resolves. The test releases the ranks once both
engines showed their verdicts, however long a loaded machine makes vmalert's chained rules lag.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from ampscope.demo import trainer
from ampscope.demo.scenarios import SCENARIOS, Scenario

STEPS = 60
RESTORE_STEP = 24
OUTLIER_FACTOR = 1e5
"""Large enough to overflow fp16 at any loss scale: every outlier step is one detection."""
LINGER_MAX_S = 420.0
"""Deadlock guard: most seconds to wait for the release after the last step, so that an
orphaned job still ends; longer than the test's own guard on the verdicts
(VERDICTS_WITHIN_S)."""


def _linger(release: Path) -> None:
    """Keep the open scalers (and their reporters' heartbeats) alive until released."""
    deadline = time.monotonic() + LINGER_MAX_S
    while not release.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"not released within {LINGER_MAX_S:.0f}s: {release}")
        time.sleep(0.2)


@dataclass(frozen=True, kw_only=True)
class NodeHotspot(Scenario):
    """Outliers on the faulty node's local rank 0 every 2nd step, and on the healthy node's
    local rank 0 every 12th (5 detections: enough for a per-node comparison to misfire)."""

    faulty: bool = False

    def outliers_at(self, step: int, rank: int, world_size: int) -> bool:
        if int(os.environ["LOCAL_RANK"]) != 0:
            return False
        return step % 2 == 0 if self.faulty else step % 12 == 7


def main() -> None:
    torch.set_num_threads(1)
    faulty = os.environ.get("TWO_NODE_FAULTY") == "1"
    run_id = os.environ["TORCHELASTIC_RUN_ID"]
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    hotspot = NodeHotspot(
        **{**vars(SCENARIOS["hotspot"]), "outlier_rank": None, "outlier_every": 0},
        faulty=faulty,
    )
    hotspot = replace(hotspot, outlier_factor=OUTLIER_FACTOR)
    desync = replace(SCENARIOS["desync"], stale_restore_at=None)
    plan = trainer.Plan(
        scenarios=(hotspot, desync),
        run_ids=(f"{run_id}-hotspot", f"{run_id}-desync"),
        steps=STEPS,
        exporter_url=os.environ["AMPSCOPE_URL"],
        progress_every=STEPS,
        step_delay=0.05,
    )
    runs = [
        trainer.ScenarioRun(scenario, run, plan, rank, world_size)
        for scenario, run in zip(plan.scenarios, plan.run_ids, strict=True)
    ]
    stale = None
    try:
        for step in range(1, STEPS + 1):
            for run in runs:
                run.step(step)
            desync_scaler = runs[1].scaler
            if faulty and step == 1:
                stale = desync_scaler.state_dict()
            if faulty and step == RESTORE_STEP:
                assert stale is not None
                desync_scaler.load_state_dict(stale)
            time.sleep(plan.step_delay)
        _linger(Path(os.environ["TWO_NODE_RELEASE"]))
    finally:
        for run in runs:
            run.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
