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
