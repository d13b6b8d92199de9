"""The run ids this process's open front-ends report under: two at once never share one.

A rank's records are one series per identity (run, node, rank). Two front-ends open at
once in one process (a GAN's scaler for D and one for G, an actor's and a critic's, two
DeepSpeed engines) would both report as the same rank of the same run: the exporter would
read one's step 1 after the other's step 40 as a restart, compare one's scale with the
other ranks' copy of the other and page ``scale_desync``, and /metrics would swap between
the two from scrape to scrape. So the first front-end to resolve a run id holds it while it
is open; one that resolves the same id while it is held reports under ``<run>.2`` (``.3``
for a third, the lowest number free), and a warning says so once.

Why this rule:
- *Deterministic on every rank without a collective.* A front-end claims its id at its
  first record (its first ``update()``), after the id itself is resolved. In SPMD code every
  rank creates its front-ends and makes their first ``update()`` calls in the same program
  order, so every rank derives the same id for the same front-end. No broadcast is added:
  a front-end given ``run_id=`` (or ``AMPSCOPE_RUN_ID``) still makes no collective.
- *At the first record, not at construction.* A front-end that never records (an
  evaluation process's scaler, an integration's twin that never steps, ``enabled=False``)
  claims nothing, so the one that trains keeps the run id.
- *Held while open.* ``close()`` frees the id at once, so a retry's front-end (a new
  ``fit``, built after the first one closed) keeps the run id: a retry is the same run, whose
  rank the exporter reads as restarted. A front-end dropped without ``close()`` (a notebook
  cell run again) frees it once collected: on a clash the claim runs the garbage collector
  first, so an unreachable front-end never counts, whatever the collector's timing on each
  rank. One still referenced and open does count: close a front-end before building its
  replacement.
- *An explicit ``run_id=`` gets the same treatment*: two open front-ends given the same id
  would be mixed just the same. Give each its own ``run_id=`` to name them yourself.
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from typing import Protocol

from ampscope.reporter.schema import MAX_LABEL_LENGTH

logger = logging.getLogger("ampscope")


class FrontEnd(Protocol):
    """What the registry reads of a front-end: whether it was closed."""

    @property
    def closed_already(self) -> bool: ...


_lock = threading.Lock()
_held: dict[str, weakref.ReferenceType[FrontEnd]] = {}
"""Run id → the front-end that reports under it (while alive and open)."""
_warned: set[tuple[str, str]] = set()


def derived_run_id(run: str, number: int) -> str:
    """``<run>.<number>``, ``run`` cut so that the whole fits the label length. A valid run id
    stays valid (``.`` and digits are run id characters; the first character is kept)."""
    suffix = f".{number}"
    return run[: MAX_LABEL_LENGTH - len(suffix)] + suffix


def _holds(ref: weakref.ReferenceType[FrontEnd]) -> bool:
    front_end = ref()
    return front_end is not None and not front_end.closed_already


def _drop_freed() -> None:
    """Forget the ids of front-ends closed or collected (under ``_lock``)."""
    for held in [r for r, ref in _held.items() if not _holds(ref)]:
        del _held[held]


def claim(front_end: FrontEnd, run: str) -> str:
    """The run id ``front_end`` reports under: ``run``, unless another open front-end of this
    process holds it; then the lowest free ``<run>.N`` (N from 2). Held until ``front_end``
    closes or is collected. Call once per front-end, at its first record (every rank in
    the same order). Cost: a dict scan under a lock, once per front-end; no collective. When
    the id is held, one ``gc.collect()`` first (see the module docstring)."""
    with _lock:
        _drop_freed()
        taken = run in _held
    if taken:
        # A front-end dropped without close() but not yet collected (a reference cycle, a
        # notebook cell run again) must not count: collected now, whatever the collector's
        # timing, so that every rank decides alike. Once per front-end, on a clash only.
        gc.collect()
    with _lock:
        _drop_freed()
        chosen, number = run, 1
        while chosen in _held:
            number += 1
            chosen = derived_run_id(run, number)
        _held[chosen] = weakref.ref(front_end)
        first_warning = chosen != run and (run, chosen) not in _warned
        if first_warning:
            _warned.add((run, chosen))
    if first_warning:
        logger.warning(
            "ampscope: another front-end of this process (a second GradScaler, GradWatch or "
            "DeepSpeed monitor open at once) already reports as run %r; this one reports as "
            "run %r so that the exporter never mixes their records. To choose the ids, pass "
            "run_id= to each; or use one scaler for all optimizers (torch's recipe: "
            "scaler.step(opt) for each, then one scaler.update())",
            run,
            chosen,
        )
    return chosen
