"""The rank side's shape: no import cycles, small folders, torch internals read in compat.py.

Read from the source (``ast``), so an import under ``TYPE_CHECKING`` or inside a function
counts as much as one at the top: a cycle there still ties two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ampscope.rank

RANK = Path(ampscope.rank.__file__).parent
MAX_MODULES = 12

OVERRIDDEN_HOOK_POINTS = {"_unscale_grads_", "_check_inf_per_device"}
"""torch's scaler methods the mixin overrides and calls through ``super()``;
``compat.check_torch`` checks their signatures."""


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["ampscope", *parts])


def _imports(path: Path, root: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` imports, wherever the import stands."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                if submodule in known:
                    found.add(submodule)
                elif node.module in known:
                    found.add(node.module)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module → the modules below ``root`` it imports (a package's ``__init__`` as the
    package; the implicit import of a parent package is not an edge)."""
    paths = {_module_name(p, root): p for p in root.rglob("*.py")}
    known = set(paths)
    return {name: _imports(path, root, known) - {name} for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or ``None``."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for target in sorted(graph.get(node, ())):
            cycle = visit(target, [*path, node])
            if cycle is not None:
                return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start, [])
        if cycle is not None:
            return cycle
    return None


def test_the_rank_side_has_no_import_cycle() -> None:
    graph = import_graph(RANK)
    # The graph is real: the captures import the layout, the records the pending step.
    assert "ampscope.rank.capture.layout" in graph["ampscope.rank.capture.scaler"]
    assert "ampscope.rank.capture.pending" in graph["ampscope.rank.telemetry.records"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_cycle_finder_finds_a_cycle_under_type_checking(tmp_path: Path) -> None:
    package = tmp_path / "rank"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from ampscope.rank.sub import b\n")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from ampscope.rank.a import Thing\n"
    )
    graph = import_graph(package)
    assert graph["ampscope.rank.a"] == {"ampscope.rank.sub.b"}
    assert find_cycle(graph) == ["ampscope.rank.a", "ampscope.rank.sub.b", "ampscope.rank.a"]


def test_no_folder_holds_more_than_twelve_modules() -> None:
    counts = {
        str(folder.relative_to(RANK.parent)): len(list(folder.glob("*.py")))
        for folder in [RANK, *(p for p in RANK.rglob("*") if p.is_dir())]
        if (folder / "__init__.py").exists()
    }
    assert counts["rank/capture"] >= 5  # the count is real
    assert {k: n for k, n in counts.items() if n > MAX_MODULES} == {}


def _private_torch_reads(path: Path) -> list[str]:
    """Private torch names ``path`` touches: ``torch._x`` (or ``dist._x``), an import
    from a private torch module or of a private name, and a private attribute read on
    anything but ``self``/``cls`` (the mixin's calls of the hook points it overrides
    aside)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            parts = [*node.module.split("."), *(alias.name for alias in node.names)]
            if any(p.startswith("_") and not p.startswith("__") for p in parts):
                found.append(ast.unparse(node))
        elif isinstance(node, ast.Attribute):
            name = node.attr
            if not name.startswith("_") or name.startswith("__"):
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if name in OVERRIDDEN_HOOK_POINTS:
                continue
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_compat_reads_torch_internals() -> None:
    reads = {
        str(path.relative_to(RANK)): _private_torch_reads(path)
        for path in RANK.rglob("*.py")
        if path.name != "compat.py"
    }
    # The check sees what compat.py does.
    assert any("_local_tensor" in r for r in _private_torch_reads(RANK / "compat.py"))
    assert {k: v for k, v in reads.items() if v} == {}
