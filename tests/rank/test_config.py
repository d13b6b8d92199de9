"""TelemetryConfig validation, and the front-ends' keyword-only telemetry options."""

from __future__ import annotations

from dataclasses import fields

import pytest

import ampscope
from ampscope.rank.config import SCALE_CLAMPS, ScalerOptions, TelemetryConfig, WatchOptions
from ampscope.reporter.sinks import CallbackSink


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
        ({"replica_check_every": -1}, "replica_check_every"),
        ({"replica_check_every": 2.5}, "replica_check_every"),
        ({"replica_check_every": True}, "replica_check_every"),
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
    with pytest.raises(TypeError, match="sigterm_handler"):
        TelemetryConfig(sigterm_handler="off")  # type: ignore[arg-type]
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


def test_the_front_ends_keywords_are_the_configs_fields() -> None:
    # One list: the typed keyword arguments are TelemetryConfig's fields (a watch: but the
    # scale clamps), so a field added to the config is a keyword of every front-end.
    names = {f.name for f in fields(TelemetryConfig)}
    assert set(ScalerOptions.__annotations__) | set(WatchOptions.__annotations__) == names
    assert set(ScalerOptions.__optional_keys__) == names
    assert set(WatchOptions.__optional_keys__) == names - set(SCALE_CLAMPS)


def test_each_front_end_takes_its_options_and_refuses_others() -> None:
    sink = CallbackSink(lambda record: None)
    watch = ampscope.GradWatch(reporter=None, sinks=[sink], top_k=3, stats=False)
    assert (watch._ampscope_config.sinks, watch._ampscope_config.top_k) == ((sink,), 3)
    assert watch._ampscope_stats is None
    scaler = ampscope.ShardedGradScaler("cpu", reporter=None, min_scale=2.0, history=5)
    assert (scaler._ampscope_config.min_scale, scaler._ampscope_config.history) == (2.0, 5)
    # As Python words an unexpected keyword: a watch has no scale to clamp.
    with pytest.raises(
        TypeError, match=r"^GradWatch.__init__\(\) got an unexpected keyword argument 'min_scale'$"
    ):
        ampscope.GradWatch(reporter=None, min_scale=1.0)  # type: ignore[call-arg]
    with pytest.raises(
        TypeError, match=r"^GradScaler.__init__\(\) got an unexpected keyword argument 'init'$"
    ):
        ampscope.GradScaler("cpu", reporter=None, init=1.0)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="takes from"):
        ampscope.GradScaler("cpu", 2.0, 2.0, 0.5, 10, True, None)  # type: ignore[call-arg, misc]
    watch.close()
    scaler.close()


def test_replica_check_every_is_validated_by_attach_too() -> None:
    from torch import nn

    watch = ampscope.GradWatch(reporter=None, replica_check_every=0)  # 0: never
    with pytest.raises(ValueError, match="replica_check_every"):
        watch.attach(nn.Linear(2, 2), replica_check_every=-3)
    watch.close()
