"""Engines print their configuration as Python reprs (a dataclass, a dict, ``k=v, ...``): the
fields of such text by name, literal values evaluated, anything else (an object repr) kept as text.
"""

from __future__ import annotations

import ast


def scalar(text: str) -> object:
    text = text.strip()
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"True": True, "False": False, "None": None}.get(text, text)


def simple_kwargs(text: str) -> dict[str, object]:
    """``a=1, b=2.5, c=73.60 GB`` -> {"a": 1, "b": 2.5, "c": "73.60 GB"}."""
    out: dict[str, object] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if sep and key.isidentifier():
            out[key] = scalar(value)
    return out


def python_kwargs(text: str) -> dict[str, object]:
    """The keyword arguments of a dataclass repr (``k='v', n=1, xs=[1, 2], sub=Cfg(a=1)``)."""
    out: dict[str, object] = {}
    for part in split_top_level(text):
        key, sep, value = part.strip().partition("=")
        if not (sep and key.isidentifier()):
            continue
        try:
            out[key] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            out[key] = value.strip()  # an object repr, kept as logged
    return out


def python_dict(text: str) -> dict[str, object]:
    """The items of a dict repr's body (``'k': 'v', 'n': 1, 'xs': [1, 2]``), values that are object
    reprs kept as logged."""
    out: dict[str, object] = {}
    for part in split_top_level(text):
        key, sep, value = part.strip().partition(": ")
        key = key.strip()
        if not (sep and len(key) >= 2 and key[0] == key[-1] and key[0] in "'\"" and key[1:-1].isidentifier()):
            continue
        try:
            out[key[1:-1]] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            out[key[1:-1]] = value.strip()
    return out


def split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets and quotes."""
    parts: list[str] = []
    depth = 0
    quote = ""
    escaped = False
    start = 0
    for i, char in enumerate(text):
        if quote:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth = max(depth - 1, 0)
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts
