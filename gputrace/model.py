"""Record types that flow from sources through the run store to analysis.

Every timestamp is integer nanoseconds since the Unix epoch in the clock of the host named in
the record (``host``); clock offsets are stored as ClockProbe records and applied at analysis
time. ``None`` means "not available" (a metric the GPU lacks, a field the log line lacks), never 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One NVML reading of one GPU (``nvidia-smi --query-gpu`` names in comments)."""

    host: str
    gpu_index: int
    ts_ns: int
    utilization_ratio: float | None = None  # utilization.gpu / 100
    memory_utilization_ratio: float | None = None  # utilization.memory / 100
    power_w: float | None = None  # power.draw (instant where supported)
    energy_j: float | None = None  # total_energy_consumption since driver load
    pcie_tx_bytes_per_s: float | None = None
    pcie_rx_bytes_per_s: float | None = None
    sm_clock_hz: float | None = None  # clocks.sm
    memory_clock_hz: float | None = None  # clocks.mem
    memory_used_bytes: int | None = None  # memory.used
    memory_total_bytes: int | None = None  # memory.total
    temperature_c: float | None = None  # temperature.gpu
    clock_event_reasons: int | None = None  # clocks_event_reasons.active (bitmask)
    sm_active_ratio: float | None = None  # GPM SM activity (Hopper+)
    sm_occupancy_ratio: float | None = None  # GPM SM occupancy
    tensor_active_ratio: float | None = None  # GPM tensor activity
    nvlink_tx_bytes_per_s: float | None = None  # GPM NVLink TX
    nvlink_rx_bytes_per_s: float | None = None  # GPM NVLink RX
    seq: int | None = None  # the agent's sequence number, for resuming pulls
    lost: bool = False  # the GPU fell off the bus; no metric is valid


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """Static facts about one GPU."""

    host: str
    gpu_index: int
    uuid: str | None = None
    name: str | None = None
    pci_bus_id: str | None = None
    pcie_max_gen: int | None = None
    pcie_max_width: int | None = None
    power_limit_w: float | None = None
    memory_total_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class SchedulerEvent:
    """One scheduler batch/stats line of a serving engine, per rank.

    ``log_ts_ns`` is the time printed in the line (``ts_resolution_ns`` says how coarse it is:
    1e9 for SGLang's default second resolution); ``recv_ts_ns`` is when the collector received
    the line, in the collector host's clock (None for offline files). Alignment places the event
    from both. ``line_no`` keeps the order of lines within one source.
    """

    host: str
    source: str
    engine: str  # "sglang" | "vllm"
    kind: str  # "prefill" | "decode" | "stats"
    line_no: int
    log_ts_ns: int | None = None
    ts_resolution_ns: int | None = None
    recv_ts_ns: int | None = None
    dp_rank: int | None = None
    pp_rank: int | None = None
    tp_rank: int | None = None
    ep_rank: int | None = None
    running_req: int | None = None
    queue_req: int | None = None
    new_seq: int | None = None
    new_token: int | None = None
    cached_token: int | None = None
    num_token: int | None = None
    token_usage: float | None = None
    gen_throughput_tok_s: float | None = None
    input_throughput_tok_s: float | None = None
    cuda_graph: bool | None = None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engine's startup configuration as logged (SGLang ``server_args``/``max_...`` lines).

    ``fields_json`` keeps every logged field by its engine name; the common ones are typed.
    """

    host: str
    source: str
    engine: str
    line_no: int
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
    fields_json: str = "{}"


ABANDONED_PREFIX = "abandoned:"
"""How ``RequestRecord.error`` starts for a request the client stopped waiting for (the drain time
after the last level ran out): it did not fail, its end is not known."""


def is_abandoned(error: str | None) -> bool:
    """Whether a request's error says it was abandoned, not failed."""
    return error is not None and error.startswith(ABANDONED_PREFIX)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One client request: when it started, produced its first token, and ended."""

    host: str  # the client's host
    request_id: str
    start_ns: int
    first_token_ns: int | None = None
    end_ns: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ok: bool = True
    error: str | None = None
    phase: str | None = None  # the load level it belongs to, e.g. "C=32"
    source: str = "gputrace-load"


@dataclass(frozen=True, slots=True)
class Marker:
    """A point in time: the start of a load phase (``kind="phase"``) or a note."""

    host: str
    ts_ns: int
    label: str
    kind: str = "phase"  # "phase" starts a phase that lasts until the next one or "end"
    target_concurrency: int | None = None


@dataclass(frozen=True, slots=True)
class ClockProbe:
    """An NTP-style probe of a remote host's clock from the collector.

    offset = remote - midpoint(local send, local receive); the probe with the smallest round
    trip bounds the offset best.
    """

    host: str  # the remote host probed
    local_send_ns: int
    remote_ns: int
    local_recv_ns: int
    via: str = "ssh"  # "ssh" | "agent"

    @property
    def rtt_ns(self) -> int:
        return self.local_recv_ns - self.local_send_ns

    @property
    def offset_ns(self) -> int:
        return self.remote_ns - (self.local_send_ns + self.local_recv_ns) // 2


@dataclass(frozen=True, slots=True)
class RunMeta:
    """What ``meta.json`` holds about a run."""

    name: str
    created_ns: int
    gputrace_version: str
    schema_version: int
    config: dict[str, object] = field(default_factory=dict)
    topology: dict[str, object] = field(default_factory=dict)
    extra: dict[str, object] = field(default_factory=dict)


ENGINE_LOAD_SOURCE = "prometheus engine running + queued requests"
"""``LoadSample.source`` where a Prometheus import had no client gauge and took the load from the
engine's own running + waiting gauges: the analysis must not call these the client's requests."""


@dataclass(frozen=True, slots=True)
class LoadSample:
    """The requests in flight at a moment, where only a gauge of them is known: the client's (a
    Prometheus import of ``gputrace_load_inflight_requests``), or, without that gauge, the engine's
    running + waiting requests (``source`` is then ``ENGINE_LOAD_SOURCE``). The analysis takes the
    offered load from these when the run has no request records. ``ts_ns`` is in the collector's
    clock."""

    source: str
    ts_ns: int
    inflight_requests: float | None = None
    target_concurrency: int | None = None


@dataclass(frozen=True, slots=True)
class EngineMetricSample:
    """One sample of the engine's own Prometheus endpoint (SGLang ``--enable-metrics``, vLLM
    ``/metrics``) as scraped by the collector: the sample's full name (``sglang:num_queue_reqs``,
    ``vllm:e2e_request_latency_seconds_sum``), its labels as a JSON object and its value. ``ts_ns``
    is when the scrape's answer came, in the collector host's clock."""

    host: str
    source: str  # the endpoint's URL
    ts_ns: int
    name: str
    labels_json: str = "{}"
    value: float | None = None


RECORD_TABLES: dict[type, str] = {
    GpuSample: "gpu_samples",
    DeviceInfo: "devices",
    SchedulerEvent: "scheduler_events",
    EngineConfig: "engine_configs",
    RequestRecord: "requests",
    Marker: "markers",
    ClockProbe: "clock_probes",
    LoadSample: "load_samples",
    EngineMetricSample: "engine_metrics",
}
"""Each record type's table in the run store."""
