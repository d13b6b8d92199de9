import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ampscope.reporter import failure

# tests/support.py is imported as `support` by the test modules.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _no_failure_left_noted() -> Iterator[None]:
    """A GradWatch that raised in one test notes its error for the process (the rank ends
    failed): forget it around every test, so that no other test's reporter says so."""
    failure.forget()
    yield
    failure.forget()
