"""A run read into typed numpy columns: what the store hands the analysis (``Store.read_run``), and
what tests build in memory. Times are epoch ns in the producing host's clock, as stored; NaN in a
float column means "not available" (a NULL in the store).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from gputrace.engines import Engine, engine_kind, engine_words, sglang
from gputrace.json_types import JsonObject
from gputrace.model import ClockProbe, DeviceInfo, EngineConfig, Marker, RunMeta

GPU_METRICS = ("utilization_ratio", "power_w", "pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s",
               "sm_clock_hz", "clock_event_reasons", "sm_active_ratio")
EVENT_KINDS = ("decode", "prefill", "stats")  # the scheduler lines alignment places

Window = tuple[int | None, int | None]  # collector clock; None: open


@dataclass(frozen=True, slots=True)
class ReadMargins:
    """How far beyond a window's edges rows are read."""

    gpu_ns: int = 2_000_000_000  # host clocks and NVML windows reach over the edges
    event_ns: int = 60_000_000_000  # log lines before the window give the state it starts in


DEFAULT_MARGINS = ReadMargins()


def _empty(dtype: type | str) -> np.ndarray:
    return np.zeros(0, dtype=dtype)


@dataclass(frozen=True)
class ClockProbeColumns:
    host: np.ndarray = field(default_factory=lambda: _empty(object))
    local_send_ns: np.ndarray = field(default_factory=lambda: _empty(np.int64))
    remote_ns: np.ndarray = field(default_factory=lambda: _empty(np.int64))
    local_recv_ns: np.ndarray = field(default_factory=lambda: _empty(np.int64))

    def __len__(self) -> int:
        return len(self.host)


@dataclass(frozen=True)
class GpuSampleColumns:
    """GPU samples, each row's GPU as a dense id ``k`` into ``keys`` (sorted by host, gpu_index)."""

    keys: tuple[tuple[str, int], ...] = ()
    k: np.ndarray = field(default_factory=lambda: _empty(np.int64))
    ts_ns: np.ndarray = field(default_factory=lambda: _empty(np.int64))
    lost: np.ndarray = field(default_factory=lambda: _empty(bool))
    utilization_ratio: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    power_w: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    pcie_tx_bytes_per_s: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    pcie_rx_bytes_per_s: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    sm_clock_hz: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    clock_event_reasons: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    sm_active_ratio: np.ndarray = field(default_factory=lambda: _empty(np.float64))

    def __len__(self) -> int:
        return len(self.ts_ns)

    def metric(self, name: str) -> np.ndarray:
        """One of GPU_METRICS' columns."""
        if name not in GPU_METRICS:
            raise KeyError(name)
        return np.asarray(getattr(self, name))

    def extents(self) -> GpuExtents:
        """Per GPU (by ``k``): its first and last sample time and its number of rows."""
        n = len(self.keys)
        count = np.bincount(self.k, minlength=n).astype(np.int64) if len(self.k) else np.zeros(n, np.int64)
        first = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
        last = np.full(n, np.iinfo(np.int64).min, dtype=np.int64)
        np.minimum.at(first, self.k, self.ts_ns)
        np.maximum.at(last, self.k, self.ts_ns)
        return GpuExtents(first, last, count)

    def between(self, lo_ns: int | None, hi_ns: int | None) -> GpuSampleColumns:
        """The rows with ``lo_ns <= ts_ns <= hi_ns`` (host clock; None: open), keys unchanged."""
        if lo_ns is None and hi_ns is None:
            return self
        sel = np.ones(len(self.ts_ns), dtype=bool)
        if lo_ns is not None:
            sel &= self.ts_ns >= lo_ns
        if hi_ns is not None:
            sel &= self.ts_ns <= hi_ns
        return dataclasses.replace(self, **{f.name: getattr(self, f.name)[sel]
                                            for f in dataclasses.fields(self) if f.name != "keys"})


@dataclass(frozen=True)
class GpuExtents:
    """Per GPU (indexed like ``keys``): first and last sample time (host clock) and row count."""

    first_ts_ns: np.ndarray
    last_ts_ns: np.ndarray
    count: np.ndarray


class GpuSamples(Protocol):
    """A run's GPU samples as alignment reads them: a time range at a time, so a run of hundreds
    of GPUs over hours is never in memory at once (the store streams them from its database;
    GpuSampleColumns holds them in memory)."""

    @property
    def keys(self) -> tuple[tuple[str, int], ...]: ...

    def __len__(self) -> int: ...

    def extents(self) -> GpuExtents: ...

    def between(self, lo_ns: int | None, hi_ns: int | None) -> GpuSampleColumns: ...


@dataclass(frozen=True)
class SchedulerEventColumns:
    """Attention-TP rank 0's decode, prefill and stats lines, every column numeric: the text ones
    as dictionary codes (``host_code`` into ``host_names``, ``source_code`` into ``source_names``,
    ``kind_code`` into EVENT_KINDS), counts and ranks as float32 (exact to 2**24), the rest float64;
    NaN: NULL. A string object per line and text column took 60 bytes a line; a 13.8 M-line log
    held 12 GB ([robust] item 9)."""

    host_names: tuple[str, ...] = ()
    source_names: tuple[str, ...] = ()
    host_code: np.ndarray = field(default_factory=lambda: _empty(np.int32))
    source_code: np.ndarray = field(default_factory=lambda: _empty(np.int32))
    kind_code: np.ndarray = field(default_factory=lambda: _empty(np.int8))
    line_no: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    log_ts_ns: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    ts_resolution_ns: np.ndarray = field(default_factory=lambda: _empty(np.float32))
    recv_ts_ns: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    dp_rank: np.ndarray = field(default_factory=lambda: _empty(np.float32))
    pp_rank: np.ndarray = field(default_factory=lambda: _empty(np.float32))
    running_req: np.ndarray = field(default_factory=lambda: _empty(np.float32))
    queue_req: np.ndarray = field(default_factory=lambda: _empty(np.float32))
    token_usage: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    gen_throughput_tok_s: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    new_seq: np.ndarray = field(default_factory=lambda: _empty(np.float32))
    new_token: np.ndarray = field(default_factory=lambda: _empty(np.float32))
    cached_token: np.ndarray = field(default_factory=lambda: _empty(np.float32))
    input_throughput_tok_s: np.ndarray = field(default_factory=lambda: _empty(np.float64))

    def __len__(self) -> int:  # placement and stage reads fill different columns
        return max(len(self.kind_code), len(self.line_no))

    @classmethod
    def from_text(cls, host: Sequence[str], source: Sequence[str], kind: Sequence[str],
                  **numbers: Sequence[float]) -> SchedulerEventColumns:
        """Columns from text values (tests, in-memory runs): the text dictionary-encoded, each
        number column in its dtype."""
        host_names, host_code = np.unique(np.asarray(host, dtype=object).astype(str), return_inverse=True)
        source_names, source_code = np.unique(np.asarray(source, dtype=object).astype(str),
                                              return_inverse=True)
        kind_of = {k: i for i, k in enumerate(EVENT_KINDS)}
        dtypes = event_column_dtypes()
        return cls(tuple(map(str, host_names)), tuple(map(str, source_names)), host_code.astype(np.int32),
                   source_code.astype(np.int32), np.array([kind_of[k] for k in kind], dtype=np.int8),
                   **{name: np.asarray(v, dtype=dtypes[name]) for name, v in numbers.items()})

    @property
    def kind(self) -> np.ndarray:
        """Each line's kind as text (an object array of EVENT_KINDS' three strings)."""
        return np.asarray(np.asarray(EVENT_KINDS, dtype=object)[self.kind_code])

    def placement(self) -> SchedulerEventColumns:
        return self

    def stage_rows(self, pp_rank: int) -> SchedulerEventColumns:
        sel = np.nan_to_num(self.pp_rank, nan=0) == pp_rank
        return dataclasses.replace(self, **{name: getattr(self, name)[sel] for name in event_column_dtypes()})


class SchedulerEvents(Protocol):
    """A run's engine log lines as alignment reads them: first the columns that place them in
    time (``placement``: host and source codes, line_no, the times, pp_rank), then one stage's
    lines at a time (``stage_rows``: kind, dp_rank and the values), each in the order
    ``placement`` gave them. Columns a step does not need may be empty. The store reads each from
    its database, so a 13 M-line log is never in memory as every column of every line at once;
    SchedulerEventColumns holds them in memory."""

    def __len__(self) -> int: ...

    def placement(self) -> SchedulerEventColumns: ...

    def stage_rows(self, pp_rank: int) -> SchedulerEventColumns: ...


def event_column_dtypes() -> dict[str, np.dtype[Any]]:
    """SchedulerEventColumns' array columns and the dtype of each."""
    empty = SchedulerEventColumns()
    return {f.name: getattr(empty, f.name).dtype for f in dataclasses.fields(SchedulerEventColumns)
            if isinstance(getattr(empty, f.name), np.ndarray)}


@dataclass(frozen=True)
class RequestColumns:
    """Client requests (times in the client host's clock; NaN: not reached)."""

    host: np.ndarray = field(default_factory=lambda: _empty(object))
    start_ns: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    first_token_ns: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    end_ns: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    prompt_tokens: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    completion_tokens: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    ok: np.ndarray = field(default_factory=lambda: _empty(bool))
    phase: np.ndarray = field(default_factory=lambda: _empty(object))  # "" when unlabelled
    abandoned: np.ndarray = field(default_factory=lambda: _empty(bool))  # the client stopped waiting

    def __len__(self) -> int:
        return len(self.host)


@dataclass(frozen=True)
class LoadGaugeColumns:
    """Samples of requests in flight (collector clock), in time order."""

    ts_ns: np.ndarray = field(default_factory=lambda: _empty(np.int64))
    inflight_requests: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    source: np.ndarray = field(default_factory=lambda: _empty(object))

    def __len__(self) -> int:
        return len(self.ts_ns)


@dataclass(frozen=True)
class EngineMetricColumns:
    """Samples of the engine's own metrics, as ``engine_metrics`` holds them."""

    host: np.ndarray = field(default_factory=lambda: _empty(object))
    name: np.ndarray = field(default_factory=lambda: _empty(object))
    labels_json: np.ndarray = field(default_factory=lambda: _empty(object))
    ts_ns: np.ndarray = field(default_factory=lambda: _empty(np.int64))
    value: np.ndarray = field(default_factory=lambda: _empty(np.float64))

    def __len__(self) -> int:
        return len(self.ts_ns)

    def as_mapping(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


_T = TypeVar("_T")
_SETTING_NAMES = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name != "fields_json")


@dataclass(frozen=True)
class EngineSettings:
    """The engine's configuration as its log gave it: every config line merged (later lines win,
    a missing value never overrides one), and ``fields``, every logged field by its engine name,
    once any line was read."""

    host: str | None = None
    source: str | None = None
    engine: str | None = None  # "sglang" | "vllm" | ...
    line_no: int | None = None
    log_ts_ns: int | None = None
    pp_size: int | None = None
    tp_size: int | None = None
    dp_size: int | None = None
    max_running_requests: int | None = None
    pp_max_micro_batch_size: int | None = None
    pp_async_batch_depth: int | None = None
    chunked_prefill_size: int | None = None
    max_total_num_tokens: int | None = None
    decode_log_interval: int | None = None
    fields: JsonObject | None = None  # as logged (EngineConfig.fields_json); None: no configuration line

    @classmethod
    def from_records(cls, configs: Sequence[EngineConfig], engine_of_lines: str | None = None
                     ) -> EngineSettings:
        """Merge configuration lines in line order; ``engine_of_lines`` (the engine whose scheduler
        lines the run holds most of) names the engine when no line did."""
        ordered = sorted(configs, key=lambda c: c.line_no)

        def latest(value: Callable[[EngineConfig], _T | None]) -> _T | None:
            return next((v for c in reversed(ordered) if (v := value(c)) is not None), None)

        fields: JsonObject | None = None
        for config in ordered:
            fields = {} if fields is None else fields
            with contextlib.suppress(ValueError):
                logged = json.loads(config.fields_json or "{}")
                if isinstance(logged, dict):
                    fields.update(logged)
        engine = latest(lambda c: c.engine)
        return cls(
            host=latest(lambda c: c.host), source=latest(lambda c: c.source),
            engine=engine_of_lines if engine is None else engine, line_no=latest(lambda c: c.line_no),
            log_ts_ns=latest(lambda c: c.log_ts_ns), pp_size=latest(lambda c: c.pp_size),
            tp_size=latest(lambda c: c.tp_size), dp_size=latest(lambda c: c.dp_size),
            max_running_requests=latest(lambda c: c.max_running_requests),
            pp_max_micro_batch_size=latest(lambda c: c.pp_max_micro_batch_size),
            pp_async_batch_depth=latest(lambda c: c.pp_async_batch_depth),
            chunked_prefill_size=latest(lambda c: c.chunked_prefill_size),
            max_total_num_tokens=latest(lambda c: c.max_total_num_tokens),
            decode_log_interval=latest(lambda c: c.decode_log_interval), fields=fields)

    def settings(self) -> dict[str, str | int]:
        """The settings the log gave (not the logged fields), by name: what a report's summary lists."""
        return {name: value for name in _SETTING_NAMES if (value := getattr(self, name)) is not None}

    @property
    def kind(self) -> str:
        """"sglang" or "vllm" (SGLang when the log named neither)."""
        return engine_kind(self.engine)

    @property
    def engine_spec(self) -> Engine:
        """The run's engine as gputrace/engines/ registers it: its knobs, words and rules."""
        return engine_words(self.kind)

    @property
    def runs_on_cpu(self) -> bool:
        """Whether the log states a CPU device (SGLang's ``device``, vLLM's ``device_config``)."""
        fields = self.fields or {}
        return any(str(fields.get(key) or "").lower() == "cpu" for key in ("device", "device_config"))

    @property
    def admission_limit(self) -> int | None:
        """The engine-wide admission limit: SGLang's request pool (max_running_requests), vLLM's
        max_num_seqs (logged under the same name); None where not logged."""
        return int(self.max_running_requests) if self.max_running_requests else None

    def slots_at(self, pp_size: int) -> int:
        """SGLang's micro-batch slots under PP: pp_size + pp_async_batch_depth (0 where not logged).
        ``pp_size`` is the run's (the log's ranks where its configuration line did not say)."""
        return sglang.slot_count(pp_size, self.pp_async_batch_depth)

    @property
    def slot_count(self) -> int | None:
        """``slots_at`` the logged pp_size; None where the log did not state it."""
        return None if self.pp_size is None else self.slots_at(self.pp_size)

    def microbatch_cap_at(self, pp_size: int) -> int | None:
        """SGLang's micro-batch cap K: --pp-max-micro-batch-size where set, else its default
        max(max_running_requests // pp_size, 1); None where neither is logged."""
        if self.pp_max_micro_batch_size:
            return int(self.pp_max_micro_batch_size)
        limit = self.admission_limit
        return None if limit is None else sglang.default_microbatch_cap(limit, pp_size)


@dataclass(frozen=True)
class RunTables:
    """One run (or a window of it) as alignment reads it."""

    meta: RunMeta
    source: str  # where the run came from, for messages (the store's path)
    window_ns: Window = (None, None)
    clock_probes: ClockProbeColumns = field(default_factory=ClockProbeColumns)
    gpu_samples: GpuSamples = field(default_factory=GpuSampleColumns)
    scheduler_events: SchedulerEvents = field(default_factory=SchedulerEventColumns)
    requests: RequestColumns = field(default_factory=RequestColumns)
    load_gauge: LoadGaugeColumns = field(default_factory=LoadGaugeColumns)
    markers: tuple[Marker, ...] = ()
    devices: tuple[DeviceInfo, ...] = ()
    engine: EngineSettings = field(default_factory=EngineSettings)
    engine_metrics: EngineMetricColumns = field(default_factory=EngineMetricColumns)


class RunSource(Protocol):
    """What reads a run into RunTables (the store does; analysis depends on this, not on it)."""

    @property
    def meta(self) -> RunMeta: ...

    def read_run(self, window_ns: Window = (None, None), margins: ReadMargins = DEFAULT_MARGINS,
                 engine_metric_names: Sequence[str] = ()) -> RunTables: ...

    def read_engine_metrics(self, names: Sequence[str]) -> EngineMetricColumns: ...


def probe_columns(probes: Sequence[ClockProbe]) -> ClockProbeColumns:
    """Clock probes as columns (tests and in-memory runs)."""
    return ClockProbeColumns(
        np.asarray([p.host for p in probes], dtype=object),
        np.asarray([p.local_send_ns for p in probes], dtype=np.int64),
        np.asarray([p.remote_ns for p in probes], dtype=np.int64),
        np.asarray([p.local_recv_ns for p in probes], dtype=np.int64))
