"""The type of a JSON document that gputrace writes or reads whole: a Grafana dashboard, a Perfetto
trace, `meta.json`, an HTTP body. mypy checks such a value all the way down, where `Any` checks
nothing: a reader must narrow what it takes out (and so validates it where it enters), a writer
cannot put a value in that `json.dumps` would refuse.

Domain records (settings, findings, changes, figures) are frozen dataclasses, never these: a JSON
type is for the document's edge, where the bytes come in or go out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

JsonScalar: TypeAlias = str | int | float | bool | None
JsonValue: TypeAlias = JsonScalar | list["JsonValue"] | dict[str, "JsonValue"]
# A document being built or read: a dict, as `json.loads` returns and `json.dumps` takes.
JsonObject: TypeAlias = dict[str, JsonValue]
# What a function only reads: covariant, so a `dict[str, float]` or a list of them passes.
JsonReadValue: TypeAlias = JsonScalar | Sequence["JsonReadValue"] | Mapping[str, "JsonReadValue"]
JsonReadObject: TypeAlias = Mapping[str, JsonReadValue]


# Narrowing what a reader takes out of a document: a value of another type than expected reads as
# absent (None, empty), as a missing setting does.


def as_text(value: JsonReadValue | None) -> str | None:
    """A JSON string, else None."""
    return value if isinstance(value, str) else None


def as_number(value: JsonReadValue | None) -> float | None:
    """A JSON number (not a boolean), else None."""
    return None if isinstance(value, bool) or not isinstance(value, int | float) else value


def as_list(value: JsonReadValue | None) -> Sequence[JsonReadValue]:
    """A JSON array, else empty."""
    return value if isinstance(value, Sequence) and not isinstance(value, str) else ()


def as_object(value: JsonReadValue | None) -> JsonReadObject | None:
    """A JSON object, else None."""
    return value if isinstance(value, Mapping) else None


def as_objects(value: JsonReadValue | None) -> list[JsonReadObject]:
    """The objects in a JSON array (none where ``value`` is not an array)."""
    return [item for item in as_list(value) if isinstance(item, Mapping)]


def section(obj: JsonReadObject, *keys: str) -> JsonReadObject:
    """The object at ``keys`` inside ``obj`` (``panel, "fieldConfig", "defaults"``); empty where a
    key is absent or holds no object."""
    for key in keys:
        obj = as_object(obj.get(key)) or {}
    return obj
