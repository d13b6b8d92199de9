import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ampscope.reporter import failure, pause

# tests/support.py is imported as `support` by the test modules.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _no_failure_left_noted() -> Iterator[None]:
    """A GradWatch that raised in one test notes its error for the process (the rank ends
    failed): forget it around every test, so that no other test's reporter says so."""
    failure.forget()
    yield
    failure.forget()


@pytest.fixture(autouse=True)
def _no_pause_left_open() -> Iterator[None]:
    """The open pauses are the process's: one a test leaves open would make every later
    test's reporter say "paused". Start each test with none; fail the test that leaks one
    (and clear it, so that only that test fails)."""
    _clear_pauses()
    yield
    leaked = _clear_pauses()
    assert not leaked, f"the test left pauses open: {leaked}"


def _clear_pauses() -> list[str]:
    """End every open pause (``ampscope.reporter.pause``); return their reasons."""
    with pause._lock:
        reasons = [reason for reason, _ in pause._open.values()]
        pause._open.clear()
    return reasons
