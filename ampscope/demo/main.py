"""``ampscope demo``: train a small FSDP2 job in fp16 into instability and watch ampscope.

Starts ``ampscope serve`` on loopback (or uses ``--exporter-url``), trains every scenario
side by side on ``--ranks`` CPU processes, prints progress, then the exporter's per-rank
state and health verdicts for each run. Only argparse is imported until ``run``.
"""

from __future__ import annotations

import argparse
import sys

from ampscope.demo.scenarios import SCENARIOS
from ampscope.reporter.schema import DEFAULT_PORT


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Define ``ampscope demo``'s flags."""
    parser.add_argument(
        "--scenario",
        dest="scenarios",
        action="append",
        choices=sorted(SCENARIOS),
        help="run only this scenario (repeatable; default: all of "
        + ", ".join(SCENARIOS)
        + ", side by side)",
    )
    parser.add_argument(
        "--steps", type=_positive_int, default=60, help="iterations (default 60, at least 30)"
    )
    parser.add_argument(
        "--ranks", type=_positive_int, default=2, help="CPU ranks to spawn (default 2)"
    )
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"port of the exporter the demo starts on 127.0.0.1 (default {DEFAULT_PORT})",
    )
    parser.add_argument(
        "--exporter-url",
        help="report to this running exporter instead of starting one (e.g. the "
        "docker-compose exporter, http://127.0.0.1:9478)",
    )
    parser.add_argument(
        "--stale-after",
        type=_non_negative_float,
        default=None,
        help="seconds without a report before the started exporter marks a rank stale "
        "(default: the exporter's, 60)",
    )
    parser.add_argument(
        "--keep-serving",
        action="store_true",
        help="leave the started exporter running after the demo, until Ctrl-C",
    )
    parser.add_argument(
        "--step-delay",
        type=_non_negative_float,
        default=0.0,
        help="seconds to pause after each iteration, to watch a dashboard (default 0)",
    )
    parser.add_argument(
        "--progress-every",
        type=_positive_int,
        default=10,
        help="print progress every N iterations (default 10)",
    )
    parser.add_argument(
        "--run-prefix",
        default=None,
        help="run ids are PREFIX-SCENARIO (default demo-HHMMSS)",
    )


def _options_given(args: argparse.Namespace) -> list[str]:
    """The options that differ from their defaults, as a command line repeats them (run ids
    get a new prefix: a second run is a new run)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    given: list[str] = []
    for scenario in args.scenarios or ():
        given += ["--scenario", scenario]
    for name in ("steps", "ranks", "port", "stale_after", "step_delay", "progress_every"):
        value = getattr(args, name)
        if value != parser.get_default(name):
            text = f"{value:g}" if isinstance(value, float) else str(value)
            given += [f"--{name.replace('_', '-')}", text]
    return given


def run(args: argparse.Namespace) -> int:
    """Run the demo. Returns 0 when every scenario drew the verdicts it expects, 1 when
    one did not, 2 when the demo could not run (exporter or ranks failed), and 128 + the
    signal's number when SIGINT (Ctrl-C: 130), SIGTERM (143) or SIGHUP (129) stopped it
    before its verdict; with ``--keep-serving`` a signal after the verdict ends the serving
    and the status is the verdict's. Every process the demo started has exited by then."""
    from ampscope.demo.exporter import DemoError
    from ampscope.demo.session import DemoOptions, run_demo
    from ampscope.demo.signals import exit_status, stop_signals_interrupt

    try:
        options = DemoOptions(
            scenarios=tuple(args.scenarios or SCENARIOS),
            steps=args.steps,
            ranks=args.ranks,
            port=args.port,
            exporter_url=args.exporter_url,
            stale_after=args.stale_after,
            keep_serving=args.keep_serving,
            step_delay=args.step_delay,
            progress_every=args.progress_every,
            run_prefix=args.run_prefix,
            argv=tuple(_options_given(args)),
        )
        with stop_signals_interrupt():
            return run_demo(options)
    except (DemoError, ValueError) as exc:
        print(f"ampscope demo: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:
        print(f"ampscope demo: interrupted ({interrupt})", file=sys.stderr)
        return exit_status(interrupt)
