"""The engine boundary: which engine a run has is asked of gputrace/engines/ (``engine_words`` and
the engine modules), not compared by name elsewhere, and an engine's flags are written only there.
The files that still do it are listed, each with its reason and a count that may only fall."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

from gputrace.engines import ENGINE_WORDS

PACKAGE = Path(__file__).resolve().parent.parent / "gputrace"
ENGINE_NAMES = frozenset(ENGINE_WORDS)
# every flag and variable an engine module declares (SGLang's K flag, vLLM's --max-num-seqs, ...)
ENGINE_FLAGS = frozenset(w for words in ENGINE_WORDS.values()
                         for w in (*words.flags.values(), *words.other_words))
_FLAG = re.compile("|".join(rf"(?<![\w-]){re.escape(f)}(?![\w-])" for f in sorted(ENGINE_FLAGS)))

# The files outside gputrace/engines/ that may still name an engine or write its flags, each with
# its reason and the most places it may hold; any other file that does fails the boundary test.
# (76 comparisons in 24 files when the issue was filed at dda5278; 113 places in 27 files when the
# engines branch started; 11 in 5 files after it; none since the simulator asks each engine's
# package for its log, its /metrics series, whether it serves in real time and its flags.)
ALLOWED: dict[str, tuple[int, str]] = {}
CEILING = sum(n for n, _ in ALLOWED.values())


def _is_engine_name(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in ENGINE_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_engine_name(e) for e in node.elts)
    return False


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of docstring nodes (prose about an engine is not a comparison or a flag written)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def engine_places(root: Path = PACKAGE) -> list[str]:
    """``path:line: what`` for each engine-name comparison and each engine flag literal outside
    gputrace/engines/."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if root / "engines" in path.parents:
            continue
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        where = path.relative_to(root.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(
                    isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops) and \
                    any(_is_engine_name(e) for e in (node.left, *node.comparators)):
                found.append(f"{where}:{node.lineno}: compares an engine name: {ast.unparse(node)[:70]}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                for flag in _FLAG.findall(node.value):
                    found.append(f"{where}:{node.lineno}: writes the flag {flag}")
    return found


def test_engine_names_and_flags_stay_behind_the_engine_modules() -> None:
    """No file outside gputrace/engines/ compares an engine name or writes an engine flag, but the
    listed ones, each within its count (lower it as they move; the places are printed)."""
    places = engine_places()
    print(f"{len(places)} places (ceiling {CEILING}):", *places, sep="\n")
    assert beyond_allowed(places) == [], "\n".join(places)


def beyond_allowed(places: list[str], allowed: dict[str, tuple[int, str]] = ALLOWED) -> list[str]:
    """The places of every file that holds more than ``allowed`` lets it (none for a file not listed)."""
    per_file = Counter(p.split(":", 1)[0] for p in places)
    over = {f for f, n in per_file.items() if n > allowed.get(f, (0, ""))[0]}
    return [p for p in places if p.split(":", 1)[0] in over]


def test_the_count_sees_comparisons_and_flags(tmp_path: Path) -> None:
    """A comparison with an engine name (==, in a tuple) and a flag in a string or an f-string are
    counted; a docstring about an engine, an unrelated string and the engine modules are not."""
    pkg = tmp_path / "gputrace"
    (pkg / "engines").mkdir(parents=True)
    (pkg / "engines" / "x.py").write_text('FLAG = "--max-num-seqs"\nok = kind == "vllm"\n')
    (pkg / "m.py").write_text(
        '"""Speaks of --max-num-seqs and sglang."""\n'
        'def f(kind, n):\n'
        '    """vLLM\'s --max-num-seqs."""\n'
        '    a = kind == "sglang"\n'
        '    b = kind in ("sglang", "other")\n'
        '    c = f"--pp-max-micro-batch-size {n}"\n'
        '    d = "--max-num-seqs-extra --out"\n'
        '    return a, b, c, d\n')
    places = engine_places(pkg)
    lines = [p.split(": ", 1)[0] for p in places]
    assert lines == ["gputrace/m.py:4", "gputrace/m.py:5", "gputrace/m.py:6"], places
    assert beyond_allowed(places) == places  # a file not listed may hold none
    listed = {"gputrace/commands/sim.py": (1, "a reason")}
    two = ["gputrace/commands/sim.py:1: compares", "gputrace/commands/sim.py:2: compares"]
    assert beyond_allowed(two[:1], listed) == []  # a listed file within its count
    assert beyond_allowed(two, listed) == two  # past it: all its places
