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

Two waits, each on a file the test creates, keep the verdicts independent of how fast the
machine trains compared with how fast the engines see the data:
- at step ``GATE_STEP``, the first aligned step, until TWO_NODE_GATE exists. The test
  creates it once every engine holds every rank's series that the hotspot and desync alerts
  read. VictoriaMetrics makes a new series searchable seconds after it arrives, and a rule
  that reads a partial set of ranks errs. The healthy node's rank 0 looks like the hotspot
  once its 5 detections (step 55) meet the rule's minimum while the faulty rank's series is
  missing. Aligned-scale series that first show at different evaluations compare two
  aligned steps, which looks like a desync. Before the gate neither can happen: that rank
  has 1 detection, and there is one aligned step. The gate covers series appearing. A rule
  that mixed two evaluations of series that already exist was not seen; in production the
  alerts' ``for:`` clauses would outlast one, and this test, which counts pending alerts,
  would fail on it;
- after the last step, their scalers open (heartbeating, in state running), until
  TWO_NODE_RELEASE exists: a closed scaler sends its final record, the rank turns finished,
  and every alert on it resolves. The test releases the ranks once both engines showed their
  verdicts, however long a loaded machine makes vmalert's chained rules lag.
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
from ampscope.reporter.schema import SCALE_ALIGN_STEPS

STEPS = 60
GATE_STEP = SCALE_ALIGN_STEPS
"""Every rank's aligned-scale series exist from here: the desync rule reads them."""
RESTORE_STEP = 24
OUTLIER_FACTOR = 1e5
"""Large enough to overflow fp16 at any loss scale: every outlier step is one detection."""
WAIT_MAX_S = 420.0
"""Deadlock guard: most seconds to wait for the gate or the release, so that an orphaned job
still ends; longer than the test's own guards (GATE_WITHIN_S, VERDICTS_WITHIN_S)."""


def _wait_for(path: Path) -> None:
    """Keep the open scalers (and their reporters' heartbeats) alive until ``path`` exists."""
    deadline = time.monotonic() + WAIT_MAX_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"not let go within {WAIT_MAX_S:.0f}s: {path}")
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
            if step == GATE_STEP:
                _wait_for(Path(os.environ["TWO_NODE_GATE"]))
            time.sleep(plan.step_delay)
        _wait_for(Path(os.environ["TWO_NODE_RELEASE"]))
    finally:
        for run in runs:
            run.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
