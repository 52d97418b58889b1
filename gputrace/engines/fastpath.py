"""Vectorised recognition of SGLang's current default batch lines, a chunk of a file at a time.

Only lines in the exact current form (``[date time( PPn ...)] Decode batch, #running-req: ...``)
are taken here; the strict patterns below accept nothing the per-line grammar would read
differently, and everything else (other versions, odd prefixes, startup lines) is handed back
for gputrace.engines.sglang. Arrow's compute kernels release the GIL, so chunks run in threads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gputrace.engines.common import LogClock
from gputrace.engines.sglang import _RANK, _RANK_FIELDS

_PREFIX = (
    r"^\[(?P<date>\d{4}-\d\d-\d\d) (?P<hms>\d\d:\d\d:\d\d)(?P<ms>(?:\.\d{3})?)"
    r"(?P<ranks>(?: (?:DP|PP|ATTN_CP|MOE_DP|TP|EP)\d+)*)\] "
)
_GRAPH = r"(?:cuda|cpu|npu|musa) graph: (?P<cuda_graph>True|False)"
DECODE_PATTERN = (
    _PREFIX + r"Decode batch(?: \[\d+\])?, #running-req: (?P<running_req>\d+), #token: (?P<num_token>\d+), "
    r"token usage: (?P<token_usage>\d+\.\d+), " + _GRAPH
    + r", gen throughput \(token/s\): (?P<gen_throughput_tok_s>\d+\.\d+), #queue-req: (?P<queue_req>\d+)"
    r"(?:, )?\n?$"
)
PREFILL_PATTERN = (
    _PREFIX + r"Prefill batch(?: \[\d+\])?, #new-seq: (?P<new_seq>\d+), #new-token: (?P<new_token>\d+), "
    r"#cached-token: (?P<cached_token>\d+), token usage: (?P<token_usage>\d+\.\d+), "
    r"#running-req: (?P<running_req>\d+), #queue-req: (?P<queue_req>\d+), (?:#pending-token: \d+, )?"
    + _GRAPH + r", input throughput \(token/s\): (?P<input_throughput_tok_s>\d+\.\d+)\n?$"
)
# A line without any of these cannot be an SGLang scheduler or configuration line.
_MAYBE_SGLANG = r"batch|#running-req: |max_total_num_tokens=|server_args=ServerArgs\("
_INT_FIELDS = ("running_req", "queue_req", "new_seq", "new_token", "cached_token", "num_token")
_FLOAT_FIELDS = ("token_usage", "gen_throughput_tok_s", "input_throughput_tok_s")


@dataclass
class ChunkResult:
    """One chunk: its line count, the fast rows as Arrow columns, and what is left to do."""

    n_lines: int
    columns: dict[str, pa.Array] = field(default_factory=dict)
    n_fast: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    n_rejected: int = 0  # lines that cannot be scheduler lines: counted, never parsed
    leftovers: list[tuple[int, str]] = field(default_factory=list)  # (offset in chunk, line)


def _lines(chunk: bytes) -> pa.StringArray:
    """The chunk's lines (each with its newline) as one zero-copy Arrow string array."""
    ends = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10) + 1
    if not chunk.endswith(b"\n"):
        ends = np.append(ends, len(chunk))
    offsets = np.empty(len(ends) + 1, dtype=np.int32)
    offsets[0] = 0
    offsets[1:] = ends
    lines = pa.StringArray.from_buffers(len(ends), pa.py_buffer(offsets), pa.py_buffer(chunk))
    lines.validate(full=True)  # invalid UTF-8 raises; the caller parses that chunk line by line
    return lines


def _timestamps(date: pa.Array, hms: pa.Array, ms: pa.Array, clock: LogClock) -> tuple[pa.Array, np.ndarray]:
    """Log time (ns) and its resolution per row; distinct seconds are converted once."""
    seconds = pc.dictionary_encode(pc.binary_join_element_wise(date, hms, " "))
    converted = [clock.to_ns(text[:10], text[11:], None)[0] for text in seconds.dictionary.to_pylist()]
    unique_missing = np.array([v is None for v in converted], dtype=bool)
    unique_ns = np.array([v or 0 for v in converted], dtype=np.int64)
    idx = seconds.indices.to_numpy(zero_copy_only=False)
    ts_ns = unique_ns[idx]
    has_ms = pc.not_equal(ms, "").to_numpy(zero_copy_only=False)
    if has_ms.any():
        millis = pc.cast(pc.if_else(has_ms, pc.utf8_slice_codeunits(ms, 1), "0"), pa.int64()).to_numpy()
        ts_ns = ts_ns + millis * 1_000_000
    resolution = np.where(has_ms, 1_000_000, 1_000_000_000).astype(np.int64)
    # An impossible date (month 13) is NULL, as on the per-line path.
    return pa.array(ts_ns, mask=unique_missing[idx]), resolution


def _ranks(ranks: pa.Array) -> dict[str, np.ndarray]:
    """Rank columns (NaN where absent) from the prefix's rank text; distinct texts parsed once."""
    encoded = pc.dictionary_encode(ranks)
    texts = encoded.dictionary.to_pylist()
    table = {name: np.full(len(texts), np.nan) for name in _RANK_FIELDS.values()}
    for i, text in enumerate(texts):
        for label, number in _RANK.findall(text):
            name = _RANK_FIELDS.get(label)
            if name is not None and np.isnan(table[name][i]):
                table[name][i] = int(number)
    idx = encoded.indices.to_numpy(zero_copy_only=False)
    return {name: values[idx] for name, values in table.items()}


def _columns(found: pa.StructArray, rows: np.ndarray, kind: str, first_line_no: int,
             clock: LogClock) -> dict[str, object]:
    cols: dict[str, object] = {"kind": pa.DictionaryArray.from_arrays(
        np.zeros(len(rows), dtype=np.int32), pa.array([kind]))}
    cols["line_no"] = rows.astype(np.int64) + first_line_no
    names = set(found.type.names) if hasattr(found.type, "names") else {
        found.type.field(i).name for i in range(found.type.num_fields)}
    for name in _INT_FIELDS:
        if name in names:
            cols[name] = pc.cast(found.field(name), pa.int64())
    for name in _FLOAT_FIELDS:
        if name in names:
            cols[name] = pc.cast(found.field(name), pa.float64())
    cols["cuda_graph"] = pc.equal(found.field("cuda_graph"), "True")
    cols["log_ts_ns"], cols["ts_resolution_ns"] = _timestamps(
        found.field("date"), found.field("hms"), found.field("ms"), clock)
    cols.update(_ranks(found.field("ranks")))
    return cols


def scan_chunk(chunk: bytes, first_line_no: int, clock: LogClock) -> ChunkResult:
    """Take the chunk's current-form batch lines; hand back the rest (numbered from the chunk)."""
    try:
        lines = _lines(chunk)
    except pa.ArrowInvalid:
        text_lines = chunk.decode("utf-8", errors="replace").split("\n")
        if text_lines and text_lines[-1] == "":
            text_lines.pop()
        return ChunkResult(n_lines=len(text_lines), leftovers=list(enumerate(text_lines)))
    result = ChunkResult(n_lines=len(lines))
    parts: list[dict[str, object]] = []
    remaining = np.arange(len(lines))
    for kind, pattern in (("decode", DECODE_PATTERN), ("prefill", PREFILL_PATTERN)):
        if not len(remaining):
            break
        subset = lines if len(remaining) == len(lines) else lines.take(pa.array(remaining))
        found = pc.extract_regex(subset, pattern)
        valid = found.is_valid().to_numpy(zero_copy_only=False)
        if valid.any():
            parts.append(_columns(found.filter(valid), remaining[valid], kind, first_line_no, clock))
            result.kinds[kind] = int(valid.sum())
        remaining = remaining[~valid]
    if len(remaining):
        rest = lines.take(pa.array(remaining))
        maybe = pc.match_substring_regex(rest, _MAYBE_SGLANG).to_numpy(zero_copy_only=False)
        result.n_rejected = int((~maybe).sum())
        result.leftovers = list(zip(remaining[maybe].tolist(), rest.filter(maybe).to_pylist(), strict=True))
    if parts:
        result.columns = _concat(parts)
        result.n_fast = sum(result.kinds.values())
    return result


def _concat(parts: list[dict[str, object]]) -> dict[str, pa.Array]:
    names = {name for part in parts for name in part}
    out: dict[str, pa.Array] = {}
    for name in names:
        arrays = []
        for part in parts:
            n_rows = len(part["line_no"])  # type: ignore[arg-type]
            value = part.get(name)
            if value is None:
                arrays.append(pa.nulls(n_rows))
            elif isinstance(value, np.ndarray):
                arrays.append(pa.array(value, from_pandas=True) if value.dtype.kind == "f"
                              else pa.array(value))
            else:
                arrays.append(value)
        typed = [a for a in arrays if a.type != pa.null()]
        target = typed[0].type if typed else pa.null()
        if pa.types.is_dictionary(target):
            arrays = [a.cast(pa.string()) for a in arrays]
            target = pa.string()
        out[name] = pa.concat_arrays([a.cast(target) for a in arrays])
    return out
