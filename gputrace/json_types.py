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
