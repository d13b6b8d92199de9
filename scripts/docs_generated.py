"""The docs site's generated parts, rendered when the site is built so they cannot drift.

A Python-Markdown extension, listed under ``markdown_extensions`` in ``mkdocs.yml``: a
line ``<!-- generated: NAME -->`` in a page is replaced by the Markdown that ``NAME``
produces from the code (the metric catalogue, the exporter's OpenAPI document, the
published benchmark summary). Zensical runs Markdown extensions but not MkDocs hooks, and
MkDocs runs both, so this is the one mechanism that works under either engine.
``scripts/docs.sh`` puts this folder on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import markdown
from markdown.preprocessors import Preprocessor

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$")
# A few docstrings cross-reference in Sphinx's syntax (:class:`~a.b.C`), which mkdocstrings
# shows as it stands; the API reference shows the name as code instead.
SPHINX_ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj):`(~?)([^`]+)`")


def metric_table() -> str:
    """The metric reference: one row per family of ``ampscope/exporter/metrics/catalogue.py``."""
    from ampscope.exporter.metrics.catalogue import CATALOGUE, RANK_LABELS

    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for spec in CATALOGUE:
        labels = ["rank labels"] if set(RANK_LABELS).issubset(spec.labels) else []
        labels += [f"`{label}`" for label in spec.labels if label not in RANK_LABELS]
        help_ = spec.help.replace("|", "\\|")
        rows.append(f"| `{spec.name}` | {spec.type} | {', '.join(labels) or '—'} | {help_} |")
    return "\n".join(rows)


def _openapi() -> dict:
    from ampscope.exporter.app import create_app
    from ampscope.exporter.settings import Settings

    # Defaults, not this machine's AMPSCOPE_* environment: the schema does not depend on them.
    return create_app(Settings.model_construct()).openapi()


def openapi_endpoints() -> str:
    """A table of every path and method the exporter's OpenAPI document declares."""
    rows = ["| method | path | summary |", "|---|---|---|"]
    for path, operations in _openapi()["paths"].items():
        for method, operation in operations.items():
            summary = operation.get("summary", "").replace("|", "\\|")
            rows.append(f"| `{method.upper()}` | `{path}` | {summary} |")
    return "\n".join(rows)


def openapi_schema() -> str:
    """The exporter's whole OpenAPI document, as the app factory generates it."""
    return "```json\n" + json.dumps(_openapi(), indent=2, sort_keys=False) + "\n```"


def bench_results() -> str:
    """``bench/results/full.md`` with its headings moved one level down, under the page's."""
    text = (ROOT / "bench" / "results" / "full.md").read_text()
    lines = text.splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    return "\n".join("#" + line if line.startswith("#") else line for line in lines)


_TEMPLATE = re.compile(r"\{\{\s*(.*?)\s*\}\}")


def _template_as_words(match: re.Match[str]) -> str:
    """``{{ $labels.rank }}`` -> *rank*, ``{{ $value | humanizePercentage }}`` -> *value*."""
    expression = match.group(1).split("|")[0].strip()
    return "*" + expression.removeprefix("$labels.").removeprefix("$") + "*"


def alert_actions() -> str:
    """What to do when each shipped alert fires: its severity and its own description, read
    from ``deploy/prometheus/rules/`` so the page says what the pager says."""
    import yaml

    rows = ["| alert | severity | what it says, and what to do |", "|---|---|---|"]
    for path in sorted((ROOT / "deploy" / "prometheus" / "rules").glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if "alert" not in rule:
                    continue
                text = _TEMPLATE.sub(_template_as_words, rule["annotations"]["description"])
                text = " ".join(text.split()).replace("|", "\\|")
                rows.append(f"| `{rule['alert']}` | {rule['labels']['severity']} | {text} |")
    return "\n".join(rows)


GENERATORS: dict[str, Callable[[], str]] = {
    "metric-table": metric_table,
    "openapi-endpoints": openapi_endpoints,
    "openapi-schema": openapi_schema,
    "bench-results": bench_results,
    "alert-actions": alert_actions,
}


class _Generated(Preprocessor):
    def run(self, lines: list[str]) -> list[str]:
        out: list[str] = []
        for line in lines:
            match = MARKER.match(line.strip())
            if match is None:
                out.append(line)
                continue
            name = match.group(1)
            if name not in GENERATORS:
                # A typo must fail the build, not leave a hole in the page.
                raise ValueError(f"unknown generated block {name!r}; known: {sorted(GENERATORS)}")
            out.extend(["", *GENERATORS[name]().splitlines(), ""])
        return out


def _sphinx_role(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class _SphinxRoles(Preprocessor):
    def run(self, lines: list[str]) -> list[str]:
        return [SPHINX_ROLE.sub(_sphinx_role, line) for line in lines]


class GeneratedExtension(markdown.Extension):
    """Replaces ``<!-- generated: NAME -->`` lines before any other Markdown processing,
    and Sphinx cross-reference roles in docstrings by the name they refer to, as code."""

    def extendMarkdown(self, md: markdown.Markdown) -> None:
        # Above the normaliser and fenced code (priorities 30 and 25), so generated tables
        # and code blocks are parsed like hand-written ones.
        md.preprocessors.register(_Generated(md), "ampscope_generated", 35)
        md.preprocessors.register(_SphinxRoles(md), "ampscope_sphinx_roles", 34)


def makeExtension(**kwargs: object) -> GeneratedExtension:
    return GeneratedExtension(**kwargs)
