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
from collections.abc import Callable, Mapping, Sequence

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

# query-gpu field -> GpuSample field; the first field present wins for power.
_QUERY_FIELDS: dict[str, str] = {
    "utilization.gpu": "utilization_ratio",
    "utilization.memory": "memory_utilization_ratio",
    "power.draw.instant": "power_w",
    "power.draw": "power_w",
    "power.draw.average": "power_w",
    "clocks.sm": "sm_clock_hz",
    "clocks.current.sm": "sm_clock_hz",
    "clocks.mem": "memory_clock_hz",
    "clocks.current.memory": "memory_clock_hz",
    "memory.used": "memory_used_bytes",
    "memory.total": "memory_total_bytes",
    "temperature.gpu": "temperature_c",
}
# GpuSample field -> {unit as nvidia-smi writes it: factor to the field's unit}; the first unit is
# what nvidia-smi prints today (and what a header without units means). A unit is read from the
# header ("power.draw [mW]") and from each value ("604 mW"): one left unconverted stored mW as W.
_UNITS: dict[str, dict[str, float]] = {
    "utilization_ratio": {"%": 0.01},
    "memory_utilization_ratio": {"%": 0.01},
    "power_w": {"W": 1.0, "mW": 1e-3, "kW": 1e3},
    "sm_clock_hz": {"MHz": 1e6, "GHz": 1e9, "kHz": 1e3, "Hz": 1.0},
    "memory_clock_hz": {"MHz": 1e6, "GHz": 1e9, "kHz": 1e3, "Hz": 1.0},
    "memory_used_bytes": {"MiB": _MIB, "KiB": 1024, "GiB": 1024 * _MIB, "B": 1},
    "memory_total_bytes": {"MiB": _MIB, "KiB": 1024, "GiB": 1024 * _MIB, "B": 1},
    "temperature_c": {"C": 1.0},
}
_BYTE_FIELDS = ("memory_used_bytes", "memory_total_bytes")


def _converter(target: str, unit: str) -> Convert:
    factor = _UNITS[target][unit]
    if target in _BYTE_FIELDS:
        return lambda v: int(v * factor)
    return lambda v: v * factor


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


def _sample(host: str, gpu: int, ts_ns: int, values: Mapping[str, float | None],
            clock_event_reasons: int | None = None) -> GpuSample:
    """One row's GpuSample from its values by GpuSample field name (the fields ``_UNITS`` and
    ``_DMON_COLUMNS`` fill; None or absent: not reported)."""
    def count(name: str) -> int | None:
        value = values.get(name)
        return None if value is None else int(value)

    return GpuSample(
        host, gpu, ts_ns, utilization_ratio=values.get("utilization_ratio"),
        memory_utilization_ratio=values.get("memory_utilization_ratio"), power_w=values.get("power_w"),
        pcie_tx_bytes_per_s=values.get("pcie_tx_bytes_per_s"),
        pcie_rx_bytes_per_s=values.get("pcie_rx_bytes_per_s"), sm_clock_hz=values.get("sm_clock_hz"),
        memory_clock_hz=values.get("memory_clock_hz"), memory_used_bytes=count("memory_used_bytes"),
        memory_total_bytes=count("memory_total_bytes"), temperature_c=values.get("temperature_c"),
        clock_event_reasons=clock_event_reasons)


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


def _header_unit(header: str) -> str | None:
    """"power.draw [mW]" -> "mW"; None without brackets."""
    _, bracket, rest = header.partition("[")
    return rest.split("]", 1)[0].strip() if bracket else None


def _column_unit(path: str | os.PathLike[str], header: str, target: str) -> str:
    """The unit a column's header gives (the usual one when it gives none); ConfigError for a unit
    gputrace cannot convert, rather than storing its numbers as another unit's."""
    units = _UNITS[target]
    unit = _header_unit(header)
    if unit is None:
        return next(iter(units))
    if unit not in units:
        raise ConfigError(f"{path}: column {header.strip()!r}: unit {unit!r} not understood "
                          f"(expected {', '.join(units)})")
    return unit


def _converted(text: str, target: str, column_unit: str) -> float | int | None:
    """A cell in its field's unit: "604.50 W" or "604500 mW" (its own unit wins), "[N/A]" -> None."""
    t = text.strip()
    if t.lower() in _NA:
        return None
    number, _, unit = t.partition(" ")
    unit = unit.strip() or column_unit
    if unit not in _UNITS[target]:
        raise ValueError(f"unit {unit!r} of {t!r} not understood (expected {', '.join(_UNITS[target])})")
    return _converter(target, unit)(float(number))


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
    headers = [*fields] if fields else []
    if _looks_like_header(rows[0]):
        headers = rows[0]
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
    mapped: dict[str, tuple[int, str]] = {}  # target -> (column, the column's unit)
    for name, target in _QUERY_FIELDS.items():
        if name in col and target not in mapped:
            mapped[target] = (col[name], _column_unit(path, headers[col[name]], target))
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
            values = {target: _converted(row[i], target, unit) for target, (i, unit) in mapped.items()}
            reasons = None
            if reason_col is not None and row[reason_col].strip().lower() not in _NA:
                reasons = int(row[reason_col].strip(), 16)
        except ValueError as exc:
            out.skip(f"row {no}", str(exc))
            continue
        out.records.append(_sample(host, gpu, ts, values, reasons))
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
            values: dict[str, float | None] = {}
            for column, (target, convert) in _DMON_COLUMNS.items():
                if column in row:
                    v = _value(row[column])
                    values[target] = None if v is None else convert(v)
        except (ValueError, KeyError) as exc:
            out.skip(f"line {no}", f"{type(exc).__name__}: {exc}")
            continue
        out.records.append(_sample(host, gpu, ts, values))
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
