"""Fixtures of the end-to-end tests: a real ``ampscope serve`` per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support import free_port

from ampscope.demo.exporter import ExporterProcess


@pytest.fixture(scope="module")
def exporter() -> Iterator[str]:
    """The URL of an exporter on a free port, with its default thresholds, for the module's
    tests; stopped after them."""
    process = ExporterProcess(free_port())
    process.start()
    try:
        yield process.url
    finally:
        process.stop()
