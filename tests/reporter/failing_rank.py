"""A process whose HttpReporter tells how it ended: ``python failing_rank.py URL MODE``.

Sends records of steps 1 to 3 to the loopback exporter at ``URL``, then, by ``MODE``:

* ``normal``: returns (interpreter exit closes the reporter: finished);
* ``exit``: ``sys.exit(0)`` (finished);
* ``uncaught``: raises ``RuntimeError`` in the main thread;
* ``finally``: ``try: raise ... finally: reporter.close()``: the close says finished first,
  then the uncaught exception corrects it;
* ``hook_replaced``: a library replaces ``sys.excepthook`` without calling ours, then raises;
* ``chained``: a hook installed before the reporter prints ``previous hook ran``;
* ``thread_closes``: a thread closes the reporter, then dies on an exception (failed);
* ``thread_other``: the main thread closes the reporter, then another thread dies on an
  exception, and the process ends normally (finished);
* ``thread_then_steps``: a thread dies on an exception, then the main thread reports a
  newer step and ends normally (finished: training went on).

Prints ``sent`` once its records are delivered.
"""

from __future__ import annotations

import sys
import threading
import time

from ampscope.reporter.http import HttpReporter
from ampscope.reporter.schema import Identity, RankTotals, StepRecord


def record(step: int) -> StepRecord:
    return StepRecord(
        identity=Identity(run="run-a", node="node-0", rank=0, local_rank=0, world_size=1),
        step=step,
        time=time.time(),
        found_inf_local={},
        found_inf_origin={},
        found_inf_global=False,
        skipped=False,
        scale_before=1.0,
        scale_after=1.0,
        growth_tracker=0,
        event="none",
        optimizers=[],
        nonfinite_params=[],
        totals=RankTotals(
            steps=step,
            skipped_steps=0,
            backoffs=0,
            growths=0,
            found_inf_local={},
            found_inf_origin={},
            nonfinite_params=[],
            min_scale=1.0,
            max_scale=1.0,
            aligned_scale=None,
        ),
    )


def _previous_hook(*args: object) -> None:
    print("previous hook ran", flush=True)
    sys.__excepthook__(*args)  # type: ignore[arg-type]


REPORTERS: list[HttpReporter] = []
"""Held to the end, as a scaler holds its reporter: interpreter exit closes it."""


def main(url: str, mode: str) -> None:
    if mode == "chained":
        sys.excepthook = _previous_hook
    reporter = HttpReporter(url, flush_interval=0.05, exit_timeout=10.0)
    REPORTERS.append(reporter)
    for step in (1, 2, 3):
        reporter.emit(record(step))
    assert reporter.flush(timeout=30.0)
    print("sent", flush=True)
    if mode == "normal":
        return
    if mode == "exit":
        sys.exit(0)
    if mode in ("uncaught", "chained"):
        raise RuntimeError("boom after step 3")
    if mode == "finally":
        try:
            raise RuntimeError("boom after step 3")
        finally:
            reporter.close()
    if mode == "hook_replaced":
        sys.excepthook = lambda *args: print("a hook that calls no other", flush=True)
        raise KeyError("lost key")
    if mode == "thread_closes":

        def train() -> None:
            try:
                raise ValueError("bad batch")
            finally:
                reporter.close()

        worker = threading.Thread(target=train)
        worker.start()
        worker.join()
        return
    if mode == "thread_other":
        reporter.close()
        worker = threading.Thread(target=lambda: 1 / 0)
        worker.start()
        worker.join()
        return
    if mode == "thread_then_steps":
        worker = threading.Thread(target=lambda: 1 / 0)
        worker.start()
        worker.join()
        time.sleep(0.01)  # the next step comes later, on any clock resolution
        reporter.emit(record(4))
        assert reporter.flush(timeout=30.0)
        return
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
