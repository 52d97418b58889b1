"""A run read into typed numpy columns: what the store hands the analysis (``Store.read_run``), and
what tests build in memory. Times are epoch ns in the producing host's clock, as stored; NaN in a
float column means "not available" (a NULL in the store).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

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


@dataclass(frozen=True)
class SchedulerEventColumns:
    """Attention-TP rank 0's decode, prefill and stats lines; integer columns as float (NaN: NULL)."""

    host: np.ndarray = field(default_factory=lambda: _empty(object))
    source: np.ndarray = field(default_factory=lambda: _empty(object))
    kind: np.ndarray = field(default_factory=lambda: _empty(object))
    line_no: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    log_ts_ns: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    ts_resolution_ns: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    recv_ts_ns: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    dp_rank: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    pp_rank: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    running_req: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    queue_req: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    token_usage: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    gen_throughput_tok_s: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    new_seq: np.ndarray = field(default_factory=lambda: _empty(np.float64))
    new_token: np.ndarray = field(default_factory=lambda: _empty(np.float64))

    def __len__(self) -> int:
        return len(self.host)


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


_SETTING_NAMES = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name != "fields_json")


ENGINE_KINDS = ("sglang", "vllm")


@dataclass(frozen=True)
class EngineSettings(Mapping[str, Any]):
    """The engine's configuration as its log gave it: every config line merged (later lines win,
    a missing value never overrides one). As a mapping it holds the values known (and ``fields``,
    every logged field by its engine name, once any line was read), so ``engine.get(name)``
    reads as the merged dict did."""

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
    fields: Mapping[str, Any] | None = None  # None: no configuration line

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]], engine_of_lines: str | None = None
                  ) -> EngineSettings:
        """Merge ``engine_configs`` rows in line order; ``engine_of_lines`` (the engine whose
        scheduler lines the run holds most of) names the engine when no line did."""
        merged: dict[str, Any] = {}
        fields: dict[str, Any] | None = None
        for row in rows:
            merged.update({k: v for k, v in row.items() if v is not None and k in _SETTING_NAMES})
            fields = {} if fields is None else fields
            with contextlib.suppress(ValueError):
                logged = json.loads(row.get("fields_json") or "{}")
                if isinstance(logged, dict):
                    fields.update(logged)
        if merged.get("engine") is None and engine_of_lines is not None:
            merged["engine"] = engine_of_lines
        return cls(**merged, fields=fields)

    @classmethod
    def from_records(cls, configs: Sequence[EngineConfig], engine_of_lines: str | None = None
                     ) -> EngineSettings:
        ordered = sorted(configs, key=lambda c: c.line_no)
        return cls.from_rows([dataclasses.asdict(c) for c in ordered], engine_of_lines)

    @property
    def kind(self) -> str:
        """"sglang" or "vllm" (SGLang when the log named neither)."""
        return self.engine if self.engine in ENGINE_KINDS else "sglang"

    @property
    def admission_limit(self) -> int | None:
        """The engine-wide admission limit: SGLang's request pool (max_running_requests), vLLM's
        max_num_seqs (logged under the same name); None where not logged."""
        return int(self.max_running_requests) if self.max_running_requests else None

    def slots_at(self, pp_size: int) -> int:
        """SGLang's micro-batch slots under PP: pp_size + pp_async_batch_depth (0 where not logged).
        ``pp_size`` is the run's (the log's ranks where its configuration line did not say)."""
        return pp_size + int(self.pp_async_batch_depth or 0)

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
        return None if limit is None else max(limit // pp_size, 1)

    def _known(self) -> Iterator[str]:
        for name in (*_SETTING_NAMES, "fields"):
            if getattr(self, name) is not None:
                yield name

    def __getitem__(self, key: str) -> Any:
        if key not in (*_SETTING_NAMES, "fields") or getattr(self, key) is None:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return self._known()

    def __len__(self) -> int:
        return sum(1 for _ in self._known())


@dataclass(frozen=True)
class RunTables:
    """One run (or a window of it) as alignment reads it."""

    meta: RunMeta
    source: str  # where the run came from, for messages (the store's path)
    window_ns: Window = (None, None)
    clock_probes: ClockProbeColumns = field(default_factory=ClockProbeColumns)
    gpu_samples: GpuSampleColumns = field(default_factory=GpuSampleColumns)
    scheduler_events: SchedulerEventColumns = field(default_factory=SchedulerEventColumns)
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
