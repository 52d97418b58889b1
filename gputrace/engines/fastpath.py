"""Vectorised recognition of SGLang's current default batch lines, one chunk of a file at a time.

Only lines in the exact current form (``[date time( PPn ...)] Decode batch, #running-req: ...``)
are taken here. A strict pattern (RE2, matched by Arrow without capture groups) selects them;
their fields are then cut out with numpy from the byte positions of the fixed keys, commas and
colons. Everything else (other versions, odd prefixes, startup lines) is handed back for the
per-line grammar, which gives the same values (a test holds both paths to that). The work is
numpy and Arrow kernels that release the GIL, so chunks can be scanned in threads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gputrace.engines.common import LogClock
from gputrace.engines.sglang import _RANK, _RANK_FIELDS

_PREFIX = r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d\d\d)?(?: (?:DP|PP|ATTN_CP|MOE_DP|TP|EP)\d+)*\] "
_GRAPH = r"(?:cuda|cpu|npu|musa) graph: (?:True|False)"
# Unbounded repeats keep RE2 on its fast DFA (bounded ones multiply its states); rows whose
# numbers are too long for exact int64/float64 arithmetic are handed back instead.
_INT = r"\d+"
_DEC = r"\d+\.\d+"
_MAX_INT_DIGITS = 18
_MAX_DEC_DIGITS = 15
DECODE_PATTERN = (
    _PREFIX + rf"Decode batch(?: \[\d+\])?, #running-req: {_INT}, #token: {_INT}, token usage: {_DEC}, "
    + _GRAPH + rf", gen throughput \(token/s\): {_DEC}, #queue-req: {_INT}(?:, )?\n?$"
)
PREFILL_PATTERN = (
    _PREFIX + rf"Prefill batch(?: \[\d+\])?, #new-seq: {_INT}, #new-token: {_INT}, #cached-token: {_INT}, "
    rf"token usage: {_DEC}, #running-req: {_INT}, #queue-req: {_INT}, (?:#pending-token: {_INT}, )?"
    + _GRAPH + rf", input throughput \(token/s\): {_DEC}\n?$"
)
# A line without any of these cannot be an SGLang scheduler or configuration line.
_MAYBE_SGLANG = r"batch|#running-req: |max_total_num_tokens=|server_args=ServerArgs\("

# The fields of each form in order: (SchedulerEvent field, bytes from the previous field's end
# to this value, type). A None gap means "after the next colon + space" (graph label varies).
_DECODE_FIELDS: tuple[tuple[str, int | None, str], ...] = (
    ("running_req", len(", #running-req: "), "int"),
    ("num_token", len(", #token: "), "int"),
    ("token_usage", len(", token usage: "), "dec"),
    ("cuda_graph", None, "bool"),
    ("gen_throughput_tok_s", len(", gen throughput (token/s): "), "dec"),
    ("queue_req", len(", #queue-req: "), "int"),
)
_PREFILL_HEAD: tuple[tuple[str, int | None, str], ...] = (
    ("new_seq", len(", #new-seq: "), "int"),
    ("new_token", len(", #new-token: "), "int"),
    ("cached_token", len(", #cached-token: "), "int"),
    ("token_usage", len(", token usage: "), "dec"),
    ("running_req", len(", #running-req: "), "int"),
    ("queue_req", len(", #queue-req: "), "int"),
)
_PREFILL_TAIL: tuple[tuple[str, int | None, str], ...] = (
    ("cuda_graph", None, "bool"),
    ("input_throughput_tok_s", len(", input throughput (token/s): "), "dec"),
)


@dataclass
class ChunkResult:
    """One chunk: its line count, the fast rows as columns, and what is left to do."""

    n_lines: int
    columns: dict[str, pa.Array] = field(default_factory=dict)
    n_fast: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    n_rejected: int = 0  # lines that cannot be scheduler lines: counted, never parsed
    leftovers: list[tuple[int, str]] = field(default_factory=list)  # (offset in chunk, line)


class _Bytes:
    """A chunk as a byte array with the sorted positions of the separators the layout uses."""

    def __init__(self, chunk: bytes):
        self.b = np.frombuffer(chunk, dtype=np.uint8)
        self.size = len(self.b)
        # Each list ends with the chunk's size: "no such byte further on".
        self.commas, self.colons, self.closers, self.dots = (
            np.append(np.flatnonzero(self.b == ord(char)), self.size) for char in ",:]."
        )

    def next_at(self, positions: np.ndarray, start: np.ndarray) -> np.ndarray:
        """The first position >= start in ``positions``, or the chunk's size when there is none."""
        return positions[np.searchsorted(positions, start)]

    def digits(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """The unsigned integer written in bytes [start, end) of each row (at most 15 digits)."""
        value = np.zeros(len(start), dtype=np.int64)
        width = end - start
        for k in range(int(width.max(initial=0))):
            more = k < width
            digit = self.b[np.minimum(start + k, self.size - 1)].astype(np.int64) - 48
            value = np.where(more, value * 10 + digit, value)
        return value

    def decimal(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """``123.45`` -> 12345 / 10**2: an exact integer over an exact power of ten is the
        correctly rounded double, the same as float("123.45")."""
        dot = np.minimum(self.next_at(self.dots, start), end)
        frac_len = np.maximum(end - dot - 1, 0)  # rows cut short (handed back) may lack the dot
        mantissa = self.digits(start, dot) * 10**frac_len + self.digits(dot + 1, end)
        result: np.ndarray = mantissa / (10.0**frac_len)
        return result


def _lines(chunk: bytes) -> tuple[pa.StringArray, np.ndarray, np.ndarray]:
    """The chunk's lines as one zero-copy Arrow array, with each line's start and end (no newline)."""
    newlines = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
    ends = newlines + 1
    line_ends = newlines
    if not chunk.endswith(b"\n"):
        ends = np.append(ends, len(chunk))
        line_ends = np.append(line_ends, len(chunk))
    offsets = np.empty(len(ends) + 1, dtype=np.int32)
    offsets[0] = 0
    offsets[1:] = ends
    lines = pa.StringArray.from_buffers(len(ends), pa.py_buffer(offsets), pa.py_buffer(chunk))
    lines.validate(full=True)  # invalid UTF-8 raises; the caller parses that chunk line by line
    return lines, offsets[:-1].astype(np.int64), line_ends.astype(np.int64)


def _timestamps(raw: _Bytes, start: np.ndarray, clock: LogClock) -> tuple[pa.Array, np.ndarray, np.ndarray]:
    """Log time (ns), its resolution, and where the rank text starts, per row.

    Each distinct second is converted once through the clock (timezone, invalid dates)."""
    def field_at(offset: int, width: int) -> np.ndarray:
        return raw.digits(start + offset, start + offset + width)

    year, month, day = field_at(1, 4), field_at(6, 2), field_at(9, 2)
    hour, minute, second = field_at(12, 2), field_at(15, 2), field_at(18, 2)
    packed = ((((year * 100 + month) * 100 + day) * 100 + hour) * 100 + minute) * 100 + second
    unique, inverse = np.unique(packed, return_inverse=True)
    converted = []
    for p in unique.tolist():
        hms = f"{p // 10000 % 100:02d}:{p // 100 % 100:02d}:{p % 100:02d}"
        date_text = f"{p // 10**10:04d}-{p // 10**8 % 100:02d}-{p // 10**6 % 100:02d}"
        converted.append(clock.to_ns(date_text, hms, None)[0])
    missing = np.array([v is None for v in converted], dtype=bool)[inverse]
    ts_ns = np.array([v or 0 for v in converted], dtype=np.int64)[inverse]
    has_ms = raw.b[np.minimum(start + 20, raw.size - 1)] == ord(".")
    if has_ms.any():
        ts_ns = ts_ns + np.where(has_ms, field_at(21, 3), 0) * 1_000_000
    resolution = np.where(has_ms, 1_000_000, 1_000_000_000).astype(np.int64)
    rank_start = start + np.where(has_ms, 24, 20)
    return pa.array(ts_ns, mask=missing), resolution, rank_start


def _ranks(raw: _Bytes, start: np.ndarray, end: np.ndarray) -> dict[str, pa.Array]:
    """Rank columns from the rank text in [start, end) (e.g. `` DP0 PP3``); distinct texts parsed once."""
    width = int((end - start).max(initial=0))
    cols = np.arange(width)
    idx = start[:, None] + cols[None, :]
    grid = np.where(idx < end[:, None], raw.b[np.minimum(idx, raw.size - 1)], 0).astype(np.uint8)
    keys = np.ascontiguousarray(grid).view(f"S{width}").ravel() if width else np.zeros(len(start), "S1")
    unique, inverse = np.unique(keys, return_inverse=True)
    out: dict[str, pa.Array] = {}
    tables = {name: np.full(len(unique), -1, dtype=np.int64) for name in _RANK_FIELDS.values()}
    for i, key in enumerate(unique.tolist()):
        for label, number in _RANK.findall(key.decode("ascii", errors="replace")):
            name = _RANK_FIELDS.get(label)
            if name is not None and tables[name][i] < 0:
                tables[name][i] = int(number)
    for name, table in tables.items():
        values = table[inverse]
        out[name] = pa.array(values, mask=values < 0)
    return out


def _fields(raw: _Bytes, pos: np.ndarray, line_end: np.ndarray,
            layout: tuple[tuple[str, int | None, str], ...], cols: dict[str, pa.Array],
            too_long: np.ndarray) -> np.ndarray:
    """Cut the fields of ``layout`` starting at ``pos`` (just before the first gap); marks rows
    with numbers too long for exact arithmetic in ``too_long``; returns the position after the
    last field."""
    for name, gap, kind in layout:
        start = raw.next_at(raw.colons, pos) + 2 if gap is None else pos + gap
        end = np.minimum(raw.next_at(raw.commas, start), line_end)
        if kind == "int":
            too_long |= (end - start) > _MAX_INT_DIGITS
            cols[name] = pa.array(raw.digits(start, np.minimum(end, start + _MAX_INT_DIGITS)))
        elif kind == "dec":
            too_long |= (end - start - 1) > _MAX_DEC_DIGITS
            cols[name] = pa.array(raw.decimal(start, np.minimum(end, start + _MAX_DEC_DIGITS + 1)))
        else:
            cols[name] = pa.array(raw.b[start] == ord("T"))
        pos = end
    return pos


def _rows(raw: _Bytes, start: np.ndarray, line_end: np.ndarray, kind: str, clock: LogClock,
          line_no: np.ndarray) -> tuple[dict[str, pa.Array], np.ndarray]:
    """The columns of rows known to be in ``kind``'s current form, and the rows to hand back."""
    too_long = np.zeros(len(start), dtype=bool)
    cols: dict[str, pa.Array] = {"line_no": pa.array(line_no)}
    cols["log_ts_ns"], resolution, rank_start = _timestamps(raw, start, clock)
    cols["ts_resolution_ns"] = pa.array(resolution)
    closer = raw.next_at(raw.closers, rank_start)
    cols.update(_ranks(raw, rank_start, closer))
    after_words = closer + (len("] Decode batch") if kind == "decode" else len("] Prefill batch"))
    # ``Prefill batch [N],`` (SGLANG_LOG_FORWARD_ITERS=1): skip to the iteration's closing bracket.
    has_iter = raw.b[np.minimum(after_words, raw.size - 1)] == ord(" ")
    pos = np.where(has_iter, raw.next_at(raw.closers, after_words) + 1, after_words)
    if kind == "decode":
        _fields(raw, pos, line_end, _DECODE_FIELDS, cols, too_long)
    else:
        pos = _fields(raw, pos, line_end, _PREFILL_HEAD, cols, too_long)
        has_pending = raw.b[np.minimum(pos + 2, raw.size - 1)] == ord("#")
        pos = np.where(has_pending, raw.next_at(raw.commas, pos + 2), pos)
        _fields(raw, pos, line_end, _PREFILL_TAIL, cols, too_long)
    cols["kind"] = pa.DictionaryArray.from_arrays(np.zeros(len(start), dtype=np.int32), pa.array([kind]))
    if too_long.any():
        keep = pa.array(~too_long)
        cols = {name: values.filter(keep) for name, values in cols.items()}
    return cols, too_long


def scan_chunk(chunk: bytes, first_line_no: int, clock: LogClock) -> ChunkResult:
    """Take the chunk's current-form batch lines; hand back the rest (numbered from the chunk)."""
    try:
        lines, starts, line_ends = _lines(chunk)
    except pa.ArrowInvalid:
        text_lines = chunk.decode("utf-8", errors="replace").split("\n")
        if text_lines and text_lines[-1] == "":
            text_lines.pop()
        return ChunkResult(n_lines=len(text_lines), leftovers=list(enumerate(text_lines)))
    result = ChunkResult(n_lines=len(lines))
    raw = _Bytes(chunk)
    parts: list[dict[str, pa.Array]] = []
    remaining = np.arange(len(lines))
    for kind, pattern in (("decode", DECODE_PATTERN), ("prefill", PREFILL_PATTERN)):
        if not len(remaining):
            break
        subset = lines if len(remaining) == len(lines) else lines.take(pa.array(remaining))
        hit = pc.match_substring_regex(subset, pattern).to_numpy(zero_copy_only=False)
        rows = remaining[hit]
        remaining = remaining[~hit]
        if len(rows):
            cols, too_long = _rows(raw, starts[rows], line_ends[rows], kind, clock, rows + first_line_no)
            if too_long.any():
                remaining = np.sort(np.concatenate([remaining, rows[too_long]]))
            if len(cols["line_no"]):
                parts.append(cols)
                result.kinds[kind] = len(cols["line_no"])
    if len(remaining):
        rest = lines.take(pa.array(remaining))
        maybe = pc.match_substring_regex(rest, _MAYBE_SGLANG).to_numpy(zero_copy_only=False)
        result.n_rejected = int((~maybe).sum())
        result.leftovers = list(zip(remaining[maybe].tolist(), rest.filter(maybe).to_pylist(), strict=True))
    if parts:
        result.columns = concat(parts)
        result.n_fast = sum(result.kinds.values())
    return result


def concat(parts: list[dict[str, pa.Array]]) -> dict[str, pa.Array]:
    """Join column dicts row-wise; a column missing from a part is NULL there."""
    if len(parts) == 1:
        return dict(parts[0])
    names = {name for part in parts for name in part}
    out: dict[str, pa.Array] = {}
    for name in sorted(names):
        arrays = [part.get(name) for part in parts]
        types = [a.type for a in arrays if a is not None]
        target = pa.string() if pa.types.is_dictionary(types[0]) else types[0]
        out[name] = pa.concat_arrays([
            pa.nulls(len(part["line_no"]), type=target) if a is None else a.cast(target)
            for a, part in zip(arrays, parts, strict=True)
        ])
    return out
