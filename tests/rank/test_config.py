"""TelemetryConfig validation (the scalers' keyword-only options)."""

from __future__ import annotations

import pytest

import ampscope
from ampscope.rank.config import TelemetryConfig


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"top_k": 0}, "top_k"),
        ({"top_k": 65}, "top_k"),
        ({"history": 0}, "history"),
        ({"min_scale": -1.0}, "min_scale"),
        ({"max_scale": float("inf")}, "max_scale"),
        ({"min_scale": 8.0, "max_scale": 4.0}, "exceeds"),
        ({"run_id": "has space"}, "run_id"),
        ({"run_id": "x" * 129}, "run_id"),
    ],
)
def test_invalid_values(kwargs: dict[str, object], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        TelemetryConfig(**kwargs)  # type: ignore[arg-type]


def test_invalid_types_and_keyword_only() -> None:
    with pytest.raises(TypeError, match="reporter"):
        TelemetryConfig(reporter="http://x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="emit"):
        TelemetryConfig(sinks=[object()])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        TelemetryConfig(None)  # type: ignore[misc]
    with pytest.raises(ValueError, match="top_k"):
        ampscope.GradScaler("cpu", reporter=None, top_k=100)


def test_defaults() -> None:
    config = TelemetryConfig()
    assert (config.reporter, config.sinks, config.attribution, config.top_k) == (
        "auto",
        (),
        True,
        8,
    )
    assert (config.history, config.min_scale, config.max_scale) == (1024, None, None)
