"""The layering rules checked on the source: analysis is pure (no store, no configuration, no
database), and only the store speaks SQL."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gputrace"
# What analysis must not import: it works on RunTables, whoever read them.
ANALYSIS_BANNED = ("gputrace.store", "gputrace.config", "duckdb")
# SQL statements as they start in a string (upper case, as the store writes them).
SQL_STATEMENT = re.compile(r"\bSELECT\b.+\bFROM\b|\bINSERT\s+INTO\b|\bUPDATE\s+\w+\s+SET\b|\bDELETE\s+FROM\b|"
                           r"\bCREATE\s+\S*\s*TABLE\b|\b(DROP|ALTER)\s+TABLE\b|\bCOPY\s+\S+\s+TO\b|"
                           r"\bSET\s+\w+\s*=", re.DOTALL)


def _imports(tree: ast.AST) -> list[str]:
    """Every module a file imports, at any depth (deferred imports included)."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def _banned(name: str) -> bool:
    return any(name == b or name.startswith(b + ".") for b in ANALYSIS_BANNED)


def test_analysis_imports_neither_store_nor_config_nor_duckdb() -> None:
    """No module of gputrace/analysis imports gputrace.store, gputrace.config or duckdb."""
    files = sorted((PACKAGE / "analysis").glob("*.py"))
    assert len(files) >= 5
    offending = {f.name: [n for n in _imports(ast.parse(f.read_text())) if _banned(n)] for f in files}
    assert {name: found for name, found in offending.items() if found} == {}


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    """Each string literal (an f-string's literal parts joined) with its line."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else "{}"
                           for v in node.values)
            out.append((node.lineno, text))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append((node.lineno, node.value))
    return out


def test_sql_only_in_the_store() -> None:
    """No string outside gputrace/store.py holds an SQL statement."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "store.py":
            continue
        for line, text in _strings(ast.parse(path.read_text())):
            if SQL_STATEMENT.search(text):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {text[:60]!r}")
    assert found == []


def test_the_sql_check_sees_sql() -> None:
    """The pattern finds the statements the store runs, and not prose."""
    store_strings = [text for _, text in _strings(ast.parse((PACKAGE / "store.py").read_text()))]
    statements = {m.group(0).split()[0] for t in store_strings if (m := SQL_STATEMENT.search(t))}
    assert statements >= {"SELECT", "INSERT", "UPDATE", "CREATE", "SET"}
    assert not SQL_STATEMENT.search("Select a window from the run, then update the report")


# -- the layers, package by package ---------------------------------------------------------------
# Data flows one way: sources -> capture -> store -> analysis -> advice/whatif -> outputs. Each
# top-level module or package of gputrace has a layer; a layer imports only the layers in its row
# (and itself). A new package fails the test below until it is given a layer here.
LAYER_OF = {
    # shared vocabulary and plumbing, importable from every layer
    **dict.fromkeys(("gputrace", "errors", "model", "backoff", "logsetup", "run_tables", "vocabulary",
                     "topology", "metric_names", "token_file", "config", "httpserver", "exposition",
                     "log_clock", "dashboard", "arrow_columns", "json_types"), "base"),
    # the engines (their log grammars, settings and words): every layer asks the run's engine
    "engines": "base",
    # what produces the records: NVML and its agent, engine logs and metrics, SSH, the load
    **dict.fromkeys(("gpu", "remote", "load", "agent"), "sources"),
    "store": "store",
    # from sources into the store: the collector (and its live view), importers of files and Prometheus
    **dict.fromkeys(("collect", "live", "imports", "prometheus"), "capture"),
    "analysis": "analysis",
    # the simulated deployment: it speaks the sources' formats and writes stores
    "sim": "sim",
    # what is computed from the analysis: the what-if, the advice, and the one pipeline running them
    **dict.fromkeys(("whatif", "advice", "analyse"), "advice"),
    "report": "outputs",
    # the command line and the demo: they wire every layer together
    **dict.fromkeys(("cli", "__main__", "commands", "demo", "watch"), "cli"),
}
MAY_IMPORT = {
    "base": {"base"},
    "sources": {"base"},
    "store": {"base"},
    "capture": {"base", "sources", "store"},
    "analysis": {"base"},  # pure: RunTables in, results out (no store, no sources)
    "sim": {"base", "sources", "store", "capture"},
    "advice": {"base", "store", "analysis", "sim"},
    "outputs": {"base", "analysis", "advice"},  # the report renders the analysis result only
    "cli": {"base", "sources", "store", "capture", "analysis", "sim", "advice", "outputs"},
}
# Arrows against the table that exist today, each with its reason; remove one when it is fixed.
EXCEPTIONS = {
    ("live", "analysis"): "the live view's busy and bubble use the report's formula "
                          "(gputrace.analysis.phase_figures.busy_and_bubble, a pure function)",
}
# click is the command line's library: gputrace/commands/ and the group they hang from (cli.py).
CLICK_ALLOWED = ("gputrace.commands", "gputrace.cli")


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _package_graph() -> dict[str, set[str]]:
    from test_architecture_imports import GRAPH

    out: dict[str, set[str]] = {}
    for module, imported in GRAPH.items():
        out.setdefault(_top(module), set()).update(_top(m) for m in imported if _top(m) != _top(module))
    return out


def test_every_package_has_a_layer() -> None:
    """Each top-level module and package of gputrace is placed in the layer table."""
    assert sorted(set(_package_graph()) - set(LAYER_OF)) == []


def _violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{pkg} ({LAYER_OF[pkg]}) -> {dep} ({LAYER_OF[dep]})"
                  for pkg, deps in graph.items() for dep in deps
                  if pkg in LAYER_OF and dep in LAYER_OF and LAYER_OF[dep] != LAYER_OF[pkg]
                  and LAYER_OF[dep] not in MAY_IMPORT[LAYER_OF[pkg]] and (pkg, dep) not in EXCEPTIONS)


def test_no_package_imports_a_layer_it_may_not() -> None:
    """No package imports a layer outside its row of MAY_IMPORT (deferred imports included), but
    for the listed exceptions."""
    assert _violations(_package_graph()) == []


def test_the_exceptions_are_still_needed() -> None:
    """Every listed exception is an arrow that exists (a fixed one leaves the list)."""
    graph = _package_graph()
    assert [arrow for arrow in EXCEPTIONS if arrow[1] not in graph.get(arrow[0], set())] == []


def test_no_import_cycle_between_packages() -> None:
    """No package reaches itself through other packages (imports/ <-> prometheus/ did)."""
    from test_architecture_imports import cycles

    assert cycles(_package_graph()) == []


def test_the_layer_check_sees_a_violation() -> None:
    """The check refuses what the table forbids (analysis reading the store, a source importing
    capture, the report importing a command) and passes the arrows the data flow has."""
    assert _violations({"analysis": {"store", "run_tables"}, "engines": {"collect"},
                        "report": {"commands", "analysis"}}) == [
        "analysis (analysis) -> store (store)", "engines (base) -> collect (capture)",
        "report (outputs) -> commands (cli)"]
    assert _violations({"collect": {"store", "remote"}, "whatif": {"analysis", "sim"}}) == []


def test_click_only_in_the_commands() -> None:
    """No module outside gputrace/commands/ (and the group in gputrace/cli.py) imports click."""
    from test_architecture_imports import MODULES

    importers = []
    for module, path in MODULES.items():
        if module.startswith(CLICK_ALLOWED):
            continue
        if any(n == "click" or n.startswith("click.") for n in _imports(ast.parse(path.read_text()))):
            importers.append(module)
    assert importers == []


def test_no_module_is_named_metrics_or_run() -> None:
    """Names say one thing each: five modules were named `metrics` and three `run` (the metric
    names, the agent's exporter, the simulated engine's exposition, the phase figures, the engine
    scraper; the analysis result, the run command, the virtual-time run)."""
    vague = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.stem in ("metrics", "run"))
    assert vague == []


def test_analyse_run_is_the_one_way_to_analyse_a_run_and_the_benches_time_it() -> None:
    """A run is analysed through gputrace.analyse.analyse_run only (analyse_store was a second public
    way, and the benchmarks timed it instead of the path users run): no other public function of
    the package takes a run source to analyse, and every bench that analyses a run calls analyse_run."""
    defined = sorted(f"{path.relative_to(PACKAGE.parent)}:{node.name}" for path in PACKAGE.rglob("*.py")
                     for node in ast.walk(ast.parse(path.read_text()))
                     if isinstance(node, ast.FunctionDef) and node.name.startswith("analyse_")
                     and node.name not in ("analyse_run", "analyse_tables", "analyse_aligned"))
    assert defined == []
    bench = PACKAGE.parent / "bench"
    def called(node: ast.AST) -> str:
        func = node.func if isinstance(node, ast.Call) else None
        return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""

    analysing = {path.name: {called(node) for node in ast.walk(ast.parse(path.read_text()))
                             if called(node).startswith("analyse_")}
                 for path in sorted(bench.glob("*.py"))}
    assert {name: calls for name, calls in analysing.items() if calls and calls != {"analyse_run"}} == {}
    assert sum(1 for calls in analysing.values() if calls) >= 3
