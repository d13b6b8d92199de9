"""A process that its launcher stops: ``python stopped_rank.py URL MODE``.

Sends records of steps 1 to 3 to the exporter at ``URL`` through ``HttpReporter``s, prints
``ready``, then takes a "step" every 10 ms (``time.sleep``, as a training loop returns to
the interpreter) until a signal ends it. By ``MODE``, before the reporters start:

* ``default``: nothing: SIGTERM's disposition is Python's default;
* ``chained``: a Python SIGTERM handler that prints ``previous handler ran after N final``
  (N: the final heartbeats the reporters had sent when it ran) and exits with status 3;
* ``ignored``: SIGTERM is ignored (``SIG_IGN``);
* ``off``: no change here; the test sets ``AMPSCOPE_SIGTERM_HANDLER=off``;
* ``two``: nothing, but two reporters (ranks 0 and 1 of the run: two scalers of one
  process, as a test harness may hold) share the one handler;
* ``closed``: the reporter is closed before ``ready`` (the rank finished), then waits;
* ``thread``: the reporter is built on another thread, which cannot install a handler;
* ``library_after``: after the first reporter, a library installs its own SIGTERM handler,
  which prints ``library handler ran``, calls the one it replaced and lets the loop end on
  its own should that return (exit status 4); then a second reporter (rank 1) starts.
* ``framework_after``: the same, the framework having said it ends the process itself
  (``leave_end_to_wrapper``, as Lightning's integration does).

Prints ``handler ours`` or ``handler <name>`` (the SIGTERM disposition once the reporters
started) before ``ready``.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

from failing_rank import record

from ampscope.reporter.http import HttpReporter
from ampscope.reporter.schema import StepRecord
from ampscope.reporter.stop_signal import installed, leave_end_to_wrapper

REPORTERS: list[HttpReporter] = []
"""Held to the end, as a scaler holds its reporter."""


def _record(step: int, rank: int) -> StepRecord:
    base = record(step)
    who = base.identity.model_copy(update={"rank": rank, "local_rank": rank, "world_size": 2})
    return base.model_copy(update={"identity": who})


def _finals() -> int:
    return sum(reporter._pipeline.finished_sent for reporter in REPORTERS)


def _previous(signum: int, frame: FrameType | None) -> None:
    print(f"previous handler ran after {_finals()} final", flush=True)
    sys.exit(3)


SIGTERM_SEEN = threading.Event()
"""Set by the library's handler: the loop ends gracefully at its next turn (Lightning's
``received_sigterm``, then its ``SIGTERMException`` at the batch's end)."""


def _library_handler(previous: object) -> Callable[[int, FrameType | None], None]:
    def handle(signum: int, frame: FrameType | None) -> None:
        print("library handler ran", flush=True)
        if callable(previous):
            previous(signum, frame)
        SIGTERM_SEEN.set()

    return handle


def _start(rank: int, url: str) -> None:
    reporter = HttpReporter(url, flush_interval=0.05, exit_timeout=10.0)
    REPORTERS.append(reporter)
    for step in (1, 2, 3):
        reporter.emit(_record(step, rank))
    assert reporter.flush(timeout=30.0)


def main(url: str, mode: str) -> None:
    if mode == "chained":
        signal.signal(signal.SIGTERM, _previous)
    elif mode == "ignored":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "thread":
        starter = threading.Thread(target=_start, args=(0, url))
        starter.start()
        starter.join()
    elif mode in ("library_after", "framework_after"):
        if mode == "framework_after":
            leave_end_to_wrapper()
        _start(0, url)
        signal.signal(signal.SIGTERM, _library_handler(signal.getsignal(signal.SIGTERM)))
        _start(1, url)
    else:
        for rank in (0, 1) if mode == "two" else (0,):
            _start(rank, url)
    if mode == "closed":
        REPORTERS[0].close(timeout=10.0)
    disposition = signal.getsignal(signal.SIGTERM)
    name = "ours" if installed() else getattr(disposition, "name", "a Python function")
    print(f"handler {name}", flush=True)
    print("ready", flush=True)
    while not SIGTERM_SEEN.is_set():
        time.sleep(0.01)
    # Only a library's handler that did not end the process gets here.
    print(f"graceful end after {_finals()} final", flush=True)
    sys.exit(4)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
