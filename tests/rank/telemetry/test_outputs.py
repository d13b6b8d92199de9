"""Where records go: the ``auto`` reporter and whether it installs the SIGTERM handler."""

from __future__ import annotations

import pytest
from support import free_port

from ampscope.rank.config import TelemetryConfig
from ampscope.rank.telemetry.outputs import build_sinks
from ampscope.reporter.http import HttpReporter


def _auto_reporter(config: TelemetryConfig) -> HttpReporter:
    (reporter,) = build_sinks(config)
    assert isinstance(reporter, HttpReporter)
    reporter.close(timeout=0.0)  # nothing listens there: never sends
    return reporter


@pytest.mark.parametrize(
    ("option", "env", "installs"),
    [
        (True, None, True),
        (True, "off", False),
        (True, "on", True),
        (False, None, False),
        (False, "on", False),  # the code's False wins: the variable only turns it off
    ],
)
def test_the_auto_reporter_asks_for_the_handler_as_the_option_and_variable_say(
    monkeypatch: pytest.MonkeyPatch, option: bool, env: str | None, installs: bool
) -> None:
    monkeypatch.setenv("AMPSCOPE_URL", f"http://127.0.0.1:{free_port()}")
    if env is None:
        monkeypatch.delenv("AMPSCOPE_SIGTERM_HANDLER", raising=False)
    else:
        monkeypatch.setenv("AMPSCOPE_SIGTERM_HANDLER", env)
    reporter = _auto_reporter(TelemetryConfig(sigterm_handler=option))
    assert reporter.config.sigterm_handler is installs
