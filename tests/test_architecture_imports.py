"""The package's import graph: no module imports itself back through others, whether at the top of
a file, inside a function or under TYPE_CHECKING, and prometheus_client has one adapter."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gputrace

PACKAGE = Path(gputrace.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imported(module: str, path: Path) -> set[str]:
    """The package's modules that ``module`` imports anywhere in its file (a name imported from a
    package is the package, unless it is one of its submodules). The package imports absolutely only
    (a test below holds it to that), so relative imports need no resolving."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            targets = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != module:
                out.add(target)
    if module == "gputrace.cli":  # it loads each command by name (importlib): every one is an edge
        out |= {m for m in MODULES if m.startswith("gputrace.commands.")}
    return out


GRAPH: dict[str, set[str]] = {m: _imported(m, p) for m, p in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_top_level_and_deferred_imports() -> None:
    """The reader finds a known top-level import and a known function-level one."""
    assert "gputrace.errors" in GRAPH["gputrace.config"]
    assert "gputrace.gpu.nvml" in GRAPH["gputrace.commands.agent"]  # imported inside _make_sampler
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_package_has_no_import_cycle() -> None:
    """No module of gputrace reaches itself through its imports, deferred ones included."""
    assert cycles(GRAPH) == []


def test_the_package_imports_absolutely() -> None:
    """No relative import: the graph above reads every import as written."""
    relative = [f"{m}:{node.lineno}" for m, p in MODULES.items()
                for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
                if isinstance(node, ast.ImportFrom) and node.level]
    assert relative == []


@pytest.mark.parametrize("library", ["prometheus_client"])
def test_a_library_is_imported_by_its_adapter_only(library: str) -> None:
    """prometheus_client is imported by gputrace/exposition.py alone (as ruff's banned-api says)."""
    importers = set()
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n == library or n.startswith(library + ".") for n in names):
                importers.add(module)
    assert importers == {"gputrace.exposition"}


def test_no_module_borrows_another_modules_private_names() -> None:
    """``from gputrace.x import _name`` nowhere in the package: what another module needs is public."""
    borrowed = [f"{m}: {node.module}.{alias.name}" for m, p in MODULES.items()
                for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gputrace")
                for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert borrowed == []
