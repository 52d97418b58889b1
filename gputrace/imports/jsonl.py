"""gputrace's own requests JSONL: one JSON object per line, ``"type": "request"`` or ``"marker"``
plus the fields of RequestRecord or Marker (times in ns since the epoch, in the client's clock)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gputrace.errors import UsageError
from gputrace.model import Marker, RequestRecord

_TYPES: dict[str, type[RequestRecord] | type[Marker]] = {"request": RequestRecord, "marker": Marker}
_FIELDS = {name: {f.name for f in dataclasses.fields(rt)} for name, rt in _TYPES.items()}
_REQUIRED = {
    name: {f.name for f in dataclasses.fields(rt) if f.default is dataclasses.MISSING}
    for name, rt in _TYPES.items()
}


def record_to_json(record: RequestRecord | Marker) -> str:
    """One line of the format (without the newline)."""
    kind = "request" if isinstance(record, RequestRecord) else "marker"
    return json.dumps({"type": kind, **dataclasses.asdict(record)}, separators=(",", ":"))


def write_jsonl(path: str | os.PathLike[str], records: Iterable[RequestRecord | Marker]) -> int:
    """Write records (markers and requests) to ``path``; returns the lines written."""
    n = 0
    with Path(path).open("w") as fh:
        for record in records:
            fh.write(record_to_json(record) + "\n")
            n += 1
    return n


class JsonlWriter:
    """Appends records as they are produced (``gputrace load --out``), so an interrupted run keeps
    every request that had finished; use as a context manager or call :meth:`close`."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.lines = 0
        try:
            # Line-buffered: a killed run still leaves every line it had finished (a write per
            # request costs microseconds; requests come at most a few thousand a second).
            self._fh = self.path.open("w", buffering=1)
        except OSError as exc:
            raise UsageError(f"{self.path}: cannot write: {exc.strerror}") from exc

    def write(self, record: RequestRecord | Marker) -> None:
        self._fh.write(record_to_json(record) + "\n")
        self.lines += 1

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def record_from_obj(obj: Any) -> RequestRecord | Marker | None:
    """The record a parsed line describes, or None when it is not one of ours (or malformed)."""
    if not isinstance(obj, dict):
        return None
    kind = obj.get("type")
    if not isinstance(kind, str) or kind not in _TYPES:
        return None
    record_type = _TYPES[kind]
    fields = {k: v for k, v in obj.items() if k in _FIELDS[kind]}
    if not _REQUIRED[kind] <= fields.keys():
        return None
    try:
        record = record_type(**fields)
    except TypeError:
        return None
    ts = record.start_ns if isinstance(record, RequestRecord) else record.ts_ns
    return record if isinstance(ts, int) else None
