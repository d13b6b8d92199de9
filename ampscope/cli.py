"""`ampscope` command line: each subcommand lives in its own module, imported on use."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, one-line help). A module provides add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("ampscope.exporter.main", "run the per-node exporter (/metrics and a JSON API)"),
    "status": ("ampscope.status.main", "show the node's runs and their health (exit 0/1/2/3)"),
    "devices": (
        "ampscope.devices.main",
        "rank devices by the runs in which they offended, from Prometheus (exit 0/1/3)",
    ),
    "demo": ("ampscope.demo.main", "train a small FSDP2 model into instability and watch ampscope"),
    "export": ("ampscope.bundle.export", "write the dashboards, Prometheus rules and manifests"),
}


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """The parser, with the arguments of only the subcommand named in ``argv``.

    Importing just that module keeps ``ampscope serve`` independent of the demo (and of
    torch), and an import problem in one subcommand from breaking the others.
    """
    from ampscope import __version__

    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    parser = argparse.ArgumentParser(
        prog="ampscope", description="Make mixed-precision loss scaling visible."
    )
    parser.add_argument("--version", action="version", version=f"ampscope {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_) in SUBCOMMANDS.items():
        cmd = sub.add_parser(name, help=help_, description=help_)
        cmd.set_defaults(_module=module)
        if name == chosen:
            # Argument definitions are cheap to import; the heavy imports happen in run().
            importlib.import_module(module).add_arguments(cmd)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    result: int = importlib.import_module(args._module).run(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
