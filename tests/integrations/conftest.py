"""One live exporter shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support import free_port

from ampscope.demo.exporter import ExporterProcess


@pytest.fixture(scope="session")
def exporter() -> Iterator[ExporterProcess]:
    process = ExporterProcess(free_port())
    process.start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def report_to(exporter: ExporterProcess, monkeypatch: pytest.MonkeyPatch) -> str:
    """Ranks in this process (and spawned ones, which inherit it) report to the exporter."""
    monkeypatch.setenv("AMPSCOPE_URL", exporter.url)
    return exporter.url


@pytest.fixture
def fresh_accelerate() -> Iterator[None]:
    """Accelerate's process-wide state reset before and after: a test may pick any
    precision, and leaves none behind for the next test's ``Accelerator``."""
    from watch_workers import reset_accelerate

    reset_accelerate()
    yield
    reset_accelerate()
