"""Where a scaler's records go: the reporter (``reporter="auto"`` builds one) and sinks."""

from __future__ import annotations

import logging

from ampscope.rank.config import TelemetryConfig
from ampscope.reporter.sinks import Sink

logger = logging.getLogger("ampscope")


def auto_reporter(*, sigterm_handler: bool = True) -> Sink | None:
    """An ``HttpReporter`` to ``AMPSCOPE_URL`` (default: the local exporter), or ``None``
    when ``AMPSCOPE_URL`` says ``off`` or the reporter cannot be built (logged: a setting
    that is wrong, such as a URL without a scheme, in one line; training goes on).
    ``sigterm_handler=False`` installs no SIGTERM handler; ``True`` leaves it to
    ``AMPSCOPE_SIGTERM_HANDLER`` (unset: installed)."""
    from ampscope.reporter.transport import URL_ENV, url_from_env

    url = url_from_env()
    if url is None:
        return None
    try:
        from ampscope.reporter.http import HttpReporter

        return HttpReporter(url, sigterm_handler=None if sigterm_handler else False)
    except ValueError as exc:
        # A setting the user can fix (URL, token file, TLS files): the reason, no traceback.
        logger.warning("ampscope: not reporting (%s=%s): %s", URL_ENV, url, exc)
        return None
    except Exception:
        logger.warning("ampscope: could not start the HTTP reporter to %s", url, exc_info=True)
        return None


def build_sinks(config: TelemetryConfig) -> list[Sink]:
    """The reporter (if any) followed by ``config.sinks``, in that order."""
    if config.reporter == "auto":
        reporter = auto_reporter(sigterm_handler=config.sigterm_handler)
    else:
        reporter = config.reporter
    sinks: list[Sink] = [] if reporter is None else [reporter]
    sinks.extend(config.sinks)
    return sinks
