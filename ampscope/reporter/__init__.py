"""Rank-side transport: the record schema and the sinks records go to.

``HttpReporter`` (batched POSTs to the exporter), ``CallbackSink`` and ``JsonlSink`` are
imported on first use, so ``import ampscope.reporter`` costs only the schema.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["CallbackSink", "HttpReporter", "HttpReporterConfig", "JsonlSink", "Sink"]

if TYPE_CHECKING:
    from ampscope.reporter.http import HttpReporter, HttpReporterConfig
    from ampscope.reporter.sinks import CallbackSink, JsonlSink, Sink

_HOMES = {
    "HttpReporter": "ampscope.reporter.http",
    "HttpReporterConfig": "ampscope.reporter.http",
    "CallbackSink": "ampscope.reporter.sinks",
    "JsonlSink": "ampscope.reporter.sinks",
    "Sink": "ampscope.reporter.sinks",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'ampscope.reporter' has no attribute {name!r}")
