"""The run store: one directory per run, ``meta.json`` plus a DuckDB database with a table per
record type. The only module that imports duckdb.

Each append is one committed transaction, so a collector killed mid-run leaves every batch whose
``append`` returned. Reads come back as numpy columns, Arrow tables, records or SQL rows.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import time
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NotRequired, TypeAlias, TypedDict, TypeVar

import duckdb
import numpy as np
import pyarrow as pa

from gputrace import __version__
from gputrace.arrow_columns import from_numpy, from_values
from gputrace.backoff import Backoff
from gputrace.errors import RecordError, SchemaVersionError, StoreError, StoreWriteError
from gputrace.json_types import JsonObject
from gputrace.logsetup import get_logger
from gputrace.model import (
    ABANDONED_PREFIX,
    RECORD_TABLES,
    ClockProbe,
    DeviceInfo,
    EngineConfig,
    Marker,
    RunMeta,
)
from gputrace.run_tables import (
    DEFAULT_MARGINS,
    EVENT_KINDS,
    GPU_METRICS,
    EngineMetricColumns,
    EngineSettings,
    GpuExtents,
    GpuSampleColumns,
    LoadGaugeColumns,
    ReadMargins,
    RequestColumns,
    RunTables,
    SchedulerEventColumns,
    Window,
    event_column_dtypes,
    probe_columns,
)
from gputrace.topology import check_meta_topology

SCHEMA_VERSION = 1
DB_FILE = "run.duckdb"
META_FILE = "meta.json"
REJECTS_FILE = "rejects.ndjson"  # records set aside because a value did not fit its column
# Space a capture keeps for its last meta.json: on a disk that filled, the file is deleted so the
# stop can still record what it could not write (the temporary copy of meta.json needs its full
# size; a long capture's meta.json is a few tens of KiB).
META_RESERVE_FILE = "meta.reserve"
META_RESERVE_BYTES = 1 << 20
# DuckDB stores a table in row groups of this many rows (the file is attached with it: DuckDB
# does not keep the size in the file). An append of at least a group is written straight to the
# file; a smaller one goes through the write-ahead log and a checkpoint. Half DuckDB's default
# (122,880) sends 100,000-row appends the direct way (measured: 1.10-1.26M rows/s against
# 0.82-0.92M). A bulk load appending whole multiples writes each group once; any other size leaves
# a partial group that the next append or the checkpoint rewrites.
ROW_GROUP_ROWS = 65_536

READ_MEMORY_LIMIT = "256MB"  # DuckDB's block cache while a run is read for the analysis
R = TypeVar("R")
log = get_logger("store")

# The import ledger. imported_files: one row per file imported into the run, keyed by the sha256
# of its bytes, so the same content given again (under any path) adds nothing. imported_streams:
# one row per engine log known by the fingerprint of its first decompressed bytes, naming the
# source its lines are stored under, so a grown copy, or the same log compressed, adds only the
# lines the run lacks. Not record tables: no analysis reads them.
IMPORTS_TABLE = "imported_files"
STREAMS_TABLE = "imported_streams"


@dataclasses.dataclass(frozen=True, slots=True)
class ImportedFile:
    """A file in the import ledger: its content's sha256 (and the cheap probe that finds the
    candidates, gputrace.imports.ledger), what it was imported as, from where, when."""

    sha256: str
    probe: str
    kind: str  # "sglang log", "aiperf", "nvidia-smi-csv", ...
    path: str  # as it was given, resolved
    size_bytes: int
    imported_ns: int


@dataclasses.dataclass(frozen=True, slots=True)
class ImportedStream:
    """An engine log in the import ledger, by content: the sha256 of its first ``head_bytes``
    decompressed bytes, and the source its lines are stored under (each line keyed by its
    number there). A log may have several rows: one per head length it was seen with."""

    head_sha256: str
    head_bytes: int
    source: str
    kind: str  # "sglang log", "vllm log"
    path: str  # the file that first brought it, resolved
    imported_ns: int


_LEDGER_TABLES: dict[str, type] = {IMPORTS_TABLE: ImportedFile, STREAMS_TABLE: ImportedStream}

# Each record's identity, for imports that must add a record once however often its file comes
# (``append_columns(unique=True)``). A request's id alone is not one: AIPerf's and guidellm's
# fallback ids are positions in their file.
RECORD_IDENTITY: dict[str, tuple[str, ...]] = {
    "requests": ("host", "request_id", "start_ns"),
    "markers": ("host", "ts_ns", "label", "kind"),
    "gpu_samples": ("host", "gpu_index", "ts_ns"),
    # a Prometheus import's rows (one a series and step): a range imported again adds nothing
    "scheduler_events": ("host", "source", "kind", "pp_rank", "tp_rank", "dp_rank", "log_ts_ns"),
    "load_samples": ("source", "ts_ns"),
    "engine_metrics": ("host", "source", "name", "labels_json", "ts_ns"),
    "devices": ("host", "gpu_index"),
    "engine_configs": ("host", "source", "line_no"),
}

# What DuckDB raises when a write fails for a reason outside the data (measured on a full tmpfs:
# IOException for a direct write or a failed checkpoint, TransactionException for a WAL commit).
_WRITE_FAILURES: tuple[type[duckdb.Error], ...] = (
    duckdb.IOException, duckdb.TransactionException, duckdb.OutOfMemoryException, duckdb.FatalException)

_SQL_TYPES: dict[type, str] = {int: "BIGINT", float: "DOUBLE", str: "VARCHAR", bool: "BOOLEAN"}
_ARROW_TYPES: dict[type, pa.DataType] = {
    int: pa.int64(),
    float: pa.float64(),
    str: pa.string(),
    bool: pa.bool_(),
}


def _base_type(annotation: Any) -> type:
    """``int | None`` -> int."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return typing.cast(type, args[0])
    return typing.cast(type, annotation)


def _columns_of(record_type: type) -> list[tuple[str, type]]:
    hints = typing.get_type_hints(record_type)
    return [(f.name, _base_type(hints[f.name])) for f in dataclasses.fields(record_type)]


_TABLE_COLUMNS: dict[str, list[tuple[str, type]]] = {
    table: _columns_of(rt) for rt, table in RECORD_TABLES.items()
}
_TABLE_TYPES: dict[str, type] = {table: rt for rt, table in RECORD_TABLES.items()}


def table_columns(table: str) -> list[str]:
    """The column names of a store table, in order."""
    return [name for name, _ in _schema(table)]


def _schema(table: str) -> list[tuple[str, type]]:
    try:
        return _TABLE_COLUMNS[table]
    except KeyError:
        raise StoreError(f"unknown table {table!r}; known: {', '.join(_TABLE_COLUMNS)}") from None


def _arrow_schema(table: str) -> pa.Schema:
    return pa.schema([(name, _ARROW_TYPES[t]) for name, t in _schema(table)])


def warm_up() -> None:
    """Do now what the first append would: pyarrow imports pandas on its first array (1-2 s on a
    busy machine), which on a collector's event loop held every request (marks timed out)."""
    pa.array([0], type=pa.int64())


def _to_arrow_column(values: Any, dtype: pa.DataType) -> pa.Array:
    """numpy or Python values -> Arrow; NaN in float columns and None become NULL."""
    if isinstance(values, pa.Array | pa.ChunkedArray):
        if pa.types.is_dictionary(values.type) and values.type.value_type == dtype:
            return values  # DuckDB reads the codes (e.g. an engine line's kind) as is
        return values if values.type == dtype else values.cast(dtype)
    if isinstance(values, np.ndarray):
        mask = None
        if values.dtype.kind == "f":
            nan = np.isnan(values)
            mask = nan if nan.any() else None
        if isinstance(values, np.ma.MaskedArray):
            mask = np.ma.getmaskarray(values) if mask is None else mask | np.ma.getmaskarray(values)
            values = values.data
        if values.ndim == 1 and values.dtype.kind in "biuf" and pa.from_numpy_dtype(values.dtype) == dtype:
            return from_numpy(values, mask)
        return pa.array(values, type=dtype, mask=mask, from_pandas=False)
    return from_values(list(values), dtype)


def _meta_from_json(raw: JsonObject, meta_path: Path) -> RunMeta:
    """RunMeta from meta.json's object; a missing or mistyped field is a StoreError naming it."""
    missing = [f.name for f in dataclasses.fields(RunMeta) if f.name not in raw
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise StoreError(f"{meta_path}: {', '.join(missing)} missing")
    sections: dict[str, dict[str, object]] = {}
    for section in ("config", "topology", "extra"):
        value = raw.get(section, {})
        if not isinstance(value, dict):
            raise StoreError(f"{meta_path}: {section} must be a JSON object")
        sections[section] = dict(value)
    name, version = raw["name"], raw["gputrace_version"]
    created_ns, schema_version = raw["created_ns"], raw["schema_version"]
    if not isinstance(name, str):
        raise StoreError(f"{meta_path}: name must be a string")
    if not isinstance(version, str):
        raise StoreError(f"{meta_path}: gputrace_version must be a string")
    for field_name, number in (("created_ns", created_ns), ("schema_version", schema_version)):
        if not isinstance(number, int) or isinstance(number, bool):
            raise StoreError(f"{meta_path}: {field_name} must be an integer")
    assert isinstance(created_ns, int) and isinstance(schema_version, int)
    try:  # a size from input is bounded where it enters
        check_meta_topology(sections["topology"])
    except StoreError as exc:
        raise StoreError(f"{meta_path.parent}: {exc}") from None
    return RunMeta(name=name, created_ns=created_ns, gputrace_version=version,
                   schema_version=schema_version, **sections)


# What converting a bad Python value to its Arrow column raises.
_VALUE_ERRORS = (pa.ArrowException, OverflowError, UnicodeError, TypeError, ValueError)


def _unstorable(record: Any, schema: pa.Schema) -> str | None:
    """Why one record cannot be stored (the first field that does not fit), or None."""
    for f in schema:
        value = getattr(record, f.name, None)
        try:
            pa.array([value], type=f.type)
        except _VALUE_ERRORS as exc:
            return f"{f.name}={value!a}: {exc}"
    return None


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _create_missing_tables(con: duckdb.DuckDBPyConnection, temporary: bool) -> None:
    have = {row[0] for row in con.execute(
        "SELECT table_name FROM duckdb_tables() WHERE database_name = 'run'").fetchall()}
    wanted = {**{table: _columns_of(rt) for table, rt in _LEDGER_TABLES.items()}, **_TABLE_COLUMNS}
    for table, cols in wanted.items():
        if table not in have:
            ddl = ", ".join(f'"{n}" {_SQL_TYPES[t]}' for n, t in cols)
            con.execute(f"CREATE {'TEMP ' if temporary else ''}TABLE {table} ({ddl})")


def _insert_new(table: str, select: Sequence[str]) -> str:
    """SQL: insert the batch's rows whose identity neither the table nor an earlier row of the
    batch holds, in the batch's order (an anti-join keeps no order of its own)."""
    key = RECORD_IDENTITY.get(table)
    if key is None:
        raise StoreError(f"{table}: no record identity to append by")
    names = ", ".join(f'"{n}"' for n, _ in _schema(table))
    same = " AND ".join(f't."{k}" IS NOT DISTINCT FROM b."{k}"' for k in key)
    partition = ", ".join(f'"{k}"' for k in key)
    return (f"INSERT INTO {table} SELECT {names} FROM ("
            f"SELECT *, row_number() OVER (PARTITION BY {partition} ORDER BY _row) AS _nth FROM ("
            f"SELECT {', '.join(select)}, row_number() OVER () AS _row FROM _gputrace_batch)) AS b "
            f"WHERE _nth = 1 AND NOT EXISTS (SELECT 1 FROM {table} AS t WHERE {same}) ORDER BY _row")


def _within(column: str, lo: int | None, hi: int | None, margin_ns: int) -> str:
    """SQL: the column within [lo - margin, hi + margin] (TRUE when the window is open)."""
    parts = ([f"{column} >= {int(lo) - margin_ns}"] if lo is not None else []) + \
        ([f"{column} <= {int(hi) + margin_ns}"] if hi is not None else [])
    return " AND ".join(parts) or "TRUE"


def _numbers(tbl: pa.Table, name: str, dtype: type = np.float64) -> np.ndarray:
    """A numeric result column as numpy (NULL -> NaN for floats)."""
    col = tbl.column(name)
    if col.null_count and dtype is not np.float64:
        raise StoreError(f"{name}: NULL in a column read as {dtype.__name__}")
    return np.asarray(col.to_numpy(zero_copy_only=False), dtype=dtype)


def _objects(tbl: pa.Table, name: str) -> np.ndarray:
    return np.asarray(tbl.column(name).to_pylist(), dtype=object)


ColumnValue: TypeAlias = str | int | float | bool | None
"""One value of a stored column, as a record's field holds it."""
Column: TypeAlias = "np.ndarray | pa.Array | pa.ChunkedArray | Sequence[ColumnValue] | str | int"
"""A column given to ``append_columns``: numpy, Arrow, a list, or a str/int constant for every row."""

_DEFAULTS: dict[str, dict[str, ColumnValue]] = {
    table: {
        f.name: f.default
        for f in dataclasses.fields(rt)
        if f.default is not dataclasses.MISSING
    }
    for rt, table in RECORD_TABLES.items()
}


class Store:
    """An open run store. Use :meth:`create` or :meth:`open`; close it (or use ``with``)."""

    def __init__(self, path: Path, con: duckdb.DuckDBPyConnection, meta: RunMeta, read_only: bool):
        self.path = path
        self._con = con
        self.meta = meta
        self.read_only = read_only
        # A checkpoint that failed (disk full) invalidates the attached database until it is
        # attached again; what was committed is in the WAL and comes back on the new attach.
        self._invalidated = False

    # -- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        *,
        name: str | None = None,
        config: Mapping[str, object] | None = None,
        topology: Mapping[str, object] | None = None,
        extra: Mapping[str, object] | None = None,
        exist_ok: bool = False,
    ) -> Store:
        """Create a new run directory (or reopen it for appending when ``exist_ok``)."""
        run_dir = Path(path)
        if (run_dir / META_FILE).exists():
            if exist_ok:
                return cls.open(run_dir)
            raise StoreError(f"{run_dir}: a run already exists there; choose another --out")
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"{run_dir}: cannot create the run directory: {exc.strerror}") from exc
        meta = RunMeta(
            name=name or run_dir.name,
            created_ns=time.time_ns(),
            gputrace_version=__version__,
            schema_version=SCHEMA_VERSION,
            config=dict(config or {}),
            topology=dict(topology or {}),
            extra=dict(extra or {}),
        )
        con = cls._connect(run_dir, read_only=False)
        _create_missing_tables(con, temporary=False)
        con.execute("CHECKPOINT")
        store = cls(run_dir, con, meta, read_only=False)
        store._write_meta()
        return store

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, read_only: bool = False) -> Store:
        """Open an existing run; refuses a store written with a newer schema."""
        run_dir = Path(path)
        meta_path = run_dir / META_FILE
        try:
            raw = json.loads(meta_path.read_text())
        except FileNotFoundError:
            raise StoreError(f"{run_dir}: not a gputrace run (no {META_FILE})") from None
        except (OSError, ValueError, RecursionError) as exc:
            raise StoreError(f"{meta_path}: unreadable: {exc}") from exc
        if not isinstance(raw, dict):
            raise StoreError(f"{meta_path}: not a run's meta.json (a JSON object is expected, "
                             f"found {type(raw).__name__})")
        version = raw.get("schema_version")
        if not isinstance(version, int):
            raise StoreError(f"{meta_path}: schema_version missing or not an integer")
        if version > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"{run_dir}: written with store schema {version} by gputrace "
                f"{raw.get('gputrace_version', '?')}; this gputrace ({__version__}) reads up to "
                f"schema {SCHEMA_VERSION}: upgrade gputrace"
            )
        meta = _meta_from_json(raw, meta_path)
        con = cls._connect(run_dir, read_only=read_only)
        # a table added to this schema version after the run was written: empty (and in memory
        # only, when read-only)
        _create_missing_tables(con, temporary=read_only)
        return cls(run_dir, con, meta, read_only)

    @staticmethod
    def _connect(run_dir: Path, read_only: bool) -> duckdb.DuckDBPyConnection:
        path = str(run_dir / DB_FILE).replace("'", "''")
        options = f"ROW_GROUP_SIZE {ROW_GROUP_ROWS}" + (", READ_ONLY" if read_only else "")
        con = duckdb.connect()
        try:
            con.execute(f"ATTACH '{path}' AS run ({options})")
            con.execute("USE run")
        except duckdb.Error as exc:
            con.close()
            holder = re.search(r"Conflicting lock is held in .*?\(PID (\d+)\)", str(exc))
            if holder:
                raise StoreError(
                    f"{run_dir}: the run is being written by process {holder.group(1)} (a running "
                    "`gputrace collect` or `gputrace run`?): stop it with Ctrl-C, which flushes "
                    "everything, then read the run") from exc
            raise StoreError(f"{run_dir / DB_FILE}: cannot open the database: {exc}") from exc
        return con

    def close(self) -> None:
        self._con.close()
        if not self.read_only:
            (self.path / META_RESERVE_FILE).unlink(missing_ok=True)

    def reserve_meta_space(self) -> None:
        """Keep META_RESERVE_BYTES on the run's disk for the last meta.json (released when it
        cannot be written otherwise, removed on close). Written, not sparse: the blocks are held."""
        try:
            with (self.path / META_RESERVE_FILE).open("wb") as fh:
                for _ in range(META_RESERVE_BYTES >> 16):
                    fh.write(bytes(1 << 16))
        except OSError as exc:  # a disk full already: the capture says so as it writes
            (self.path / META_RESERVE_FILE).unlink(missing_ok=True)
            log.warning("no space reserved for meta.json", run=str(self.path), error=exc.strerror)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- meta ----------------------------------------------------------------------------------

    def update_meta(self, **changes: Any) -> None:
        """Replace top-level fields of meta.json (``extra`` is merged, not replaced)."""
        if "extra" in changes:
            changes["extra"] = {**self.meta.extra, **changes["extra"]}
        self.meta = dataclasses.replace(self.meta, **changes)
        self._write_meta()

    def _write_meta(self) -> None:
        tmp = self.path / (META_FILE + ".tmp")
        text = json.dumps(dataclasses.asdict(self.meta), indent=2, default=str) + "\n"
        reserve = self.path / META_RESERVE_FILE
        for last_try in (False, True):
            try:
                tmp.write_text(text)
                os.replace(tmp, self.path / META_FILE)
                return
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                if last_try or exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not reserve.exists():
                    raise StoreWriteError(f"{self.path / META_FILE}: cannot write: {exc.strerror}") from exc
                reserve.unlink()
                log.warning("disk full: meta.json written into the space reserved for it", run=str(self.path))

    def _reattach(self) -> None:
        """A fresh connection after the database was invalidated by a failed checkpoint."""
        self._con.close()
        try:
            self._con = self._connect(self.path, read_only=False)
        except StoreError as exc:
            raise StoreWriteError(str(exc)) from exc
        self._invalidated = False
        log.info("store reattached after a failed write", run=str(self.path))

    # -- writes --------------------------------------------------------------------------------

    def append(self, records: Sequence[Any], *, unique: bool = False) -> int:
        """Append records of one type as one committed batch; returns the rows written (with
        ``unique``, those whose identity the table lacked: see :meth:`append_columns`)."""
        if not records:
            return 0
        record_type = type(records[0])
        table = RECORD_TABLES.get(record_type)
        if table is None:
            raise StoreError(f"{record_type.__name__} is not a storable record type")
        names = table_columns(table)
        columns = {n: [getattr(r, n) for r in records] for n in names}
        try:
            return self.append_columns(table, columns, unique=unique)
        except _VALUE_ERRORS as exc:
            raise RecordError(f"{table}: a value cannot be stored: {exc}") from exc

    def append_valid(self, records: Sequence[Any], *, unique: bool = False
                     ) -> tuple[int, list[tuple[Any, str]]]:
        """Append what can be stored of one type's records, as one batch; returns the rows written
        and each record set aside with the reason (its value does not fit its column)."""
        try:
            return self.append(records, unique=unique), []
        except RecordError:
            pass
        schema = _arrow_schema(RECORD_TABLES[type(records[0])])
        good: list[Any] = []
        rejected: list[tuple[Any, str]] = []
        for record in records:  # only on the rare failing batch: find its bad records
            reason = _unstorable(record, schema)
            if reason is None:
                good.append(record)
            else:
                rejected.append((record, reason))
        return (self.append(good, unique=unique) if good else 0), rejected

    def append_columns(self, table: str, columns: Mapping[str, Column], *, unique: bool = False) -> int:
        """Append a batch given as columns (numpy arrays, Arrow arrays or lists); returns the rows
        written.

        A scalar str/int stands for a constant column (e.g. ``host="node0"``). Columns not given
        take the record's default (NULL for optional fields); NaN in a float column is stored as
        NULL ("not available"). With ``unique``, a row whose identity (RECORD_IDENTITY) the table
        or an earlier row of the batch holds already is not written.
        """
        schema = _arrow_schema(table)
        unknown = set(columns) - set(schema.names)
        if unknown:
            raise StoreError(f"{table}: unknown columns {sorted(unknown)}")
        lengths = {len(v) for v in columns.values() if not isinstance(v, str | int)}
        if len(lengths) != 1:
            what = f"columns differ in length: {sorted(lengths)}" if lengths else "no array column"
            raise StoreError(f"{table}: {what}")
        (n_rows,) = lengths
        # Constant columns (a scalar, or a default left out) go in as SQL constants: DuckDB
        # stores a constant vector without reading n_rows copies (measured: a 940k-row batch of
        # scheduler events appends ~15 % faster than with repeated strings).
        arrays: list[pa.Array] = []
        fields: list[pa.Field] = []
        select: list[str] = []
        params: list[Any] = []
        sql_types = dict(_schema(table))
        for f in schema:
            value = columns.get(f.name, _DEFAULTS[table].get(f.name))
            if f.name in columns and not isinstance(value, str | int):
                array = _to_arrow_column(value, f.type)
                arrays.append(array)
                fields.append(pa.field(f.name, array.type))
                select.append(f'"{f.name}"')
            else:
                select.append(f'CAST(? AS {_SQL_TYPES[sql_types[f.name]]}) AS "{f.name}"')
                params.append(value)
        batch = pa.Table.from_arrays(arrays, schema=pa.schema(fields))
        insert = f"INSERT INTO {table} SELECT {', '.join(select)} FROM _gputrace_batch"
        if unique:
            insert = _insert_new(table, select)
        if self._invalidated:
            self._reattach()
        try:
            self._con.register("_gputrace_batch", batch)
            try:
                inserted = self._con.execute(insert, params).fetchone()
            finally:
                self._con.unregister("_gputrace_batch")
        except _WRITE_FAILURES as exc:
            self._invalidated = self._invalidated or "invalidated" in str(exc)
            raise StoreWriteError(f"{self.path}: cannot write to {table}: {_first_line(exc)}") from exc
        except duckdb.Error as exc:
            raise StoreError(f"{self.path}: append to {table} failed: {exc}") from exc
        return int(inserted[0]) if unique and inserted else n_rows

    # -- reads ---------------------------------------------------------------------------------

    def arrow(self, table: str, where: str | None = None, order_by: str | None = None) -> pa.Table:
        """A whole table (optionally filtered by a SQL condition) as an Arrow table."""
        _schema(table)
        sql = f"SELECT * FROM {table}"
        if where:
            sql += f" WHERE {where}"
        if order_by:
            sql += f" ORDER BY {order_by}"
        try:
            return self._con.sql(sql).to_arrow_table()
        except duckdb.Error as exc:
            raise StoreError(f"{self.path}: reading {table} failed: {exc}") from exc

    def columns(
        self, table: str, where: str | None = None, order_by: str | None = None
    ) -> dict[str, np.ndarray]:
        """A table as numpy columns; NULLs in numeric columns become NaN (floats) or masked."""
        tbl = self.arrow(table, where, order_by)
        out: dict[str, np.ndarray] = {}
        for name in tbl.column_names:
            col = tbl.column(name)
            if pa.types.is_integer(col.type) or pa.types.is_floating(col.type):
                if col.null_count:
                    out[name] = col.to_numpy(zero_copy_only=False).astype(np.float64)
                else:
                    out[name] = col.to_numpy(zero_copy_only=False)
            else:
                out[name] = col.to_numpy(zero_copy_only=False)
        return out

    def records(self, record_type: type[R], where: str | None = None) -> list[R]:
        """A table as record objects (for small tables: markers, devices, configs)."""
        table = RECORD_TABLES[record_type]
        return [record_type(**row) for row in self.arrow(table, where).to_pylist()]

    def is_empty(self) -> bool:
        """No row in any table: nothing was captured or imported into this run."""
        return all(self.count(table) == 0 for table in _TABLE_COLUMNS)

    def discard(self) -> None:
        """Close and delete a run that holds nothing (a capture that failed to start), so the retry
        can use the same directory; a run with any row is kept. The directory itself goes only
        when nothing else is in it."""
        if not self.is_empty():
            raise StoreError(f"{self.path}: holds data; not discarded")
        self.close()
        for name in os.listdir(self.path):
            if name in (META_FILE, REJECTS_FILE) or name.startswith(DB_FILE):
                (self.path / name).unlink()
        if not os.listdir(self.path):
            self.path.rmdir()

    def imported_like(self, probe: str) -> list[ImportedFile]:
        """The ledger's files with this probe (the candidates for the same content), oldest first."""
        names = ", ".join(f.name for f in dataclasses.fields(ImportedFile))
        rows = self.sql(f"SELECT {names} FROM {IMPORTS_TABLE} WHERE probe = ? ORDER BY imported_ns", [probe])
        return [ImportedFile(*row) for row in rows]

    def record_import(self, entry: ImportedFile) -> None:
        """Add a file to the import ledger (once its rows are in)."""
        self._insert_ledger(IMPORTS_TABLE, entry)

    def _insert_ledger(self, table: str, entry: ImportedFile | ImportedStream) -> None:
        values = [getattr(entry, f.name) for f in dataclasses.fields(entry)]
        try:
            self._con.execute(f"INSERT INTO {table} VALUES ({', '.join('?' * len(values))})", values)
        except duckdb.Error as exc:
            raise StoreWriteError(f"{self.path}: cannot write the import ledger: {_first_line(exc)}") from exc

    def imported_streams(self) -> list[ImportedStream]:
        """The engine logs the ledger knows by content (a few rows per log), oldest first."""
        names = ", ".join(f.name for f in dataclasses.fields(ImportedStream))
        return [ImportedStream(*row) for row in
                self.sql(f"SELECT {names} FROM {STREAMS_TABLE} ORDER BY imported_ns")]

    def record_stream(self, entry: ImportedStream) -> None:
        """Add an engine log's fingerprint to the ledger (before its lines go in, so an import
        cut short is resumed, not doubled, by the next)."""
        self._insert_ledger(STREAMS_TABLE, entry)

    def log_sources(self) -> set[str]:
        """The names engine logs' lines are stored under, and those the ledger holds."""
        rows = self.sql(f"SELECT source FROM scheduler_events UNION SELECT source FROM engine_configs "
                        f"UNION SELECT source FROM {STREAMS_TABLE}")
        return {str(source) for (source,) in rows}

    def stored_line_numbers(self, source: str) -> np.ndarray:
        """The line numbers of ``source`` that have a row (an event or a configuration), sorted."""
        rows = self.sql_arrow("SELECT line_no FROM scheduler_events WHERE source = $1 UNION "
                              "SELECT line_no FROM engine_configs WHERE source = $1 ORDER BY 1", [source])
        return _numbers(rows, "line_no", np.int64)

    def count(self, table: str) -> int:
        _schema(table)
        rows = self._con.execute(f"SELECT count(*) FROM {table}").fetchall()
        return int(rows[0][0])

    def sql(self, query: str, params: Iterable[Any] | None = None) -> list[tuple[Any, ...]]:
        """Run SQL against the run's tables; rows as tuples."""
        try:
            return self._con.execute(query, list(params or [])).fetchall()
        except duckdb.Error as exc:
            raise StoreError(f"{self.path}: query failed: {exc}") from exc

    def sql_arrow(self, query: str, params: Iterable[Any] | None = None) -> pa.Table:
        """Run SQL; the result as an Arrow table."""
        try:
            return self._con.sql(query, params=list(params or []) or None).to_arrow_table()
        except duckdb.Error as exc:
            raise StoreError(f"{self.path}: query failed: {exc}") from exc

    # -- a run as the analysis reads it ----------------------------------------------------------

    def read_run(self, window_ns: Window = (None, None), margins: ReadMargins = DEFAULT_MARGINS,
                 engine_metric_names: Sequence[str] = ()) -> RunTables:
        """The run's rows within ``window_ns`` (collector clock; None: open) and the margins beyond
        it, as typed columns; ``engine_metric_names``: the engine metrics to read with it."""
        lo, hi = window_ns
        # DuckDB draws its own progress bar on stdout for long queries; the report has its own.
        self.sql("SET enable_progress_bar = false")
        # DuckDB keeps the blocks it read cached up to its memory limit (80 % of RAM by default):
        # reading 147 M GPU samples a time range at a time grew it by 40 MB/s past 4 GB (128 GPUs x 8 h:
        # 1.88 GB peak, 1.06 GB with this limit, as fast). What the
        # analysis reads is scanned once; its own queries aggregate to a few rows.
        self.sql(f"SET memory_limit = '{READ_MEMORY_LIMIT}'")
        return RunTables(
            meta=self.meta, source=str(self.path), window_ns=window_ns,
            clock_probes=probe_columns(self.records(ClockProbe)),
            gpu_samples=self._read_gpu_samples(lo, hi, margins.gpu_ns),
            scheduler_events=self._read_scheduler_events(
                # the lines before the window still give the state it starts in
                _within("coalesce(log_ts_ns, recv_ts_ns)", lo, hi, margins.event_ns)),
            requests=self._read_requests(_within("coalesce(end_ns, start_ns)", lo, None, margins.gpu_ns)
                                         + " AND " + _within("start_ns", None, hi, margins.gpu_ns)),
            load_gauge=self._read_load_gauge(_within("ts_ns", lo, hi, margins.event_ns)),
            markers=tuple(self.records(Marker)),
            devices=tuple(self.records(DeviceInfo)),
            engine=self.read_engine_settings(),
            engine_metrics=(self.read_engine_metrics(engine_metric_names) if engine_metric_names
                            else EngineMetricColumns()))

    def read_engine_settings(self) -> EngineSettings:
        """Every engine configuration line merged; without one, the engine whose lines the run holds."""
        configs = self.records(EngineConfig)
        engine_of_lines = None
        if not any(config.engine for config in configs):
            kinds = self.sql("SELECT engine, count(*) FROM scheduler_events "
                             "GROUP BY 1 ORDER BY 2 DESC LIMIT 1")
            engine_of_lines = kinds[0][0] if kinds else None
        return EngineSettings.from_records(configs, engine_of_lines)

    def read_engine_metrics(self, names: Sequence[str]) -> EngineMetricColumns:
        """The engine metric samples of these names (every host, every time)."""
        tbl = self.sql_arrow("SELECT host, name, labels_json, ts_ns, value FROM engine_metrics "
                             "WHERE list_contains(?, name)", [list(names)])
        return EngineMetricColumns(_objects(tbl, "host"), _objects(tbl, "name"), _objects(tbl, "labels_json"),
                                   _numbers(tbl, "ts_ns", np.int64), _numbers(tbl, "value"))

    def set_receive_times(self, source: str, line_no: np.ndarray, recv_ts_ns: np.ndarray) -> None:
        """Set ``recv_ts_ns`` of the scheduler events of ``source`` by their line number."""
        batch = pa.table({"line_no": pa.array(line_no, pa.int64()),
                          "recv_ts_ns": pa.array(recv_ts_ns, pa.int64())})
        try:
            self._con.register("_gputrace_recv", batch)
            try:
                self._con.execute("UPDATE scheduler_events SET recv_ts_ns = r.recv_ts_ns "
                                  "FROM _gputrace_recv AS r WHERE scheduler_events.line_no = r.line_no "
                                  "AND scheduler_events.source = ?", [source])
            finally:
                self._con.unregister("_gputrace_recv")
        except duckdb.Error as exc:
            raise StoreError(f"{self.path}: setting receive times failed: {exc}") from exc

    def replace_markers(self, host: str, markers: Sequence[Marker]) -> int:
        """Put ``markers`` in place of the markers of ``host`` (one commit): markers derived anew
        from more of the same data (a Prometheus range grown by another import)."""
        try:
            self._con.execute("BEGIN TRANSACTION")
            try:
                self._con.execute("DELETE FROM markers WHERE host = ?", [host])
                written = self.append(list(markers)) if markers else 0
            except BaseException:
                self._con.execute("ROLLBACK")
                raise
            self._con.execute("COMMIT")
        except duckdb.Error as exc:
            raise StoreWriteError(f"{self.path}: replacing the markers failed: {_first_line(exc)}") from exc
        return written

    def shift_log_times(self, host: str, source: str, by_ns: int) -> int:
        """Move the logged stamps of one log's lines (scheduler events, engine configs) back by
        ``by_ns``: a log written in a zone it was not read in (gputrace.log_clock). Returns the
        scheduler events moved."""
        try:
            moved = [self._con.execute(f"UPDATE {table} SET log_ts_ns = log_ts_ns - ? "
                                       "WHERE host = ? AND source = ? AND log_ts_ns IS NOT NULL",
                                       [by_ns, host, source]).fetchone()
                     for table in ("engine_configs", "scheduler_events")]
        except duckdb.Error as exc:
            raise StoreWriteError(f"{self.path}: correcting the log's stamps failed: "
                                  f"{_first_line(exc)}") from exc
        return int((moved[-1] or (0,))[0])

    def target_concurrency_of(self, source: str) -> list[tuple[int, float]]:
        """(ts_ns, target_concurrency) of the load samples of ``source`` that name a target (an
        earlier Prometheus range's load, which a later one's markers are drawn beside)."""
        return [(int(ts), float(c)) for ts, c in self.sql(
            "SELECT ts_ns, target_concurrency FROM load_samples WHERE source = ? "
            "AND target_concurrency IS NOT NULL", [source])]

    def log_and_receive_times(self) -> pa.Table:
        """host, source, log_ts_ns and recv_ts_ns of the scheduler events that have both (the
        lines a collector received), for the log clock check (gputrace.log_clock)."""
        try:
            return self._con.sql("SELECT host, source, log_ts_ns, recv_ts_ns FROM scheduler_events "
                                 "WHERE log_ts_ns IS NOT NULL AND recv_ts_ns IS NOT NULL").to_arrow_table()
        except duckdb.Error as exc:
            raise StoreError(f"{self.path}: reading receive times failed: {exc}") from exc

    def _read_gpu_samples(self, lo: int | None, hi: int | None, margin_ns: int) -> StoreGpuSamples:
        return StoreGpuSamples(self, _within("ts_ns", lo, hi, margin_ns))

    def _read_scheduler_events(self, where: str) -> StoreSchedulerEvents:
        return StoreSchedulerEvents(self, where)

    def _read_requests(self, where: str) -> RequestColumns:
        numbers = ("start_ns", "first_token_ns", "end_ns", "prompt_tokens", "completion_tokens")
        rq = self.sql_arrow(f"SELECT host, {', '.join(numbers)}, ok, coalesce(phase, '') AS phase, "
                            "starts_with(coalesce(error, ''), ?) AS abandoned "
                            f"FROM requests WHERE {where}", [ABANDONED_PREFIX])
        return RequestColumns(
            host=_objects(rq, "host"), **{c: _numbers(rq, c) for c in numbers},
            ok=np.asarray(rq.column("ok").to_pylist(), dtype=bool), phase=_objects(rq, "phase"),
            abandoned=np.asarray(rq.column("abandoned").to_pylist(), dtype=bool))

    def _read_load_gauge(self, where: str) -> LoadGaugeColumns:
        gauge = self.sql_arrow("SELECT ts_ns, inflight_requests, source FROM load_samples "
                               f"WHERE inflight_requests IS NOT NULL AND {where} ORDER BY ts_ns")
        return LoadGaugeColumns(_numbers(gauge, "ts_ns", np.int64), _numbers(gauge, "inflight_requests"),
                                _objects(gauge, "source"))

    def export_parquet(self, out_dir: str | os.PathLike[str]) -> list[Path]:
        """Write each table as ``<table>.parquet`` into ``out_dir``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for table in _TABLE_COLUMNS:
            target = out / f"{table}.parquet"
            self._con.execute(f"COPY {table} TO '{target}' (FORMAT parquet)")
            written.append(target)
        return written


class StoreSchedulerEvents:
    """The engine log lines alignment places (attention-TP rank 0's decode, prefill and stats
    lines within a window), read from the database when asked: the columns that place them, then
    one stage's at a time (SchedulerEvents), streamed in batches into numeric columns (codes for
    the text), in the table's insertion order (DuckDB keeps it for a filtered scan). A 2 GiB log's
    13 M lines held every column of every line and their object strings at once: 12 GB."""

    _PLACEMENT = ("host_code", "source_code", "line_no", "log_ts_ns", "ts_resolution_ns", "recv_ts_ns",
                  "pp_rank")
    _STAGE = ("kind_code", "dp_rank", "running_req", "queue_req", "token_usage", "gen_throughput_tok_s",
              "new_seq", "new_token", "cached_token", "input_throughput_tok_s")

    def __init__(self, store: Store, where: str):
        self._store = store
        kinds = ", ".join(f"'{k}'" for k in EVENT_KINDS)
        self._where = f"coalesce(tp_rank, 0) = 0 AND kind IN ({kinds}) AND {where}"
        text = store.sql_arrow("SELECT host, source, count(*) AS n FROM scheduler_events "
                               f"WHERE {self._where} GROUP BY host, source")
        self.host_names = tuple(sorted({str(h) for h in text.column("host").to_pylist()}))
        self.source_names = tuple(sorted({str(src) for src in text.column("source").to_pylist()}))
        self._n = int(sum(text.column("n").to_pylist()))

    def __len__(self) -> int:
        return self._n

    def placement(self) -> SchedulerEventColumns:
        return self._read(self._PLACEMENT, self._where, self._n)

    def stage_rows(self, pp_rank: int) -> SchedulerEventColumns:
        where = f"{self._where} AND coalesce(pp_rank, 0) = {int(pp_rank)}"
        (n,) = self._store.sql(f"SELECT count(*) FROM scheduler_events WHERE {where}")[0]
        return self._read(self._STAGE, where, int(n))

    def _read(self, names: tuple[str, ...], where: str, n: int) -> SchedulerEventColumns:
        dtypes = event_column_dtypes()
        out = {name: np.empty(n, dtype=dtypes[name]) for name in names}
        kind_code = " ".join(f"WHEN '{k}' THEN {i}" for i, k in enumerate(EVENT_KINDS))
        exprs = {"host_code": "(list_position($hosts, host) - 1)::INTEGER",
                 "source_code": "(list_position($sources, source) - 1)::INTEGER",
                 "kind_code": f"(CASE kind {kind_code} END)::TINYINT"}
        select = ", ".join(f"{exprs.get(name, name)} AS {name}" for name in names)
        params = {"hosts": list(self.host_names), "sources": list(self.source_names)}
        params = {k: v for k, v in params.items() if f"${k}" in select}
        filled = 0
        try:
            rel = self._store._con.sql(f"SELECT {select} FROM scheduler_events WHERE {where}", params=params)
            for batch in rel.to_arrow_reader(ROW_GROUP_ROWS * 4):
                end = filled + batch.num_rows
                if end > n:
                    raise StoreError(f"{self._store.path}: the engine log lines changed while they were read")
                for name, arr in out.items():
                    col = batch.column(name)
                    arr[filled:end] = col.to_numpy(zero_copy_only=False) if not col.null_count else \
                        col.cast(pa.float64(), safe=False).fill_null(np.nan).to_numpy(zero_copy_only=False)
                filled = end
        except duckdb.Error as exc:
            raise StoreError(f"{self._store.path}: query failed: {exc}") from exc
        return SchedulerEventColumns(self.host_names, self.source_names,
                                     **{name: arr[:filled] for name, arr in out.items()})


class StoreGpuSamples:
    """A run's GPU samples within a window, read from the database a time range at a time
    (``between``): 512 GPUs x 8 h at 10 Hz are 147 M rows, 11 GB as numpy columns. Each row's GPU
    comes back as a dense id ``k`` into ``keys`` (sorted by host, gpu_index), computed in SQL so
    no strings cross per row. The store must stay open while it is read."""

    def __init__(self, store: Store, where: str):
        self._store = store
        self._where = where
        ext = store.sql_arrow(
            "SELECT host, gpu_index, min(ts_ns) AS first_ts_ns, max(ts_ns) AS last_ts_ns, count(*) AS n "
            f"FROM gpu_samples WHERE {where} GROUP BY host, gpu_index ORDER BY host, gpu_index")
        self.keys = tuple((str(h), int(g)) for h, g in zip(ext.column("host").to_pylist(),
                                                           ext.column("gpu_index").to_pylist(), strict=True))
        self._extents = GpuExtents(_numbers(ext, "first_ts_ns", np.int64),
                                   _numbers(ext, "last_ts_ns", np.int64), _numbers(ext, "n", np.int64))
        self._keys_table = pa.table({"host": pa.array([h for h, _ in self.keys], pa.string()),
                                     "gpu_index": pa.array([g for _, g in self.keys], pa.int64()),
                                     "k": pa.array(np.arange(len(self.keys)), pa.int64())})

    def __len__(self) -> int:
        return int(self._extents.count.sum())

    def extents(self) -> GpuExtents:
        return self._extents

    def between(self, lo_ns: int | None, hi_ns: int | None) -> GpuSampleColumns:
        cols = ", ".join(f"s.{m}" for m in GPU_METRICS)
        con = self._store._con
        try:
            con.register("_gputrace_gpu_keys", self._keys_table)
            try:
                samples = con.sql(
                    f"SELECT k.k, s.ts_ns, s.lost, {cols} FROM gpu_samples s "
                    f"JOIN _gputrace_gpu_keys k USING (host, gpu_index) "
                    f"WHERE {_within('s.ts_ns', lo_ns, hi_ns, 0)} AND "
                    f"{self._where.replace('ts_ns', 's.ts_ns')}").to_arrow_table()
            finally:
                con.unregister("_gputrace_gpu_keys")
        except duckdb.Error as exc:
            raise StoreError(f"{self._store.path}: query failed: {exc}") from exc
        lost = np.asarray(samples.column("lost").to_numpy(zero_copy_only=False), dtype=bool)
        metrics = {m: _numbers(samples, m) for m in GPU_METRICS}
        return GpuSampleColumns(self.keys, _numbers(samples, "k", np.int64),
                                _numbers(samples, "ts_ns", np.int64), lost, **metrics)


# Per record type, rows kept in memory while the store cannot be written. A GpuSample with its
# fields set takes 540 bytes there (tracemalloc, 100k samples), so a full backlog of samples is
# about 135 MB: 5 minutes of 8 GPUs at 100 Hz.
MAX_BACKLOG_ROWS = 250_000
_WRITE_RETRY = Backoff(initial_s=0.25, max_s=5.0)  # a disk freed is written to within 5 s
# A record's own time, by the first of these fields its type has (the collector's receive time of
# an engine line before the engine's stamp, which a log may lack).
_RECORD_TIME_FIELDS = ("recv_ts_ns", "ts_ns", "start_ns", "local_send_ns", "log_ts_ns")


class StoreOutage(TypedDict):
    """A spell of failed writes, as meta.json's ``collector.store_outages`` holds it: a recovered
    one with its attempts and the records dropped, one still failing at the stop (``until_ns``
    None) with the rows its backlog lost."""

    error: str | None
    since_ns: int | None
    until_ns: int | None
    attempts: NotRequired[int]
    dropped: NotRequired[dict[str, int]]
    lost_rows: NotRequired[int]


class UnwrittenRows(TypedDict):
    """One record type's rows left in the backlog (meta.json's ``collector.unwritten_records``):
    how many, and the span of their own times where they carry one."""

    rows: int
    time_field: NotRequired[str]
    first_ns: NotRequired[int]
    last_ns: NotRequired[int]


class WriterHealth(TypedDict):
    """The writer's state, as /healthz and /v1/status give it."""

    writing: bool
    error: str | None
    failing_since_ns: int | None
    backlog_rows: int
    max_backlog_rows: int
    dropped: dict[str, int]
    rows_written: int
    rejected: dict[str, int]


class BatchingWriter:
    """Buffers records per type and appends them to the store at most every ``flush_s``.

    The collector calls :meth:`add` as data arrives and :meth:`maybe_flush` on a timer; at most
    ``flush_s`` of data is lost if the process is killed. When the store cannot be written (a full
    disk) the buffers stay as a backlog and the write is retried with back-off; each type's backlog
    holds at most ``max_backlog_rows``, and rows past it are dropped and counted in ``dropped``.
    Once a write succeeds the backlog goes in and the writer carries on.
    """

    def __init__(self, store: Store, flush_s: float = 0.5, max_rows: int = 50_000,
                 on_reject: typing.Callable[[Any, str], None] | None = None,
                 max_backlog_rows: int = MAX_BACKLOG_ROWS, retry: Backoff = _WRITE_RETRY):
        self.store = store
        self.flush_s = flush_s
        self.max_rows = max_rows
        self.max_backlog_rows = max(max_backlog_rows, max_rows)
        self.on_reject = on_reject
        self.retry = retry
        self._buffers: dict[type, list[Any]] = {}
        self._last_flush = time.monotonic()
        self.rows_written = 0
        self.rejected: dict[str, int] = {}  # per record type: set aside, not stored
        self.dropped: dict[str, int] = {}  # per record type: past the backlog while writes failed
        self.write_error: str | None = None  # why writing fails, while it does
        self.failing_since_ns: int | None = None
        self.outages: list[StoreOutage] = []  # every spell of failed writes, for meta.json
        self._failed_attempts = 0
        self._retry_at = 0.0  # monotonic time of the next attempt while failing
        self._dropping: set[str] = set()  # record types dropped in this spell (logged once each)

    @property
    def backlog_rows(self) -> int:
        return sum(len(buf) for buf in self._buffers.values())

    def add(self, record: Any) -> None:
        buf = self._buffers.setdefault(type(record), [])
        if len(buf) >= self.max_backlog_rows:
            self._drop(record)
            return
        buf.append(record)
        # while writes fail the back-off decides when to try again, not every add
        if len(buf) >= self.max_rows and self.write_error is None:
            self.flush()

    def add_many(self, records: Iterable[Any]) -> None:
        for record in records:
            self.add(record)

    def maybe_flush(self) -> None:
        now = time.monotonic()
        if self.write_error is not None:
            due = now >= self._retry_at
        else:
            due = now - self._last_flush >= self.flush_s
        if due:
            self.flush()

    def flush(self, *, every_type: bool = False) -> bool:
        """Append every buffer; False when the store could not be written (the rest stays buffered
        for the next attempt; ``every_type``: each type is still tried, as the last flush of a
        capture does, so what fits goes in). A record whose value cannot be stored is set aside
        (counted in ``rejected``, handed to ``on_reject``, written to the run's rejects file) and
        the rest of its batch is written: one bad value must not stop the writer (it did: the
        batch stayed in the buffer, every later flush failed on it)."""
        failed = False
        for buf in self._buffers.values():
            if not buf:
                continue
            try:
                written, rejected = self.store.append_valid(buf)
            except StoreWriteError as exc:
                self._write_failed(exc)
                if not every_type:
                    return False
                failed = True
                continue
            self.rows_written += written
            buf.clear()
            for record, reason in rejected:
                self._reject(record, reason)
        if failed:
            return False
        self._last_flush = time.monotonic()
        if self.write_error is not None:
            self._write_recovered()
        return True

    def unwritten(self) -> dict[str, UnwrittenRows]:
        """What the backlog holds, per record type: its rows and the span of their own times
        (``first_ns``/``last_ns`` of ``time_field``, in the clock of the host that made them), for
        meta.json when a capture stops before it could write them."""
        out: dict[str, UnwrittenRows] = {}
        for record_type, buf in self._buffers.items():
            if not buf:
                continue
            entry: UnwrittenRows = {"rows": len(buf)}
            field_name = next((f for f in _RECORD_TIME_FIELDS if hasattr(buf[0], f)), None)
            times: list[int] = [t for r in buf if (t := getattr(r, field_name)) is not None] \
                if field_name else []
            if field_name and times:
                entry.update({"time_field": field_name, "first_ns": min(times), "last_ns": max(times)})
            out[record_type.__name__] = entry
        return out

    def health(self) -> WriterHealth:
        """The writer's state for /healthz and /v1/status."""
        return {"writing": self.write_error is None, "error": self.write_error,
                "failing_since_ns": self.failing_since_ns, "backlog_rows": self.backlog_rows,
                "max_backlog_rows": self.max_backlog_rows, "dropped": dict(self.dropped),
                "rows_written": self.rows_written, "rejected": dict(self.rejected)}

    def _write_failed(self, exc: StoreWriteError) -> None:
        delay_s = self.retry.delay_s(self._failed_attempts)
        self._failed_attempts += 1
        self._retry_at = time.monotonic() + delay_s
        if self.write_error is None:
            self.failing_since_ns = time.time_ns()
            log.error("store not writable: keeping records in memory and retrying", error=str(exc),
                      backlog_rows=self.backlog_rows, max_backlog_rows=self.max_backlog_rows)
        self.write_error = str(exc)

    def _write_recovered(self) -> None:
        since = self.failing_since_ns or time.time_ns()
        outage: StoreOutage = {"error": self.write_error, "since_ns": since, "until_ns": time.time_ns(),
                               "attempts": self._failed_attempts, "dropped": dict(self.dropped)}
        self.outages.append(outage)
        log.info("store writable again: backlog written", failed_s=round((time.time_ns() - since) / 1e9, 1),
                 attempts=self._failed_attempts, dropped=sum(self.dropped.values()))
        self.write_error = self.failing_since_ns = None
        self._failed_attempts = 0
        self._retry_at = 0.0
        self._dropping.clear()

    def _drop(self, record: Any) -> None:
        name = type(record).__name__
        if name not in self._dropping:
            self._dropping.add(name)
            log.error("store backlog full: records dropped until the store is writable", record_type=name,
                      max_backlog_rows=self.max_backlog_rows, error=self.write_error)
        self.dropped[name] = self.dropped.get(name, 0) + 1

    def _reject(self, record: Any, reason: str) -> None:
        name = type(record).__name__
        self.rejected[name] = self.rejected.get(name, 0) + 1
        try:
            with (self.store.path / REJECTS_FILE).open("a", encoding="utf-8") as fh:
                fh.write(json.dumps({"type": name, "reason": reason, "record": ascii(record)}) + "\n")
        except OSError as exc:  # counted all the same; the file is only the details
            if self.rejected[name] == 1:
                log.warning("rejects file not written", file=str(self.store.path / REJECTS_FILE),
                            error=exc.strerror)
        if self.on_reject is not None:
            self.on_reject(record, reason)
