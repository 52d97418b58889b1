"""Vectorised reading of SGLang's current default batch lines, one chunk of a file at a time;
every other line is handed back for its grammar (gputrace.engines.sglang.grammar), which reads it
the same way.
"""

# A line is taken only when numpy has checked every byte of it against the exact current layout
# (``[date time(.mmm)( PPn ...)] Decode batch( [N])[,.] #running-req: N, ...``, speculative
# decoding's ``accept len``/``accept rate`` skipped, a container runtime's prefix stripped): fixed
# keys compared as 8-byte words, values checked digit by digit (SWAR), nothing left over at the
# end. Other versions, odd prefixes, startup lines and numbers too long for exact arithmetic go
# the per-line way; tests hold both paths to the same records. numpy releases the GIL: chunks scan
# in threads.

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pyarrow as pa

from gputrace.arrow_columns import from_numpy, strings
from gputrace.engines.common import ChunkResult, LogClock
from gputrace.engines.sglang.grammar import RANK_FIELDS, RANK_TAG

# A line without any of these cannot be an SGLang scheduler or configuration line.
MAYBE_SGLANG = re.compile(rb"batch|#running-req: |max_total_num_tokens=|server_args=(?:ServerArgs\(|\{)")
_RANK_TEXT = re.compile(r"(?: (?:DP|PP|ATTN_CP|MOE_DP|TP|EP)\d+)*")
# A container runtime's prefix in front of SGLang's ``[``: CRI (``<RFC3339> stdout F ``, as in
# /var/log/pods) or ``docker logs -t`` / ``kubectl logs --timestamps``. It matches a subset of
# what the per-line grammar strips (sglang._RUNTIME_PREFIX), so a line it strips reads the same.
_RUNTIME_LINE_PREFIX = re.compile(
    rb"(?m)^[ \t]*\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)?[ \t]+"
    rb"(?:(?:stdout|stderr)[ \t]+[FP][ \t]+)?(?=\[)")
_MAX_INT_DIGITS = 15  # exact in int64 (longer ones, never counts, go the per-line way)
_MAX_DEC_DIGITS = 15  # an exact integer mantissa in float64
_MAX_RANK_TEXT = 64
_GRAPH_LABELS = (b", cuda graph: ", b", cpu graph: ", b", npu graph: ", b", musa graph: ")
_GRAPH = "graph"
# Each form's fields in order: (SchedulerEvent field, key before the value, kind of value).
# Names starting with "_" are checked and cut, not kept (the per-line grammar ignores them too).
_DECODE_HEAD = (("running_req", b", #running-req: ", "int"),)
# The KV cache: one pool, or a hybrid model's full-attention pool (read as the usage) and its
# sliding-window or mamba pool.
_DECODE_USAGE = (
    (("num_token", b", #token: ", "int"), ("token_usage", b", token usage: ", "dec")),
    (("num_token", b", #full token: ", "int"), ("token_usage", b", full token usage: ", "dec"),
     ("_swa_token", b", #swa token: ", "int"), ("_swa_usage", b", swa token usage: ", "dec")),
)
_PREFILL_USAGE = (
    (("token_usage", b", token usage: ", "dec"),),
    (("token_usage", b", full token usage: ", "dec"), ("_swa_usage", b", swa token usage: ", "dec")),
    (("token_usage", b", full token usage: ", "dec"), ("_mamba_usage", b", mamba usage: ", "dec")),
)
# speculative decoding's fields between token usage and the graph flag (values not kept)
_SPECULATIVE = (b", accept len: ", b", accept rate: ")
_DECODE_TAIL = (  # after the graph flag, which decode lines before 2025-05 lack
    ("gen_throughput_tok_s", b", gen throughput (token/s): ", "dec"),
    ("queue_req", b", #queue-req: ", "int"),
)
_PREFILL_HEAD = (
    ("new_seq", b", #new-seq: ", "int"),
    ("new_token", b", #new-token: ", "int"),
    ("cached_token", b", #cached-token: ", "int"),
)
_PREFILL_QUEUES = (
    ("running_req", b", #running-req: ", "int"),
    ("queue_req", b", #queue-req: ", "int"),
)
_PREFILL_TAIL = (
    ("cuda_graph", _GRAPH, "bool"),
    ("input_throughput_tok_s", b", input throughput (token/s): ", "dec"),
)
_PENDING = b", #pending-token: "


class _Bytes:
    """A chunk as bytes, and as 8-byte words at every offset."""

    def __init__(self, chunk: bytes):
        self.size = len(chunk)
        padded = chunk + bytes(8)
        self.b = np.frombuffer(padded, dtype=np.uint8)
        # An unaligned little-endian uint64 starting at every byte: one compare checks 8 bytes.
        self.words = np.ndarray(shape=(self.size + 1,), dtype="<u8", buffer=padded, strides=(1,))

    def at(self, pos: np.ndarray) -> np.ndarray:
        found: np.ndarray = self.b[np.minimum(pos, self.size)]
        return found

    def has(self, pos: np.ndarray, key: bytes) -> np.ndarray:
        """Whether ``key`` is written at each position."""
        ok = np.ones(len(pos), dtype=bool)
        for i in range(0, len(key), 8):
            word = key[i:i + 8]
            mask = np.uint64((1 << (8 * len(word))) - 1)
            expected = np.uint64(int.from_bytes(word, "little"))
            ok &= (self.words[np.minimum(pos + i, self.size)] & mask) == expected
        return ok

    def next_closer(self, start: np.ndarray, within: int) -> np.ndarray:
        """The first ``]`` at or after each position, looked for in the next ``within`` bytes and
        a few more (the chunk's size where there is none): 8 bytes a step, each step on the rows
        still looking. Finding every ``]`` of the chunk first cost a fifth of the scan."""
        found = np.full(len(start), self.size, dtype=np.int64)
        rows = np.arange(len(start))
        pos = start
        for offset in range(0, within + 1, 8):
            x = self.words[np.minimum(pos + offset, self.size)] ^ _CLOSERS
            with np.errstate(over="ignore"):
                index = _first_flagged_byte((x - _ONES) & ~x & _HIGH)  # exact for the lowest zero byte
            hit = index < 8
            found[rows[hit]] = pos[hit] + offset + index[hit]
            rows, pos = rows[~hit], pos[~hit]
            if not len(rows):
                break
        return found

    def digit_run(self, pos: np.ndarray) -> np.ndarray:
        """How many ASCII digits follow each position (16 means 16 or more)."""
        run = _first_flagged_byte(self._non_digits(pos))
        longer = np.flatnonzero(run == 8)
        if len(longer):  # rare: only these rows need the next 8 bytes
            run[longer] = 8 + _first_flagged_byte(self._non_digits(pos[longer] + 8))
        return run

    def digits(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``digit_run`` and the value of the first (up to 15) of those digits, from one gather of
        8 bytes where there are fewer than 8 (gathering them twice cost a tenth of the scan)."""
        x = self.words[np.minimum(pos, self.size)] ^ _ZEROS
        run = _first_flagged_byte((((x & _LOW7) + _DIGIT_CARRY) | x) & _HIGH)
        value = _digits_value(x, run)
        longer = np.flatnonzero(run == 8)
        if len(longer):  # rare: only these rows need the next 8 bytes
            run[longer] = 8 + _first_flagged_byte(self._non_digits(pos[longer] + 8))
            value[longer] = self.number(pos[longer], np.minimum(run[longer], 15))
        return run, value

    def _non_digits(self, pos: np.ndarray) -> np.ndarray:
        """The high bit of each of the 8 bytes at ``pos`` set where that byte is not a digit."""
        x = self.words[np.minimum(pos, self.size)] ^ _ZEROS
        flags: np.ndarray = (((x & _LOW7) + _DIGIT_CARRY) | x) & _HIGH
        return flags

    def number(self, pos: np.ndarray, length: np.ndarray) -> np.ndarray:
        """The value of the ``length`` (0 to 16) digits at each position."""
        value = self._eight_digits(pos, np.minimum(length, 8))
        longer = np.flatnonzero(length > 8)
        if len(longer):  # rare: the first length-8 digits, then the last 8
            high_len = length[longer] - 8
            value[longer] = (self._eight_digits(pos[longer], high_len) * 100_000_000
                             + self._eight_digits(pos[longer] + high_len, np.full(len(longer), 8)))
        return value

    def _eight_digits(self, pos: np.ndarray, length: np.ndarray) -> np.ndarray:
        """The value of the ``length`` (0 to 8) digits at each position."""
        return _digits_value(self.words[np.minimum(pos, self.size)] ^ _ZEROS, length)


def _digits_value(x: np.ndarray, length: np.ndarray) -> np.ndarray:
    """The value of the first ``length`` (0 to 8) bytes of each word, digits XOR "0" (byte values
    0-9), all at once: left-pad with zero digits, then combine pairs, quads, octets."""
    x = x & _KEEP_BYTES[length]
    x = np.where(length > 0, x << (np.uint64(8) * (np.uint64(8) - length.astype(np.uint64))), _U0)
    with np.errstate(over="ignore"):
        x = ((x & np.uint64(0x0F0F0F0F0F0F0F0F)) * np.uint64(2561)) >> np.uint64(8)
        x = ((x & np.uint64(0x00FF00FF00FF00FF)) * np.uint64(6553601)) >> np.uint64(16)
        x = ((x & np.uint64(0x0000FFFF0000FFFF)) * np.uint64(42949672960001)) >> np.uint64(32)
    return x.astype(np.int64)


def _first_flagged_byte(bits: np.ndarray) -> np.ndarray:
    """Index (0-7) of the lowest byte whose high bit is set; 8 when none is."""
    lowest = (bits & (~bits + np.uint64(1))) >> np.uint64(7)  # 1 << 8k for the lowest flagged byte k
    with np.errstate(over="ignore"):
        # Multiplying by 1 << 8k shifts this constant k bytes up; its top byte is then k.
        index = (lowest * np.uint64(0x0001020304050607)) >> np.uint64(56)
    return np.where(bits == 0, 8, index.astype(np.int64))


_U0 = np.uint64(0)
_ZEROS = np.uint64(0x3030303030303030)  # "00000000": XOR turns digits into their values
_LOW7 = np.uint64(0x7F7F7F7F7F7F7F7F)
_DIGIT_CARRY = np.uint64(0x7676767676767676)  # a byte value above 9 reaches its high bit
_HIGH = np.uint64(0x8080808080808080)
_ONES = np.uint64(0x0101010101010101)
_CLOSERS = np.uint64(0x5D5D5D5D5D5D5D5D)  # "]]]]]]]]": XOR leaves a zero byte where one was
_KEEP_BYTES = np.array([(1 << (8 * k)) - 1 for k in range(8)] + [(1 << 64) - 1], dtype=np.uint64)


def _int_field(raw: _Bytes, start: np.ndarray, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An unsigned integer at ``start``: its value and where it ends; clears ``ok`` if absent or too long."""
    length, value = raw.digits(start)
    ok &= (length >= 1) & (length <= _MAX_INT_DIGITS)
    return value, start + length


def _decimal_field(raw: _Bytes, start: np.ndarray, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``123.45`` -> 12345 / 10**2, the correctly rounded double (as float("123.45") is)."""
    whole_len, whole = raw.digits(start)
    dot = start + whole_len
    frac_len, frac = raw.digits(dot + 1)
    ok &= (whole_len >= 1) & (raw.at(dot) == ord(".")) & (frac_len >= 1)
    ok &= whole_len + frac_len <= _MAX_DEC_DIGITS
    frac_len = np.minimum(frac_len, 15)
    mantissa = whole * 10**frac_len + frac
    value: np.ndarray = mantissa / (10.0**frac_len)
    return value, dot + 1 + frac_len


def _fields(raw: _Bytes, pos: np.ndarray, ok: np.ndarray,
            layout: tuple[tuple[str, bytes | str, str], ...], cols: dict[str, np.ndarray],
            loose_first: np.ndarray | None = None) -> np.ndarray:
    """Check and cut the fields of ``layout`` from ``pos``; clears ``ok`` for rows that differ.
    Rows in ``loose_first`` have ``.`` for the first key's ``,``. Returns the position after the
    last value."""
    for i, (name, key, kind) in enumerate(layout):
        if kind == "bool":
            cols[name], pos = _graph_field(raw, pos, ok)
            continue
        assert isinstance(key, bytes)
        if i == 0 and loose_first is not None and loose_first.any():
            ok &= np.where(loose_first, raw.has(pos + 1, key[1:]), raw.has(pos, key))
        else:
            ok &= raw.has(pos, key)
        start = pos + len(key)
        # The value ends at its first non-digit; the next key (or the line's end) is checked there.
        cols[name], pos = (_int_field if kind == "int" else _decimal_field)(raw, start, ok)
    return pos


def _one_of(raw: _Bytes, pos: np.ndarray, ok: np.ndarray,
            layouts: tuple[tuple[tuple[str, bytes | str, str], ...], ...],
            cols: dict[str, np.ndarray]) -> np.ndarray:
    """Each row reads as the first of ``layouts`` that fits it (the first is the usual form, read
    on every row; only rows it does not fit try the others); clears ``ok`` for rows none fits."""
    first, *others = layouts
    done = np.ones(len(pos), dtype=bool)
    got: dict[str, np.ndarray] = {}
    end = _fields(raw, pos, done, first, got)
    cols.update((name, values) for name, values in got.items() if not name.startswith("_"))
    rest = np.flatnonzero(~done)
    for layout in others:
        if not len(rest):
            break
        rows = rest[raw.has(pos[rest], layout[0][1])]  # type: ignore[arg-type]  # keys are bytes
        if not len(rows):
            continue
        fits = np.ones(len(rows), dtype=bool)
        got = {}
        layout_end = _fields(raw, pos[rows], fits, layout, got)
        good = rows[fits]
        done[good] = True
        end[good] = layout_end[fits]
        for name, values in got.items():
            if not name.startswith("_"):
                cols[name][good] = values[fits]
        rest = np.flatnonzero(~done)
    ok &= done
    return end


def _skip_optional(raw: _Bytes, pos: np.ndarray, ok: np.ndarray, key: bytes,
                   read: Callable[[_Bytes, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]
                   ) -> np.ndarray:
    """Past ``key`` and its value on the rows that have them (the value is checked, not kept; only
    those rows pay for reading it); clears ``ok`` where the value is not one ``read`` takes."""
    here = np.flatnonzero(raw.has(pos, key))
    if not len(here):
        return pos
    value_ok = np.ones(len(here), dtype=bool)
    _, end = read(raw, pos[here] + len(key), value_ok)
    ok[here] &= value_ok
    pos = pos.copy()
    pos[here] = end
    return pos


def _graph_field(raw: _Bytes, pos: np.ndarray, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``, cuda graph: True`` (or cpu/npu/musa): the flag and where it ends."""
    start = pos + len(_GRAPH_LABELS[0])
    others = np.flatnonzero(~raw.has(pos, _GRAPH_LABELS[0]))
    labelled = np.ones(len(pos), dtype=bool)
    if len(others):  # only rows that are not "cuda" need the other labels tried
        other_pos = pos[others]
        other_start = np.zeros(len(others), dtype=np.int64)
        found = np.zeros(len(others), dtype=bool)
        for label in _GRAPH_LABELS[1:]:
            here = ~found & raw.has(other_pos, label)
            other_start = np.where(here, other_pos + len(label), other_start)
            found |= here
        start[others] = other_start
        labelled[others] = found
    word = raw.words[np.minimum(start, raw.size)]
    is_true = (word & _KEEP_BYTES[4]) == _TRUE
    is_false = (word & _KEEP_BYTES[5]) == _FALSE
    ok &= labelled & (is_true | is_false)
    return is_true, start + np.where(is_true, 4, 5)


_TRUE = np.uint64(int.from_bytes(b"True", "little"))
_FALSE = np.uint64(int.from_bytes(b"False", "little"))


def _line_ends_cleanly(raw: _Bytes, pos: np.ndarray, line_end: np.ndarray) -> np.ndarray:
    """Nothing after the last value but an optional ``, `` (SGLang's trailing separator)."""
    clean: np.ndarray = (pos == line_end) | ((pos + 2 == line_end) & raw.has(pos, b", "))
    return clean


def _timestamps(raw: _Bytes, start: np.ndarray, clock: LogClock) -> tuple[np.ndarray, ...]:
    """(ok, log time ns, time known, resolution ns, where the rank text starts) per row.

    Consecutive lines mostly share their second, so the 19 bytes of ``YYYY-MM-DD hh:mm:ss`` are
    compared as words with the line before, and each run of equal stamps is checked and
    converted once (through the clock: timezone, impossible dates)."""
    n_rows = len(start)
    keys = [raw.words[np.minimum(start + offset, raw.size)] for offset in (1, 9)]
    keys.append(raw.words[np.minimum(start + 17, raw.size)] & np.uint64(0xFFFFFF))
    new_run = np.zeros(n_rows, dtype=bool)
    new_run[:1] = True
    for key in keys:
        new_run[1:] |= key[1:] != key[:-1]
    run_starts = np.flatnonzero(new_run)
    run_of_row = np.cumsum(new_run) - 1
    run_ok = np.zeros(len(run_starts), dtype=bool)
    run_ns = np.zeros(len(run_starts), dtype=np.int64)
    run_known = np.zeros(len(run_starts), dtype=bool)
    chunk = raw.b
    cache: dict[bytes, int | None] = {}
    for i, begin in enumerate(start[run_starts].tolist()):
        text = chunk[begin + 1:begin + 20].tobytes()
        if not _STAMP.fullmatch(text):
            continue
        run_ok[i] = True
        if text not in cache:
            stamp = text.decode("ascii")
            cache[text] = clock.to_ns(stamp[:10], stamp[11:], None)[0]
        value = cache[text]
        if value is not None:
            run_ns[i], run_known[i] = value, True
    ok = run_ok[run_of_row] & (raw.at(start) == ord("["))
    ts_ns, known = run_ns[run_of_row], run_known[run_of_row]
    has_ms = raw.at(start + 20) == ord(".")
    ms_len = raw.digit_run(start + 21)
    millis = raw.number(start + 21, np.minimum(ms_len, 3))
    ok &= ~has_ms | (ms_len == 3)
    ts_ns = ts_ns + np.where(has_ms, millis * 1_000_000, 0)
    resolution = np.where(has_ms, 1_000_000, 1_000_000_000).astype(np.int64)
    return ok, ts_ns, known, resolution, start + np.where(has_ms, 24, 20)


_STAMP = re.compile(rb"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


def _ranks(raw: _Bytes, start: np.ndarray, end: np.ndarray, ok: np.ndarray) -> dict[str, np.ndarray]:
    """Rank columns (-1 where absent) from the rank text in [start, end), e.g. `` DP0 PP3``;
    distinct texts are checked and parsed once; rows with anything else clear ``ok``."""
    width = np.maximum(end - start, 0)
    ok &= width <= _MAX_RANK_TEXT
    # Texts of up to 7 bytes are keyed by one word (their bytes, their length in the top byte);
    # longer ones by their bytes as a fixed-width string.
    short = width <= 7
    word = raw.words[np.minimum(start, raw.size)] & _KEEP_BYTES[np.minimum(width, 7)]
    short_keys = word | (np.minimum(width, 7).astype(np.uint64) << np.uint64(56))
    texts: list[str] = []
    inverse = np.zeros(len(start), dtype=np.int64)
    unique, short_inverse = np.unique(short_keys[short], return_inverse=True)
    inverse[short] = short_inverse
    for key in unique.tolist():
        length = key >> 56
        texts.append((key & ((1 << 56) - 1)).to_bytes(8, "little")[:length].decode("latin-1"))
    long_rows = np.flatnonzero(~short & ok)
    if len(long_rows):
        long_width = int(width[long_rows].max())
        idx = start[long_rows, None] + np.arange(long_width)[None, :]
        grid = np.where(idx < end[long_rows, None], raw.b[np.minimum(idx, raw.size)], 0).astype(np.uint8)
        long_keys = np.ascontiguousarray(grid).view(f"S{long_width}").ravel()
        long_unique, long_inverse = np.unique(long_keys, return_inverse=True)
        inverse[long_rows] = long_inverse + len(texts)
        texts += [key.decode("latin-1") for key in long_unique.tolist()]
    valid = np.ones(len(texts) + 1, dtype=bool)
    valid[-1] = False  # long texts beyond the limit
    inverse[~short & ~ok] = len(texts)
    tables = {name: np.full(len(texts) + 1, -1, dtype=np.int64) for name in RANK_FIELDS.values()}
    for i, text in enumerate(texts):
        if not _RANK_TEXT.fullmatch(text):
            valid[i] = False
            continue
        for label, number in RANK_TAG.findall(text):
            name = RANK_FIELDS.get(label)
            if name is not None and tables[name][i] < 0:
                tables[name][i] = int(number)
    ok &= valid[inverse]
    return {name: table[inverse] for name, table in tables.items()}


def _form(raw: _Bytes, kind: str, closer: np.ndarray, line_end: np.ndarray,
          ok: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Check and cut one form's words and fields after the prefix's closing bracket: the values,
    and for fields a row may lack, where they were there."""
    words = b"] Decode batch" if kind == "decode" else b"] Prefill batch"
    ok &= raw.has(closer, words)
    after = closer + len(words)
    # ``Decode batch [N],`` (SGLANG_LOG_FORWARD_ITERS=1): the iteration number in brackets.
    has_iter = raw.at(after) == ord(" ")
    iter_ok = np.ones(len(after), dtype=bool)
    _, iter_end = _int_field(raw, after + 2, iter_ok)
    ok &= ~has_iter | ((raw.at(after + 1) == ord("[")) & iter_ok & (raw.at(iter_end) == ord("]")))
    pos = np.where(has_iter, iter_end + 1, after)
    cols: dict[str, np.ndarray] = {}
    present: dict[str, np.ndarray] = {}
    # ``Decode batch. #running-req``: a period before the first field (2024-06 to 2025-10)
    period = raw.at(pos) == ord(".")
    if kind == "decode":
        pos = _fields(raw, pos, ok, _DECODE_HEAD, cols, loose_first=period)
        pos = _one_of(raw, pos, ok, _DECODE_USAGE, cols)
        for key in _SPECULATIVE if (raw.at(pos + 2) == ord("a")).any() else ():
            pos = _skip_optional(raw, pos, ok, key, _decimal_field)
        # the graph flag came in 2025-05: before, the throughput follows (one word compared on the
        # rows without a flag; the whole key is checked below)
        graph_ok = np.ones(len(pos), dtype=bool)
        cols["cuda_graph"], graph_end = _graph_field(raw, pos, graph_ok)
        has_graph = np.ones(len(pos), dtype=bool)
        flagless = np.flatnonzero(~graph_ok)
        if len(flagless):
            has_graph[flagless[raw.has(pos[flagless], b", gen th")]] = False
        ok &= ~has_graph | graph_ok
        pos = np.where(has_graph, graph_end, pos)
        present["cuda_graph"] = has_graph
        pos = _fields(raw, pos, ok, _DECODE_TAIL, cols)
    else:
        pos = _fields(raw, pos, ok, _PREFILL_HEAD, cols, loose_first=period)
        pos = _one_of(raw, pos, ok, _PREFILL_USAGE, cols)
        pos = _fields(raw, pos, ok, _PREFILL_QUEUES, cols)
        pos = _skip_optional(raw, pos, ok, _PENDING, _int_field)
        # before 2026 a prefill line could end here, without the graph flag and input throughput
        has_tail = ~_line_ends_cleanly(raw, pos, line_end)
        tail_ok = np.ones(len(pos), dtype=bool)
        tail_end = _fields(raw, pos, tail_ok, _PREFILL_TAIL, cols)
        ok &= ~has_tail | tail_ok
        pos = np.where(has_tail, tail_end, pos)
        present = {name: has_tail for name, _, _ in _PREFILL_TAIL}
    ok &= _line_ends_cleanly(raw, pos, line_end)
    return cols, present


def scan_chunk(chunk: bytes, first_line_no: int, clock: LogClock,
               maybe: re.Pattern[bytes] | None = MAYBE_SGLANG) -> ChunkResult:
    """Take the chunk's current-form batch lines; hand back the rest (numbered from the chunk):
    those ``maybe`` finds something in (lines a grammar may read; the others are counted as
    rejected), or all when it is None."""
    original = chunk
    if chunk[:1] != b"[" and _RUNTIME_LINE_PREFIX.match(chunk):  # a container's log: strip them all
        chunk = _RUNTIME_LINE_PREFIX.sub(b"", chunk)
    raw = _Bytes(chunk)
    newlines = np.flatnonzero(raw.b[: raw.size] == ord("\n"))
    line_end = newlines if chunk.endswith(b"\n") else np.append(newlines, raw.size)
    starts = np.concatenate(([0], newlines + 1))[: len(line_end)]
    # where each line lies in the chunk as given (lines handed back are the lines as given)
    src_starts, src_ends = starts, line_end
    if chunk is not original:
        src_newlines = np.flatnonzero(np.frombuffer(original, dtype=np.uint8) == ord("\n"))
        src_ends = src_newlines if original.endswith(b"\n") else np.append(src_newlines, len(original))
        src_starts = np.concatenate(([0], src_newlines + 1))[: len(src_ends)]
    result = ChunkResult(n_lines=len(line_end))
    # only the lines with text are scanned: a blank one is no SGLang line, and one by one they cost
    # most of the time on a file of newlines
    lines = np.flatnonzero(src_ends > src_starts) if maybe is not None else np.arange(len(line_end))
    result.n_rejected = len(line_end) - len(lines)
    starts, line_end = starts[lines], line_end[lines]
    src_starts, src_ends = src_starts[lines], src_ends[lines]
    ok, ts_ns, ts_known, resolution, rank_start = _timestamps(raw, starts, clock)
    closer = raw.next_closer(rank_start, _MAX_RANK_TEXT)  # further on, the rank text is too long
    ok &= closer < line_end
    ranks = _ranks(raw, rank_start, closer, ok)
    after = raw.at(closer + 2)
    n_lines = len(starts)
    taken = np.zeros(n_lines, dtype=bool)
    is_decode = np.zeros(n_lines, dtype=bool)
    values: dict[str, np.ndarray] = {name: np.zeros(n_lines, dtype=t) for name, t in _COLUMN_TYPES.items()}
    present = {name: np.zeros(n_lines, dtype=bool) for name in _COLUMN_TYPES}
    for kind, first_letter in (("decode", ord("D")), ("prefill", ord("P"))):
        rows = np.flatnonzero(ok & (after == first_letter))
        if not len(rows):
            continue
        row_ok = np.ones(len(rows), dtype=bool)
        form_values, form_present = _form(raw, kind, closer[rows], line_end[rows], row_ok)
        good = rows[row_ok]
        taken[good] = True
        is_decode[good] = kind == "decode"
        for name, column in form_values.items():
            values[name][good] = column[row_ok]
            present[name][good] = form_present[name][row_ok] if name in form_present else True
        result.kinds[kind] = len(good)
    rest = np.flatnonzero(~taken)
    # as Python ints at once: numpy scalars one by one cost as much as the search
    for line_no, begin, end in zip(lines[rest].tolist(), src_starts[rest].tolist(), src_ends[rest].tolist(),
                                   strict=True):
        if maybe is None or maybe.search(original, begin, end):
            result.leftovers.append((line_no, original[begin:end].decode("utf-8", errors="replace")))
        else:
            result.n_rejected += 1
    rows = np.flatnonzero(taken)
    result.n_fast = len(rows)
    # each fast row's "[" in the chunk as given: as far before its line's end as in the chunk read
    result.line_starts = src_ends[rows] - (line_end[rows] - starts[rows])
    # Every chunk yields the same columns and types, so chunks join without copying.
    cols: dict[str, pa.Array] = {
        "line_no": from_numpy(lines[rows] + first_line_no),
        "kind": pa.DictionaryArray.from_arrays(from_numpy(np.where(is_decode[rows], 0, 1).astype(np.int32)),
                                               _KIND_NAMES),
        "log_ts_ns": from_numpy(ts_ns[rows], mask=~ts_known[rows]),
        "ts_resolution_ns": from_numpy(resolution[rows]),
    }
    for name, table in ranks.items():
        cols[name] = from_numpy(table[rows], mask=table[rows] < 0)
    for name in _COLUMN_TYPES:
        cols[name] = from_numpy(values[name][rows], mask=~present[name][rows])
    result.columns = cols
    return result


_KIND_NAMES = strings(["decode", "prefill"])  # the kind column's dictionary, one for every chunk
_COLUMN_TYPES: dict[str, type] = {
    "running_req": np.int64, "queue_req": np.int64, "new_seq": np.int64, "new_token": np.int64,
    "cached_token": np.int64, "num_token": np.int64, "token_usage": np.float64,
    "gen_throughput_tok_s": np.float64, "input_throughput_tok_s": np.float64, "cuda_graph": np.bool_,
}
