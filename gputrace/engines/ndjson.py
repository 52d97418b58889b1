"""The fast path's rows as `gputrace parse` NDJSON, built column by column: the text json.dumps
gives each row's object (tested line for line), at a fraction of its cost (json.dumps and the
per-row dicts were 2/3 of `gputrace parse`'s time: 23x the time of a bare regex scan)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gputrace import arrow_columns
from gputrace.engines.common import METRIC_FIELDS, RANK_FIELDS

FAST_KEYS = (*RANK_FIELDS, *METRIC_FIELDS)  # to_json_obj's order after kind, engine and ts
# Arrow writes a double's shortest round-trip digits as Python's repr does, but switches to an
# exponent by other rules and leaves ".0" off integral values: its text is used where both write
# positional digits (".0" added where there is no point), json.dumps elsewhere (rare in a log).
_PLAIN_FLOAT_MIN, _PLAIN_FLOAT_MAX = 1e-4, 1e16  # Python's positional range


def _text_scalar(text: str) -> pa.Scalar:
    """A string scalar (``pa.scalar``, as pyarrow.compute does for a Python str, probes pandas)."""
    return arrow_columns.strings([text])[0]


_NULL, _TRUE, _FALSE, _POINT_ZERO, _EMPTY = map(_text_scalar, ("null", "true", "false", ".0", ""))
_NAN = arrow_columns.from_numpy(np.array([np.nan]))[0]
_NO = arrow_columns.from_numpy(np.array([False]))[0]


def _float_text(values: pa.Array) -> pa.Array:
    """Each double as json.dumps writes it ("null" for NULL)."""
    text = pc.cast(values, pa.string())
    numbers = arrow_columns.numbers(pc.fill_null(values, _NAN))  # NULL: "null" below
    valid = _flags(values.is_valid())
    magnitude = np.abs(numbers)
    plain = ((magnitude == 0) | ((magnitude >= _PLAIN_FLOAT_MIN) & (magnitude < _PLAIN_FLOAT_MAX)))
    plain &= ~_flags(pc.match_substring(text, "e"))  # Arrow's exponents start earlier
    # where both write positional digits they write the same ones; Arrow leaves off ".0"
    integral = plain & (numbers == np.trunc(numbers))
    with_point = pc.binary_join_element_wise(text, _POINT_ZERO, _EMPTY)
    text = pc.if_else(arrow_columns.from_numpy(integral), with_point, text)
    other = np.flatnonzero(~plain & valid)
    if len(other):
        texts: list[str | None] = text.to_pylist()
        for i in other.tolist():
            texts[i] = json.dumps(float(numbers[i]))  # Infinity and NaN as json.dumps writes them
        text = arrow_columns.strings(texts)
    return pc.fill_null(text, _NULL)


def _flags(flags: pa.Array) -> np.ndarray:
    """A bool array (NULL: False) as numpy."""
    return arrow_columns.numbers(pc.cast(pc.fill_null(flags, _NO), pa.int64())).astype(bool)


def _text(values: pa.Array) -> pa.Array:
    """A column's values as JSON text ("null" for NULL)."""
    if pa.types.is_floating(values.type):
        return _float_text(values)
    if pa.types.is_boolean(values.type):
        text = pc.if_else(values, _TRUE, _FALSE)
    else:
        text = pc.cast(values, pa.string())
    return pc.fill_null(text, _NULL)


def stamps(chunk: bytes, line_starts: np.ndarray, resolution_ns: np.ndarray) -> pa.Array:
    """Each fast row's stamp as logged, from the chunk: "YYYY-MM-DD hh:mm:ss" and ".mmm" at 1 ms."""
    lengths = np.where(resolution_ns == 1_000_000, 23, 19).astype(np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    first = line_starts.astype(np.int64) + 1  # after the "["
    index = np.repeat(first - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
    data = np.frombuffer(chunk, dtype=np.uint8)[index]
    return pa.Array.from_buffers(pa.large_string(), len(lengths),
                                 [None, pa.py_buffer(offsets), pa.py_buffer(data)]).cast(pa.string())


def fast_rows_ndjson(columns: dict[str, pa.Array], ts_text: pa.Array, engine: str) -> pa.Array:
    """One line of JSON per fast row, newline included: ``json.dumps(parsed.to_json_obj())``."""
    pieces: list[pa.Array | pa.Scalar] = [
        _text_scalar('{"kind": "'), pc.cast(columns["kind"], pa.string()),
        _text_scalar(f'", "engine": "{engine}", "ts": "'), ts_text, _text_scalar('"')]
    for name in FAST_KEYS:
        pieces += [_text_scalar(f', "{name}": '), _text(columns[name])]
    pieces.append(_text_scalar("}\n"))
    lines: pa.Array = pc.binary_join_element_wise(*pieces, _EMPTY)
    return lines


def joined_utf8(lines: pa.Array) -> memoryview:
    """A string array's values one after the other as UTF-8: a view of its data buffer (no copy,
    for a binary stream: decoding to str and encoding it again cost a tenth of `gputrace parse`)."""
    if not len(lines):
        return memoryview(b"")
    offsets = np.frombuffer(lines.buffers()[1], dtype=np.int32, count=len(lines) + 1, offset=4 * lines.offset)
    return memoryview(lines.buffers()[2])[int(offsets[0]):int(offsets[-1])]
