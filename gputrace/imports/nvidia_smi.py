"""Importers of nvidia-smi output into GpuSamples: ``--query-gpu=... --format=csv[,noheader][,nounits]
-lms N`` (any field order) and ``dmon -o DT`` (date and time columns, any ``-s`` metric set).

nvidia-smi prints the host's local time without a zone: ``tz`` says which zone that was (UTC by
default). Bad rows are counted and reported, never fatal; a file of the wrong kind is one ConfigError.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import os
import zoneinfo
from collections.abc import Callable, Sequence
from typing import Any

from gputrace.errors import ConfigError
from gputrace.imports.report import ImportReport, read_text, write_parsed
from gputrace.model import GpuSample
from gputrace.store import Store

_MIB = 1024 * 1024
_NA = {
    "", "-", "n/a", "[n/a]", "[not supported]", "not supported", "[unknown error]",
    "[insufficient permissions]",
}

Convert = Callable[[float], float | int]

# query-gpu field -> (GpuSample field, conversion); the first field present wins for power.
_QUERY_FIELDS: dict[str, tuple[str, Convert]] = {
    "utilization.gpu": ("utilization_ratio", lambda v: v / 100.0),
    "utilization.memory": ("memory_utilization_ratio", lambda v: v / 100.0),
    "power.draw.instant": ("power_w", float),
    "power.draw": ("power_w", float),
    "power.draw.average": ("power_w", float),
    "clocks.sm": ("sm_clock_hz", lambda v: v * 1e6),
    "clocks.current.sm": ("sm_clock_hz", lambda v: v * 1e6),
    "clocks.mem": ("memory_clock_hz", lambda v: v * 1e6),
    "clocks.current.memory": ("memory_clock_hz", lambda v: v * 1e6),
    "memory.used": ("memory_used_bytes", lambda v: int(v * _MIB)),
    "memory.total": ("memory_total_bytes", lambda v: int(v * _MIB)),
    "temperature.gpu": ("temperature_c", float),
}
_REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
_ID_FIELDS = ("pci.bus_id", "gpu_bus_id", "uuid", "gpu_uuid")

# dmon column -> (GpuSample field, conversion)
_DMON_COLUMNS: dict[str, tuple[str, Convert]] = {
    "pwr": ("power_w", float),
    "gtemp": ("temperature_c", float),
    "sm": ("utilization_ratio", lambda v: v / 100.0),
    "mem": ("memory_utilization_ratio", lambda v: v / 100.0),
    "mclk": ("memory_clock_hz", lambda v: v * 1e6),
    "pclk": ("sm_clock_hz", lambda v: v * 1e6),
    "fb": ("memory_used_bytes", lambda v: int(v * _MIB)),  # dmon's "MB" is MiB, like memory.used
    "rxpci": ("pcie_rx_bytes_per_s", lambda v: v * 1e6),  # MB/s
    "txpci": ("pcie_tx_bytes_per_s", lambda v: v * 1e6),
}


def parse_tz(spec: str | None) -> dt.tzinfo:
    """``None``/"UTC", an offset like "+08:00", or an IANA name like "Europe/Berlin"."""
    if spec is None or spec.upper() in ("UTC", "Z"):
        return dt.UTC
    if spec[:1] in "+-":
        try:
            hours, _, minutes = spec[1:].partition(":")
            delta = dt.timedelta(hours=int(hours), minutes=int(minutes or 0))
            return dt.timezone(delta if spec[0] == "+" else -delta)
        except (ValueError, OverflowError):  # also an offset of a day or more
            raise ConfigError(f"--timezone: expected UTC, +HH:MM (under 24 h) or a zone name, "
                              f"got {spec[:100]!r}") from None
    try:
        return zoneinfo.ZoneInfo(spec)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):  # OSError: "America" is a directory
        raise ConfigError(f"--timezone: unknown time zone {spec[:100]!r}") from None


class _Clock:
    """Local wall-clock text -> epoch ns, caching each second's conversion (files hold millions)."""

    def __init__(self, tz: dt.tzinfo, fmt: str):
        self.tz = tz
        self.fmt = fmt
        self._cache: dict[str, int] = {}

    def ns(self, seconds_text: str, fraction: str = "") -> int:
        base = self._cache.get(seconds_text)
        if base is None:
            stamp = dt.datetime.strptime(seconds_text, self.fmt).replace(tzinfo=self.tz)
            base = int(stamp.timestamp()) * 1_000_000_000
            self._cache[seconds_text] = base
        if fraction:
            base += int(fraction.ljust(9, "0")[:9])
        return base


def _value(text: str) -> float | None:
    """"45 %", "250.12 W", "1980 MHz", "[N/A]" -> 45.0, 250.12, 1980.0, None."""
    t = text.strip()
    if t.lower() in _NA:
        return None
    return float(t.split()[0])


def _field_name(header: str) -> str:
    """"utilization.gpu [%]" -> "utilization.gpu"."""
    return header.split("[", 1)[0].strip().lower()


def _looks_like_header(cells: Sequence[str]) -> bool:
    return any(_field_name(c) in ("timestamp", "index", *_QUERY_FIELDS) for c in cells)


def parse_query_csv(
    path: str | os.PathLike[str],
    host: str,
    fields: Sequence[str] | None = None,
    tz: dt.tzinfo = dt.UTC,
) -> ImportReport:
    """``nvidia-smi --query-gpu=F1,F2,... --format=csv[,noheader][,nounits] [-lms N]`` output.

    The field order comes from the header line, or from ``fields`` (the --query-gpu list) for
    ``noheader`` output. ``timestamp`` must be among the fields; ``index`` (else ``pci.bus_id`` or
    ``uuid``, numbered in order of appearance) names the GPU.
    """
    text = read_text(path)
    rows = [r for r in csv.reader(io.StringIO(text), skipinitialspace=True) if any(c.strip() for c in r)]
    if not rows:
        raise ConfigError(f"{path}: empty nvidia-smi CSV")
    first_row = 1
    if _looks_like_header(rows[0]):
        names = [_field_name(c) for c in rows[0]]
        rows = rows[1:]
        first_row = 2
    elif fields:
        names = [_field_name(f) for f in fields]
    else:
        raise ConfigError(
            f"{path}: not nvidia-smi --query-gpu CSV with a header (for noheader output give the "
            "--query-gpu field list)"
        )
    if "timestamp" not in names:
        raise ConfigError(
            f"{path}: the nvidia-smi query has no 'timestamp' field; samples cannot be placed in time"
        )
    col = {n: i for i, n in reversed(list(enumerate(names)))}
    id_col = col.get("index")
    alt_id = next((col[f] for f in _ID_FIELDS if f in col), None)
    mapped: dict[str, tuple[int, Convert]] = {}
    for name, (target, convert) in _QUERY_FIELDS.items():
        if name in col and target not in mapped:
            mapped[target] = (col[name], convert)
    reason_col = next((col[f] for f in _REASON_FIELDS if f in col), None)
    clock = _Clock(tz, "%Y/%m/%d %H:%M:%S")
    ids: dict[str, int] = {}
    out = ImportReport(str(path), "nvidia-smi-csv")
    ts_col = col["timestamp"]
    for no, row in enumerate(rows, first_row):
        if len(row) != len(names):
            out.skip(f"row {no}", f"{len(row)} fields, expected {len(names)}")
            continue
        try:
            stamp, _, frac = row[ts_col].strip().partition(".")
            ts = clock.ns(stamp, frac)
            if id_col is not None:
                gpu = int(row[id_col])
            elif alt_id is not None:
                gpu = ids.setdefault(row[alt_id].strip(), len(ids))
            else:
                gpu = 0
            values: dict[str, Any] = {}
            for target, (i, convert) in mapped.items():
                v = _value(row[i])
                values[target] = None if v is None else convert(v)
            if reason_col is not None and row[reason_col].strip().lower() not in _NA:
                values["clock_event_reasons"] = int(row[reason_col].strip(), 16)
        except ValueError as exc:
            out.skip(f"row {no}", str(exc))
            continue
        out.records.append(GpuSample(host=host, gpu_index=gpu, ts_ns=ts, **values))
    if rows and not out.records and out.bad == len(rows):
        raise ConfigError(f"{path}: no row parses as nvidia-smi --query-gpu CSV (first: {out.problems[0]})")
    return out


def parse_dmon(path: str | os.PathLike[str], host: str, tz: dt.tzinfo = dt.UTC) -> ImportReport:
    """``nvidia-smi dmon -o DT [-s ...]`` output: ``#Date Time gpu pwr ...`` header lines (repeated),
    a units line, then whitespace-separated rows; "-" is a metric the GPU does not report."""
    text = read_text(path)
    out = ImportReport(str(path), "nvidia-smi-dmon")
    names: list[str] | None = None
    saw_header = False
    clocks = {"%Y%m%d": _Clock(tz, "%Y%m%d %H:%M:%S"), "%Y/%m/%d": _Clock(tz, "%Y/%m/%d %H:%M:%S")}
    for no, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            cells = stripped.lstrip("#").split()
            if cells and cells[0].lower() == "date":
                names = [c.lower() for c in cells]
                saw_header = True
            elif cells and cells[0].lower() in ("gpu", "time"):
                raise ConfigError(
                    f"{path}: dmon output without dates: record it with `nvidia-smi dmon -o DT`"
                )
            continue  # the units line
        if names is None:
            out.skip(f"line {no}", "data before a '#Date Time gpu ...' header")
            continue
        cells = stripped.split()
        if len(cells) != len(names):
            out.skip(f"line {no}", f"{len(cells)} columns, expected {len(names)}")
            continue
        row = dict(zip(names, cells, strict=True))
        try:
            date = row["date"]
            clock = clocks["%Y/%m/%d" if "/" in date else "%Y%m%d"]
            ts = clock.ns(f"{date} {row['time']}")
            gpu = int(row.get("gpu") or row.get("idx") or "")
            values: dict[str, Any] = {}
            for column, (target, convert) in _DMON_COLUMNS.items():
                if column in row:
                    v = _value(row[column])
                    values[target] = None if v is None else convert(v)
        except (ValueError, KeyError) as exc:
            out.skip(f"line {no}", f"{type(exc).__name__}: {exc}")
            continue
        out.records.append(GpuSample(host=host, gpu_index=gpu, ts_ns=ts, **values))
    if not saw_header:
        raise ConfigError(f"{path}: not nvidia-smi dmon output (no '#Date Time gpu ...' header line)")
    return out


def import_nvidia_smi_csv(
    store: Store,
    path: str | os.PathLike[str],
    host: str,
    fields: Sequence[str] | None = None,
    tz: dt.tzinfo = dt.UTC,
) -> ImportReport:
    return write_parsed(store, parse_query_csv(path, host, fields, tz))


def import_nvidia_smi_dmon(
    store: Store, path: str | os.PathLike[str], host: str, tz: dt.tzinfo = dt.UTC
) -> ImportReport:
    return write_parsed(store, parse_dmon(path, host, tz))
