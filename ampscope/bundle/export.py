"""``ampscope export DIR``: write the shipped dashboards, Prometheus files and manifests.

For people who installed a wheel and have no checkout: the files land under ``DIR`` in the
checkout's layout (``dashboards/``, ``prometheus/``, ``kubernetes/``), so ``prometheus.yml``
finds its ``rules/`` and promtool's unit tests find the rules they test. Imports no torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ampscope.bundle import asset_files


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", type=Path, metavar="DIR", help="where to write the files")
    parser.add_argument(
        "--quiet", action="store_true", help="do not list the files written (errors still print)"
    )


def export(directory: Path) -> list[Path]:
    """Write every shipped file under ``directory``, replacing files of the same name.

    Returns:
        The paths written, in the order of :func:`ampscope.bundle.asset_files`.

    Raises:
        FileNotFoundError: the installation carries no deployment files (a broken build).
        OSError: a file could not be written.
    """
    written = []
    for relative, source in asset_files():
        target = directory.joinpath(*relative.split("/"))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(source.read_bytes())
        written.append(target)
    if not written:
        raise FileNotFoundError("this installation of ampscope carries no deployment files")
    return written


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 when every file was written, 1 when one could not be."""
    try:
        written = export(args.directory)
    except OSError as error:
        print(f"ampscope export: {error}", file=sys.stderr)
        return 1
    if not args.quiet:
        for path in written:
            print(path)
    return 0
