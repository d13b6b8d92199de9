"""Fixtures of the service tests: an exporter app behind TestClient with a fake clock."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ampscope.exporter.app import create_app
from ampscope.exporter.settings import Settings
from exporter.factory import FakeClock

MakeClient = Callable[..., tuple[TestClient, FakeClock]]


@pytest.fixture
def make_client() -> Iterator[MakeClient]:
    """``make_client(**settings)`` -> (client with the lifespan running, its fake clock)."""
    with ExitStack() as stack:

        def make(**settings: Any) -> tuple[TestClient, FakeClock]:
            clock = FakeClock()
            app = create_app(Settings(**settings), clock=clock)
            return stack.enter_context(TestClient(app)), clock

        yield make


@pytest.fixture
def client(make_client: MakeClient) -> TestClient:
    return make_client()[0]
