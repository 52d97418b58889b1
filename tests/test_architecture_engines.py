"""The engine boundary: which engine a run has is asked of gputrace/engines/ (``engine_words`` and
the engine modules), not compared by name elsewhere, and an engine's flags are written only there.
The places that still do it are counted against a ceiling that may only fall (a ratchet)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from gputrace.engines import ENGINE_WORDS

PACKAGE = Path(__file__).resolve().parent.parent / "gputrace"
ENGINE_NAMES = frozenset(ENGINE_WORDS)
# every flag and variable an engine module declares (SGLang's K flag, vLLM's --max-num-seqs, ...)
ENGINE_FLAGS = frozenset(w for words in ENGINE_WORDS.values()
                         for w in (*words.flags.values(), *words.other_words))
_FLAG = re.compile("|".join(rf"(?<![\w-]){re.escape(f)}(?![\w-])" for f in sorted(ENGINE_FLAGS)))

# Places outside gputrace/engines/ comparing an engine's name or writing an engine's flag, at most.
# Lower it when you move one behind the engine modules; never raise it (76 comparisons in 24 files
# when the issue was filed at dda5278; by this count 108 places in 27 files at 0008765; the engines
# branch took it to 100 while the prefill and input-validation branches, written beside it, added
# 13 (the prefill rules' flags in diagnose.py, aligned.py's prefill chunk rule): 113 when they met;
# the engines-pkg branch's rules asking the run's engine (its flags, scheduling policy, log form,
# KV and timer advice) took it to 45, the what-if and simulator asking its scheduling policy to 33,
# the import (--<engine>-log per registered engine), Prometheus import and notes to 23).
CEILING = 23


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
    """No more places outside gputrace/engines/ compare an engine name or write an engine flag
    than the ceiling (lower it as they move; the places are printed)."""
    places = engine_places()
    print(f"{len(places)} places (ceiling {CEILING}):", *places, sep="\n")
    assert len(places) <= CEILING, "\n".join(places)


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
