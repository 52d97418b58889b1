"""What every importer returns (one ImportReport) and the one way it writes into the store
(``write_rows``): rows written are counted per table, a row no column can hold is a bad row."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from gputrace.engines.common import MAX_LINE_BYTES
from gputrace.errors import ConfigError
from gputrace.logsetup import get_logger
from gputrace.model import RECORD_TABLES, GpuSample, Marker, RequestRecord
from gputrace.store import Column, Store

log = get_logger("import")

Record = RequestRecord | Marker | GpuSample
"""What the file importers parse into records (engine logs and Prometheus go in as columns)."""
MAX_PROBLEMS = 5
_INT64_MAX = 2**63 - 1


@dataclass
class ImportReport:
    """One import: what it read, what it wrote per table, what it skipped and why (the first few).

    A parser fills ``records``; ``write_parsed`` moves them into the store. An engine log also counts
    its lines; a Prometheus import its queries, windows, GPUs, ranks and the series it found.
    """

    path: str  # the file, or the Prometheus URL
    kind: str  # "aiperf", "nvidia-smi-csv", "sglang log", "prometheus", ...
    written: dict[str, int] = field(default_factory=dict)  # table -> rows
    present: dict[str, int] = field(default_factory=dict)  # table -> rows the run held already
    bad: int = 0
    problems: list[str] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)  # parsed, not yet in the store
    ended_before_start: int = 0  # requests whose end precedes their start: dropped, not stored
    # -- engine logs
    source: str = ""  # the log's name in the store
    lines: int = 0
    recognised: dict[str, int] = field(default_factory=dict)  # per line kind
    unrecognised: int = 0
    fast_path_lines: int = 0
    lines_cut: int = 0  # longer than MAX_LINE_BYTES: read up to it, the rest skipped
    bad_values: int = 0  # values that break the value rule (engines.common): not stored
    cut: str | None = None  # a compressed file that ends early: where, and what was read
    continues: str | None = None  # the file that first brought this log's content, if another
    first_bad_value: str | None = None
    untimed: int = 0  # events stored with no time: an impossible stamp (Feb 30, hour 25) or no date
    first_untimed_line: int | None = None
    # -- Prometheus
    gpus: int = 0
    ranks: int = 0
    queries: int = 0
    windows: int = 0
    runs: list[str] = field(default_factory=list)
    found: list[str] = field(default_factory=list)  # metric names with series in the range
    lacking: list[str] = field(default_factory=list)  # diagnosis inputs none of whose series was there
    dcgm_schema: str = ""  # dcgm-exporter's names found: "4.8" (before 4.9), "4.9", "4.10"; "" none

    def skip(self, where: str, why: str) -> None:
        self.bad += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(f"{where}: {why}")

    def count_cut_line(self) -> None:
        self.lines_cut += 1

    def count(self, table: str) -> int:
        return self.written.get(table, 0)

    @property
    def events_written(self) -> int:
        return self.count("scheduler_events")

    @property
    def configs_written(self) -> int:
        return self.count("engine_configs")

    def as_dict(self) -> dict[str, object]:
        """An engine log's counts, as `gputrace import` and the fast path's equivalence test see them."""
        return {
            "path": self.path, "source": self.source, "lines": self.lines,
            "recognised": dict(self.recognised), "unrecognised": self.unrecognised,
            "events_written": self.events_written, "configs_written": self.configs_written,
        }

    def summary(self) -> str:
        """The line `gputrace import` prints for this file."""
        if self.kind.endswith(" log"):
            recognised = ", ".join(f"{k} {v}" for k, v in self.recognised.items() if v)
            return (f"{self.kind} {self.path}: {self.lines} lines, recognised {recognised or 'none'}, "
                    f"unrecognised {self.unrecognised}; {self.events_written} events, "
                    f"{self.configs_written} configuration records"
                    + (f"; {self.lines_cut} lines longer than {MAX_LINE_BYTES >> 20} MiB cut there"
                       if self.lines_cut else "")
                    + (f"; {self.bad_values} bad values not stored (first: {self.first_bad_value})"
                       if self.bad_values else "")
                    + (f"; {self.untimed} events with no valid time, stored untimed (an impossible "
                       f"date or hour, or no date: --date gives one; first: line {self.first_untimed_line})"
                       if self.untimed else "")
                    + (f"; FILE CUT: {self.cut}" if self.cut else "")
                    + self._present_summary())
        parts = [f"{n} {table}" for table, n in self.written.items() if n]
        line = f"{self.path} ({self.kind}): " + (", ".join(parts) or "nothing") + " imported"
        line += self._present_summary()
        if self.ended_before_start:
            line += f"; {self.ended_before_start} requests ending before they start dropped"
        if self.bad:
            line += f"; {self.bad} bad rows skipped (first: {self.problems[0]})"
        return line


    def _present_summary(self) -> str:
        """'; 64 requests, 2 markers already present' (and the file they came in with)."""
        present = [f"{n} {_TABLE_WORDS.get(table, table)}" for table, n in self.present.items() if n]
        if not present and self.continues is None:
            return ""
        where = f" (this log's content came first in {self.continues})" if self.continues else ""
        return f"; {', '.join(present) or 'nothing'} already present{where}"


# what an engine log's summary calls its tables' rows
_TABLE_WORDS = {"scheduler_events": "events", "engine_configs": "configuration records"}


@dataclass(frozen=True, slots=True)
class StoredLines:
    """The line numbers of one engine log that the run holds rows for (sorted): a grown copy of
    the log, or the same log compressed, writes only its other lines. A line is keyed by its
    number in the log's decompressed content, which every copy of it shares."""

    line_no: np.ndarray

    def new(self, line_no: np.ndarray) -> np.ndarray:
        """Which of ``line_no`` the run lacks (a boolean mask)."""
        if not len(self.line_no):
            return np.ones(len(line_no), dtype=bool)
        at = np.minimum(np.searchsorted(self.line_no, line_no), len(self.line_no) - 1)
        return np.asarray(self.line_no[at] != line_no)


def write_rows(store: Store, report: ImportReport, table: str,
               rows: Sequence[Any] | Mapping[str, Column], *, unique: bool = False,
               stored_lines: StoredLines | None = None) -> int:
    """Append rows to ``table`` as one committed batch and count them in ``report``: records of the
    table's type (a record no column can hold is one bad row, not the whole file's loss) or columns
    (numpy, Arrow or lists, as ``Store.append_columns`` takes them). Returns the rows written.

    Rows the run holds already are counted in ``report.present``, not written: with ``unique``,
    those whose identity the table holds (store.RECORD_IDENTITY); with ``stored_lines``, an
    engine log's lines that have a row."""
    given = len(rows) if not isinstance(rows, Mapping) else _column_length(rows)
    if stored_lines is not None:
        rows = _only_new_lines(rows, stored_lines)
    if isinstance(rows, Mapping):
        if table == "scheduler_events":
            _count_untimed(report, rows)
        n = store.append_columns(table, rows, unique=unique) if _column_length(rows) else 0
        rejected_n = 0
    elif not rows:
        n = rejected_n = 0
    else:
        n, rejected = store.append_valid(rows, unique=unique)
        rejected_n = len(rejected)
        for record, reason in rejected:
            report.skip(f"{table} {_where(record)}", f"cannot be stored: {reason}")
    report.written[table] = report.written.get(table, 0) + n
    if present := given - n - rejected_n:
        report.present[table] = report.present.get(table, 0) + present
    return n


def _column_length(columns: Mapping[str, Column]) -> int:
    return next((len(v) for v in columns.values() if not isinstance(v, str | int)), 0)


def _only_new_lines(rows: Sequence[Any] | Mapping[str, Column], stored: StoredLines
                    ) -> Sequence[Any] | Mapping[str, Column]:
    """``rows`` (records or columns, each with a ``line_no``) less the lines the run holds."""
    if not isinstance(rows, Mapping):
        keep = stored.new(np.asarray([r.line_no for r in rows], dtype=np.int64))
        return [r for r, new in zip(rows, keep.tolist(), strict=True) if new]
    line_no = rows["line_no"]
    keep = stored.new(line_no.to_numpy() if isinstance(line_no, pa.Array | pa.ChunkedArray)
                      else np.asarray(line_no, dtype=np.int64))
    if keep.all():
        return rows
    mask = pa.array(keep)
    out: dict[str, Column] = {}
    for name, column in rows.items():
        if isinstance(column, str | int):
            out[name] = column
        elif isinstance(column, pa.Array | pa.ChunkedArray):
            out[name] = column.filter(mask)
        elif isinstance(column, np.ndarray):
            out[name] = column[keep]
        else:
            out[name] = [v for v, new in zip(column, keep.tolist(), strict=True) if new]
    return out


def _count_untimed(report: ImportReport, columns: Mapping[str, Column]) -> None:
    """Count the rows whose log time is null (the clock found no real time in the stamp)."""
    times = columns.get("log_ts_ns")
    if times is None or isinstance(times, str | int):  # a constant time is no missing one
        return
    if isinstance(times, pa.Array):
        if not times.null_count:  # the usual case, read off the array without pyarrow.compute
            return
        # is_null() would import pyarrow.compute (and pandas with it: 0.35 CPU s of every import)
        missing = np.array([t is None for t in times.to_pylist()], dtype=bool)
    else:
        missing = np.array([t is None for t in times], dtype=bool)
    if not missing.any():
        return
    report.untimed += int(missing.sum())
    if report.first_untimed_line is None:
        line_no = columns["line_no"]
        first = int(np.argmax(missing))
        if isinstance(line_no, pa.Array):
            report.first_untimed_line = int(line_no[first].as_py())
        else:
            report.first_untimed_line = int(np.asarray(line_no)[first])


def write_parsed(store: Store, report: ImportReport) -> ImportReport:
    """Move a parser's records into the store, one batch per record type; returns ``report``."""
    for table in ("requests", "markers", "gpu_samples"):  # what a file can fill, in the summary's order
        report.written.setdefault(table, 0)
    by_table: dict[str, list[Record]] = {}
    for record in report.records:
        if (isinstance(record, RequestRecord) and record.end_ns is not None
                and record.end_ns < record.start_ns <= _INT64_MAX):  # a start past int64: a bad row
            # a clock stepped back mid-request, or a tool's bug: no latency or load can come of it
            report.ended_before_start += 1
            continue
        by_table.setdefault(RECORD_TABLES[type(record)], []).append(record)
    report.records = []
    for table, records in by_table.items():
        # a file's records go in once however often the file (or one overlapping it) comes
        write_rows(store, report, table, records, unique=True)
    if report.bad:
        log.warning("bad rows skipped", file=report.path, kind=report.kind, bad=report.bad,
                    first=report.problems[0])
    if report.ended_before_start:
        log.warning("requests ending before they start dropped", file=report.path, kind=report.kind,
                    requests=report.ended_before_start)
    return report


def _where(record: Any) -> str:
    """A short name for a record in a message (its request id, label or GPU)."""
    if isinstance(record, RequestRecord):
        return f"request {record.request_id!a}"
    if isinstance(record, Marker):
        return f"marker {record.label!a}"
    gpu = getattr(record, "gpu_index", None)
    return f"GPU {gpu!a}" if gpu is not None else type(record).__name__


def read_text(path: str | os.PathLike[str]) -> str:
    """An input file as text (undecodable bytes replaced, a UTF-8 byte-order mark dropped: Excel
    and PowerShell write one, and it hid the first column's name); ConfigError when unreadable."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8-sig", errors="replace")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror}") from exc

