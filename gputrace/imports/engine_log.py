"""Ingest an engine log file (plain or .gz) into a run store, in columnar batches: SGLang's
current form through its fast path (gputrace.engines.sglang.fastpath), every other line through the
per-line grammar.
"""

from __future__ import annotations

import datetime as dt
import gzip
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import IO

import pyarrow as pa

from gputrace.arrow_columns import from_numpy, numbers
from gputrace.engines import KINDS, LogParser, fast_path_engine
from gputrace.engines.common import (
    METRIC_FIELDS,
    RANK_FIELDS,
    ChunkResult,
    LogClock,
    ParsedLine,
    join_chunks,
)
from gputrace.imports.log_files import CHUNK_BYTES, GzipLog, chunk_lines, open_log, read_chunks
from gputrace.imports.report import ImportReport, StoredLines, write_rows
from gputrace.logsetup import get_logger
from gputrace.model import EngineConfig
from gputrace.store import ROW_GROUP_ROWS, Store

log = get_logger("import")

_WORKERS = min(4, os.cpu_count() or 1)
_EVENT_INT_COLUMNS = ("line_no", "log_ts_ns", "ts_resolution_ns", *RANK_FIELDS)


def _reporting(chunks: Iterator[bytes], raw: IO[bytes], on_progress: Callable[[int], None]
               ) -> Iterator[bytes]:
    """The chunks, calling ``on_progress`` with the file's position after each."""
    for chunk in chunks:
        yield chunk
        on_progress(raw.tell())


class _EventColumns:
    """SchedulerEvent rows gathered as columns, for store.append_columns."""

    def __init__(self) -> None:
        self.cols: dict[str, list[object]] = {
            name: [] for name in ("kind", *_EVENT_INT_COLUMNS, *METRIC_FIELDS, "recv_ts_ns")
        }

    def __len__(self) -> int:
        return len(self.cols["kind"])

    def add(self, parsed: ParsedLine, line_no: int) -> None:
        cols = self.cols
        cols["kind"].append(parsed.kind)
        cols["line_no"].append(line_no)
        cols["log_ts_ns"].append(parsed.log_ts_ns)
        cols["ts_resolution_ns"].append(parsed.ts_resolution_ns)
        cols["recv_ts_ns"].append(None)
        for name in RANK_FIELDS:
            cols[name].append(getattr(parsed, name))
        values = parsed.values
        for name in METRIC_FIELDS:
            cols[name].append(values.get(name))

    def flush(self, store: Store, report: ImportReport, host: str, source: str, engine: str,
              stored_lines: StoredLines | None = None) -> int:
        n_rows = len(self)
        if not n_rows:
            return 0
        columns: dict[str, object] = dict(self.cols)
        columns.update(host=[host] * n_rows, source=[source] * n_rows, engine=[engine] * n_rows)
        written = write_rows(store, report, "scheduler_events", columns, stored_lines=stored_lines)
        for values in self.cols.values():
            values.clear()
        return written


def ingest_log(
    store: Store,
    path: str | os.PathLike[str],
    host: str,
    engine: str = "sglang",
    source: str | None = None,
    tz: str = "UTC",
    date: dt.date | str | None = None,
    *,
    year_until: Callable[[], dt.date] | None = None,
    fast: bool = True,
    batch_rows: int = 2 * ROW_GROUP_ROWS,
    chunk_bytes: int = CHUNK_BYTES,
    on_progress: Callable[[int], None] | None = None,
    on_bytes: Callable[[memoryview], None] | None = None,
    stored_lines: StoredLines | None = None,
) -> ImportReport:
    """Parse a whole log file and append its events and configuration lines to ``store``.

    ``source`` names the log in the store (default: the file's path); ``year_until`` dates stamps
    without a year (vLLM's) by the day the log was written up to. ``fast=False`` forces the
    per-line grammar for every line (the fast path's reference). Rows are appended about
    ``batch_rows`` at a time, fast-path rows in whole row groups of the store (each append is one
    committed transaction, so a failure leaves every earlier batch readable); two groups a batch
    let the database write on two threads while the next batch is parsed. ``on_progress`` is
    called with the bytes of the file read so far (compressed bytes for a .gz), chunk by chunk;
    ``on_bytes`` with each block of the file as read (the import ledger hashes it).
    ``stored_lines``: the lines of this log (by number) the run holds already, not written again
    (counted in the report's ``present``).
    """
    source = source or str(path)
    parser = LogParser(host=host, source=source, engine=engine, tz=tz, date=date, year_until=year_until)
    stats = ImportReport(str(path), f"{engine} log", source=source,
                         written={"scheduler_events": 0, "engine_configs": 0})
    events = _EventColumns()
    configs: list[EngineConfig] = []
    with open_log(path, on_bytes) as stream:
        chunks = read_chunks(stream, chunk_bytes, on_cut=stats.count_cut_line)
        if on_progress is not None:
            raw: IO[bytes] = stream.fileobj if isinstance(stream, gzip.GzipFile) else stream
            chunks = _reporting(chunks, raw, on_progress)
        fast_engine = fast_path_engine(engine) if fast else None
        if fast_engine is not None and fast_engine.fast_path is not None:
            fast_path, maybe = fast_engine.fast_path, fast_engine.maybe_line

            def scan(chunk: bytes, first_line_no: int, clock: LogClock) -> ChunkResult:
                return fast_path(chunk, first_line_no, clock, maybe)

            _ingest_fast(store, parser, chunks, events, configs, stats, batch_rows, stored_lines, scan)
        else:
            for chunk in chunks:
                blank = 0  # no grammar reads a blank line: counted here, not parsed one by one
                for line in chunk_lines(chunk):
                    if line:
                        _one_line(parser, line, events, configs)
                    else:
                        parser.next_line_no += 1
                        blank += 1
                parser.counts.lines += blank
                parser.counts.unrecognised += blank
                if len(events) >= batch_rows:
                    events.flush(store, stats, host, source, engine, stored_lines)
    events.flush(store, stats, host, source, engine, stored_lines)
    write_rows(store, stats, "engine_configs", configs, stored_lines=stored_lines)
    counts = parser.counts
    stats.lines = counts.lines
    stats.recognised = {k: counts.recognised.get(k, 0) for k in KINDS}
    stats.unrecognised = counts.unrecognised
    stats.bad_values, stats.first_bad_value = counts.bad_values, counts.first_bad_value
    if isinstance(stream, GzipLog) and stream.cut is not None:
        stats.cut = f"{stream.cut}: its {counts.lines} lines before that were read, the rest is lost"
        log.warning("log file cut", file=str(path), cut=stats.cut)
    return stats


def _ingest_fast(
    store: Store,
    parser: LogParser,
    chunks: Iterator[bytes],
    events: _EventColumns,
    configs: list[EngineConfig],
    stats: ImportReport,
    batch_rows: int,
    stored_lines: StoredLines | None,
    scan: Callable[[bytes, int, LogClock], ChunkResult],
) -> None:
    """Scan chunks (``scan``: the engine's fast path) in worker threads while one writer thread
    appends the previous batch, so parsing and the database's work overlap; one append in flight
    at a time keeps the order. Fast rows are appended in whole row groups (the rest waits for the
    next batch); the writer thread counts them into ``stats`` (one job at a time, so no count is
    written twice at once)."""
    pending: list[dict[str, pa.Array]] = []
    pending_rows = 0
    quantum = ROW_GROUP_ROWS
    with ThreadPoolExecutor(max_workers=1) as writer:
        in_flight: Future[int] | None = None

        def write(job: Callable[[], int]) -> None:
            nonlocal in_flight
            if in_flight is not None:
                in_flight.result()
            in_flight = writer.submit(job)

        for chunk_result in _scan_in_threads(chunks, parser.clock, scan):
            _take_chunk(parser, chunk_result, events, configs, stats, pending)
            pending_rows += chunk_result.n_fast
            if pending_rows >= max(batch_rows, quantum):
                n_write = pending_rows - pending_rows % quantum
                head, tail = _split_rows(pending, n_write)
                write(partial(_flush_fast, store, stats, head, parser, stored_lines))
                pending = tail
                pending_rows -= n_write
            if len(events) >= batch_rows:
                write(partial(events.flush, store, stats, parser.host, parser.source, parser.engine,
                              stored_lines))
                if in_flight is not None:  # the per-line rows' buffer is reused: wait for it
                    in_flight.result()
                    in_flight = None
        write(partial(_flush_fast, store, stats, list(pending), parser, stored_lines))
        if in_flight is not None:
            in_flight.result()


def _scan_in_threads(chunks: Iterator[bytes], clock: LogClock,
                     scan: Callable[[bytes, int, LogClock], ChunkResult]) -> Iterator[ChunkResult]:
    """Scan chunks in worker threads (numpy releases the GIL), yielding results in file order.

    Line numbers are not known until earlier chunks are counted, so chunks are scanned with
    offsets from 0 and renumbered by the caller.
    """
    window: deque[Future[ChunkResult]] = deque()
    with ThreadPoolExecutor(max_workers=_WORKERS) as pool:
        for chunk in chunks:
            window.append(pool.submit(scan, chunk, 0, clock))
            if len(window) > 2 * _WORKERS:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()


def _split_rows(pending: list[dict[str, pa.Array]], n_rows: int) -> tuple[list[dict[str, pa.Array]],
                                                                       list[dict[str, pa.Array]]]:
    """The first ``n_rows`` queued rows and the rest, as slices (no copy: copying the rest, up to a
    row group, each batch cost more CPU than the scan of a chunk)."""
    head: list[dict[str, pa.Array]] = []
    taken = 0
    tail_parts: list[dict[str, pa.Array]] = []
    for part in pending:
        size = len(part["line_no"])
        if taken >= n_rows:
            tail_parts.append(part)
        elif taken + size <= n_rows:
            head.append(part)
        else:
            cut = n_rows - taken
            head.append({name: column.slice(0, cut) for name, column in part.items()})
            tail_parts.append({name: column.slice(cut) for name, column in part.items()})
        taken += size
    return head, tail_parts


def _flush_fast(store: Store, report: ImportReport, pending: list[dict[str, pa.Array]],
                parser: LogParser, stored_lines: StoredLines | None = None) -> int:
    """Append queued fast-path rows as one batch (DuckDB writes big batches far faster)."""
    if not pending:
        return 0
    # One contiguous array per column, and the constant columns as scalars, insert fastest
    # (measured: about 1.5x against per-chunk pieces and per-row strings).
    columns: dict[str, object] = {
        name: chunks.combine_chunks() for name, chunks in join_chunks(pending).items()}
    columns.update(host=parser.host, source=parser.source, engine=parser.engine)
    return write_rows(store, report, "scheduler_events", columns, stored_lines=stored_lines)


def _take_chunk(
    parser: LogParser,
    result: ChunkResult,
    events: _EventColumns,
    configs: list[EngineConfig],
    stats: ImportReport,
    pending: list[dict[str, pa.Array]],
) -> None:
    """Queue a scanned chunk's fast rows, parse its leftovers, and count everything."""
    first = parser.next_line_no
    if result.n_fast:
        columns: dict[str, pa.Array] = dict(result.columns)
        columns["line_no"] = from_numpy(numbers(result.columns["line_no"]) + first)
        pending.append(columns)
        stats.fast_path_lines += result.n_fast
        for kind, count in result.kinds.items():
            parser.counts.recognised[kind] += count
    parser.counts.lines += result.n_fast + result.n_rejected
    parser.counts.unrecognised += result.n_rejected
    for offset, line in result.leftovers:
        parser.next_line_no = first + offset
        _one_line(parser, line, events, configs)
    parser.next_line_no = first + result.n_lines


def _one_line(parser: LogParser, line: str, events: _EventColumns, configs: list[EngineConfig]) -> None:
    line_no = parser.next_line_no
    parsed = parser.parse(line)
    if parsed is None:
        return
    if parsed.kind == "config":
        record = parsed.to_record(host=parser.host, source=parser.source, line_no=line_no)
        assert isinstance(record, EngineConfig)
        configs.append(record)
    else:
        events.add(parsed, line_no)


def default_source(path: str | os.PathLike[str]) -> str:
    """The name a log file gets in the store when none is given: its resolved path."""
    return str(Path(path).resolve())
