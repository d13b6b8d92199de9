"""``ampscope status --targets FILE``: the exporters of a job from a Prometheus file_sd file.

The format is Prometheus' ``file_sd_configs`` file: a list of groups, each with
``targets`` (``host:port`` strings) and optional ``labels`` (ignored here), as JSON or YAML.
YAML is read with PyYAML when it is installed (it comes with the server extras); without
it, the subset the Slurm recipe in docs/deployment.md writes is read by hand: one
``- targets: ["a:9478", "b:9478"]`` line per group, or the block form
(``- targets:`` followed by ``  - a:9478`` lines). Costs O(file size).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class TargetsError(ValueError):
    """The file cannot be read, or is not a file_sd list of groups with targets."""


def _strip_quotes(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


def _parse_simple_yaml(text: str) -> list[dict[str, Any]]:
    """The file_sd YAML that launchers write, without PyYAML: flow or block target lists."""
    groups: list[dict[str, Any]] = []
    in_targets = False
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        stripped = line.strip()
        if stripped.startswith("- targets:") or stripped.startswith("targets:"):
            if stripped.startswith("- "):
                groups.append({"targets": []})
            elif not groups:
                raise TargetsError(f"line {number}: targets outside a group")
            value = stripped.split(":", 1)[1].strip()
            in_targets = not value
            if value:
                if not (value.startswith("[") and value.endswith("]")):
                    raise TargetsError(f"line {number}: expected a [list] of targets")
                inner = value[1:-1].strip()
                groups[-1]["targets"] = (
                    [_strip_quotes(item) for item in inner.split(",")] if inner else []
                )
        elif in_targets and stripped.startswith("- "):
            groups[-1]["targets"].append(_strip_quotes(stripped[2:]))
        elif stripped.startswith("labels:") or (not in_targets and line.startswith(" ")):
            in_targets = False  # labels and their entries: not needed to find exporters
        else:
            raise TargetsError(f"line {number}: not understood without PyYAML: {stripped!r}")
    return groups


def parse_targets(text: str) -> list[str]:
    """Every target (``host:port``) of a file_sd document, in order, without duplicates.

    Raises:
        TargetsError: the document is neither JSON nor YAML of that shape.
    """
    document: Any
    try:
        document = json.loads(text)
    except ValueError:
        try:
            import yaml
        except ImportError:
            document = _parse_simple_yaml(text)
        else:
            try:
                document = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise TargetsError(f"neither JSON nor YAML: {exc}") from None
    if not isinstance(document, list):
        raise TargetsError("expected a list of groups, each with a 'targets' list")
    found: list[str] = []
    for index, group in enumerate(document):
        targets = group.get("targets") if isinstance(group, dict) else None
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise TargetsError(f"group {index} has no 'targets' list of host:port strings")
        for target in targets:
            if target.strip() and target.strip() not in found:
                found.append(target.strip())
    return found


def read_targets(path: str, scheme: str) -> list[str]:
    """The exporters' base URLs (``scheme://host:port``) listed in the file at ``path``.

    Raises:
        TargetsError: the file is unreadable, malformed or lists no target.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise TargetsError(f"cannot read --targets {path}: {exc.strerror}") from None
    try:
        targets = parse_targets(text)
    except TargetsError as exc:
        raise TargetsError(f"--targets {path}: {exc}") from None
    if not targets:
        raise TargetsError(f"--targets {path} lists no target")
    return [t if "://" in t else f"{scheme}://{t}" for t in targets]
