"""The metric contract: every series gputrace's agent and collector export, with its Prometheus type,
unit, labels and help text. The exporters build their families from it, the Prometheus importer reads
by its names, and the dashboard queries no other gputrace metric (tests/test_architecture_metrics.py).

Plain data: only gputrace/exposition.py imports prometheus_client.
"""

from __future__ import annotations

from dataclasses import dataclass

from gputrace.engines import ENGINE_WORDS

GPU_LABELS = ("host", "gpu", "uuid", "model", "pp_rank", "tp_rank")  # the ranks only with a topology
RANK_LABELS = ("pp_rank", "tp_rank")
ENGINE_LABELS = ("host", "pp_rank", "tp_rank", "dp_rank", "run")
STAGE_LABELS = ("pp_rank", "run")
RUN_LABELS = ("run",)
# dcgm-exporter's labels, so existing DCGM dashboards work unchanged
DCGM_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname")


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One exported series: who exports it, its type, unit, labels and help text."""

    name: str  # as scraped: a counter's ends in _total
    source: str  # "agent" | "collector"
    kind: str  # "gauge" | "counter"
    unit: str  # Prometheus base unit ("ratio", "watts", ...); "" for counts and bitmasks
    labels: tuple[str, ...]
    help: str
    field: str | None = None  # the record field it carries (GpuSample for GPUs, SchedulerEvent for engines)
    scale: float = 1.0  # exported units per unit of the field

    @property
    def family(self) -> str:
        """The family name an exporter declares: a counter's without the _total it is scraped with."""
        return self.name.removesuffix("_total") if self.kind == "counter" else self.name


def _gpu(name: str, unit: str, field: str, help_text: str, kind: str = "gauge") -> MetricSpec:
    return MetricSpec(name, "agent", kind, unit, GPU_LABELS, help_text, field)


def _dcgm(name: str, field: str, scale: float, help_text: str) -> MetricSpec:
    return MetricSpec(name, "agent", "gauge", "", DCGM_LABELS, help_text, field, scale)


def _agent(name: str, kind: str, unit: str, help_text: str) -> MetricSpec:
    return MetricSpec(name, "agent", kind, unit, (), help_text)


def _collector(name: str, unit: str, labels: tuple[str, ...], help_text: str,
               field: str | None = None) -> MetricSpec:
    return MetricSpec(name, "collector", "gauge", unit, labels, help_text, field)


# -- the agent: per GPU, from the newest sample (utilization from the newest driver sample) -------

GPU_UTILIZATION = _gpu("gputrace_gpu_utilization_ratio", "ratio", "utilization_ratio",
                       "Share of the last NVML period a kernel ran (utilization.gpu / 100)")
GPU_MEMORY_UTILIZATION = _gpu("gputrace_gpu_memory_utilization_ratio", "ratio", "memory_utilization_ratio",
                              "Share of the last NVML period device memory was read or written "
                              "(utilization.memory / 100)")
GPU_POWER = _gpu("gputrace_gpu_power_watts", "watts", "power_w",
                 "Power draw, instant where supported (power.draw)")
GPU_PCIE_TX = _gpu("gputrace_gpu_pcie_tx_bytes_per_second", "bytes_per_second", "pcie_tx_bytes_per_s",
                   "PCIe bytes sent by the GPU per second")
GPU_PCIE_RX = _gpu("gputrace_gpu_pcie_rx_bytes_per_second", "bytes_per_second", "pcie_rx_bytes_per_s",
                   "PCIe bytes received by the GPU per second")
GPU_SM_CLOCK = _gpu("gputrace_gpu_sm_clock_hertz", "hertz", "sm_clock_hz", "SM clock (clocks.sm)")
GPU_MEMORY_CLOCK = _gpu("gputrace_gpu_memory_clock_hertz", "hertz", "memory_clock_hz",
                        "Memory clock (clocks.mem)")
GPU_MEMORY_USED = _gpu("gputrace_gpu_memory_used_bytes", "bytes", "memory_used_bytes",
                       "Device memory used (memory.used)")
GPU_MEMORY_TOTAL = _gpu("gputrace_gpu_memory_total_bytes", "bytes", "memory_total_bytes",
                        "Device memory total (memory.total)")
GPU_TEMPERATURE = _gpu("gputrace_gpu_temperature_celsius", "celsius", "temperature_c",
                       "GPU core temperature (temperature.gpu)")
GPU_CLOCK_EVENT_REASONS = _gpu("gputrace_gpu_clock_event_reasons", "", "clock_event_reasons",
                               "Active clock event (throttle) reasons, NVML bitmask "
                               "(clocks_event_reasons.active)")
GPU_SM_ACTIVE = _gpu("gputrace_gpu_sm_active_ratio", "ratio", "sm_active_ratio",
                     "GPM SM activity (Hopper and newer)")
GPU_SM_OCCUPANCY = _gpu("gputrace_gpu_sm_occupancy_ratio", "ratio", "sm_occupancy_ratio", "GPM SM occupancy")
GPU_TENSOR_ACTIVE = _gpu("gputrace_gpu_tensor_active_ratio", "ratio", "tensor_active_ratio",
                         "GPM tensor pipe activity")
GPU_NVLINK_TX = _gpu("gputrace_gpu_nvlink_tx_bytes_per_second", "bytes_per_second", "nvlink_tx_bytes_per_s",
                     "GPM NVLink bytes sent per second")
GPU_NVLINK_RX = _gpu("gputrace_gpu_nvlink_rx_bytes_per_second", "bytes_per_second", "nvlink_rx_bytes_per_s",
                     "GPM NVLink bytes received per second")
GPU_GAUGES = (GPU_UTILIZATION, GPU_MEMORY_UTILIZATION, GPU_POWER, GPU_PCIE_TX, GPU_PCIE_RX, GPU_SM_CLOCK,
              GPU_MEMORY_CLOCK, GPU_MEMORY_USED, GPU_MEMORY_TOTAL, GPU_TEMPERATURE, GPU_CLOCK_EVENT_REASONS,
              GPU_SM_ACTIVE, GPU_SM_OCCUPANCY, GPU_TENSOR_ACTIVE, GPU_NVLINK_TX, GPU_NVLINK_RX)
"""The per-GPU gauges read straight from a sample field."""
GPU_ENERGY = _gpu("gputrace_gpu_energy_joules_total", "joules", "energy_j",
                  "Energy used since the driver loaded (total_energy_consumption)", kind="counter")
GPU_LOST = _gpu("gputrace_gpu_lost", "", "lost", "1 when the GPU fell off the bus")
GPU_BUSY = MetricSpec("gputrace_gpu_busy_seconds_total", "agent", "counter", "seconds", GPU_LABELS,
                      "Seconds a kernel ran since the agent started: each utilization sample times the "
                      "period it covers (rate() of it is utilization.gpu over any window, every NVML "
                      "period counted, where the gauge shows the last one)")

# dcgm-exporter's names and units (counters as gauges: dcgm-exporter exposes them without the _total
# suffix a counter family would add). --dcgm-compat only.
DCGM_GAUGES = (
    _dcgm("DCGM_FI_DEV_GPU_UTIL", "utilization_ratio", 100.0, "GPU utilization (in %)."),
    _dcgm("DCGM_FI_DEV_MEM_COPY_UTIL", "memory_utilization_ratio", 100.0, "Memory utilization (in %)."),
    _dcgm("DCGM_FI_DEV_POWER_USAGE", "power_w", 1.0, "Power draw (in W)."),
    _dcgm("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "energy_j", 1000.0,
          "Total energy consumption since boot (in mJ)."),
    _dcgm("DCGM_FI_DEV_SM_CLOCK", "sm_clock_hz", 1e-6, "SM clock frequency (in MHz)."),
    _dcgm("DCGM_FI_DEV_MEM_CLOCK", "memory_clock_hz", 1e-6, "Memory clock frequency (in MHz)."),
    _dcgm("DCGM_FI_DEV_GPU_TEMP", "temperature_c", 1.0, "GPU temperature (in C)."),
    _dcgm("DCGM_FI_DEV_FB_USED", "memory_used_bytes", 1.0 / 2**20, "Framebuffer memory used (in MiB)."),
    _dcgm("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "clock_event_reasons", 1.0,
          "Current clock event reasons (bitmask)."),
    _dcgm("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "utilization_ratio", 1.0,
          "Ratio of time the graphics engine is active."),
    _dcgm("DCGM_FI_PROF_SM_ACTIVE", "sm_active_ratio", 1.0,
          "The ratio of cycles an SM has at least 1 warp assigned."),
    _dcgm("DCGM_FI_PROF_SM_OCCUPANCY", "sm_occupancy_ratio", 1.0,
          "The ratio of number of warps resident on an SM."),
    _dcgm("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "tensor_active_ratio", 1.0,
          "Ratio of cycles the tensor (HMMA) pipe is active."),
    _dcgm("DCGM_FI_PROF_PCIE_TX_BYTES", "pcie_tx_bytes_per_s", 1.0,
          "The rate of data transmitted over the PCIe bus, in bytes per second."),
    _dcgm("DCGM_FI_PROF_PCIE_RX_BYTES", "pcie_rx_bytes_per_s", 1.0,
          "The rate of data received over the PCIe bus, in bytes per second."),
    _dcgm("DCGM_FI_PROF_NVLINK_TX_BYTES", "nvlink_tx_bytes_per_s", 1.0,
          "The rate of data transmitted over NVLink, in bytes per second."),
    _dcgm("DCGM_FI_PROF_NVLINK_RX_BYTES", "nvlink_rx_bytes_per_s", 1.0,
          "The rate of data received over NVLink, in bytes per second."),
)

# dcgm-exporter 4.9.0 (DCGM 4.7) renamed the deprecated default and profiling fields to DCGM 4.7's
# names, eleven with a new unit (utilization a 0-1 ratio, clocks in Hz, energy in J, memory in
# bytes); 4.10.0 (DCGM 4.8) renamed the PCIe and NVLink byte rates to *_PER_SECOND (both releases'
# notes, github.com/NVIDIA/dcgm-exporter/releases; names from DCGM's field-identifier reference).
# The clock-event bitmask kept its name.
_DCGM_OLD = {m.name: m for m in DCGM_GAUGES}
DCGM_GAUGES_4_9 = (
    _dcgm("DCGM_FI_DEV_GPU_UTIL_RATIO", "utilization_ratio", 1.0, "GPU utilization (ratio 0-1)."),
    _dcgm("DCGM_FI_DEV_MEMORY_UTIL_RATIO", "memory_utilization_ratio", 1.0,
          "Memory utilization (ratio 0-1)."),
    _dcgm("DCGM_FI_DEV_BOARD_POWER_WATTS", "power_w", 1.0, "Power draw (in W)."),
    _dcgm("DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL", "energy_j", 1.0,
          "Total energy consumption since boot (in J)."),
    _dcgm("DCGM_FI_DEV_SM_CLOCK_HERTZ", "sm_clock_hz", 1.0, "SM clock frequency (in Hz)."),
    _dcgm("DCGM_FI_DEV_MEMORY_CLOCK_HERTZ", "memory_clock_hz", 1.0, "Memory clock frequency (in Hz)."),
    _dcgm("DCGM_FI_DEV_GPU_TEMP_CELSIUS", "temperature_c", 1.0, "GPU temperature (in C)."),
    _dcgm("DCGM_FI_DEV_FB_USED_BYTES", "memory_used_bytes", 1.0, "Framebuffer memory used (in bytes)."),
    _DCGM_OLD["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"],
    _dcgm("DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO", "utilization_ratio", 1.0,
          "Ratio of time the graphics engine is active."),
    _dcgm("DCGM_FI_PROF_SM_UTIL_RATIO", "sm_active_ratio", 1.0,
          "The ratio of cycles an SM has at least 1 warp assigned."),
    _dcgm("DCGM_FI_PROF_SM_OCCUPANCY_RATIO", "sm_occupancy_ratio", 1.0,
          "The ratio of number of warps resident on an SM."),
    _dcgm("DCGM_FI_PROF_TENSOR_UTIL_RATIO", "tensor_active_ratio", 1.0,
          "Ratio of cycles the tensor (HMMA) pipe is active."),
    *(_DCGM_OLD[n] for n in ("DCGM_FI_PROF_PCIE_TX_BYTES", "DCGM_FI_PROF_PCIE_RX_BYTES",
                             "DCGM_FI_PROF_NVLINK_TX_BYTES", "DCGM_FI_PROF_NVLINK_RX_BYTES")),
)
DCGM_GAUGES_4_10 = (
    *(m for m in DCGM_GAUGES_4_9 if not m.name.startswith(("DCGM_FI_PROF_PCIE", "DCGM_FI_PROF_NVLINK"))),
    *(_dcgm(f"{m.name}_PER_SECOND", m.field or "", 1.0, m.help) for m in DCGM_GAUGES
      if m.name.startswith(("DCGM_FI_PROF_PCIE", "DCGM_FI_PROF_NVLINK"))),
)
DCGM_SCHEMAS: dict[str, tuple[MetricSpec, ...]] = {"4.8": DCGM_GAUGES, "4.9": DCGM_GAUGES_4_9,
                                                   "4.10": DCGM_GAUGES_4_10}
"""dcgm-exporter's names and units by the release that introduced them (4.8: every release before 4.9)."""
DCGM_ALL = tuple({m.name: m for schema in DCGM_SCHEMAS.values() for m in schema}.values())

# -- the agent itself ---------------------------------------------------------------------------

AGENT_UP = _agent("gputrace_agent_up", "gauge", "", "1 while the agent samples")
AGENT_SAMPLES = _agent("gputrace_agent_samples_total", "counter", "", "Samples taken since start")
AGENT_SAMPLING_ERRORS = _agent("gputrace_agent_sampling_errors_total", "counter", "", "Failed sampling ticks")
AGENT_RING_SAMPLES = _agent("gputrace_agent_ring_samples", "gauge", "", "Samples held for /v1/samples")
AGENT_SAMPLE_DURATION = _agent("gputrace_agent_sample_duration_seconds", "gauge", "seconds",
                               "CPU-side time of the last sampling tick")
AGENT_SCRAPE_DURATION = _agent("gputrace_agent_scrape_duration_seconds", "gauge", "seconds",
                               "Time to build this scrape's metric families")
AGENT_SELF = (AGENT_UP, AGENT_SAMPLES, AGENT_SAMPLING_ERRORS, AGENT_RING_SAMPLES, AGENT_SAMPLE_DURATION,
              AGENT_SCRAPE_DURATION)

# -- the collector: the newest engine line per rank, the load, the live stage estimate -------------

ENGINE_RUNNING = _collector("gputrace_engine_running_requests", "requests", ENGINE_LABELS,
                            "Requests in the micro-batch the rank last logged (#running-req)", "running_req")
ENGINE_QUEUE = _collector("gputrace_engine_queue_requests", "requests", ENGINE_LABELS,
                          "Requests waiting on the rank (#queue-req)", "queue_req")
ENGINE_GENERATION_THROUGHPUT = _collector("gputrace_engine_generation_tokens_per_second", "tokens_per_second",
                                          ENGINE_LABELS, "Generation throughput the rank last logged",
                                          "gen_throughput_tok_s")
ENGINE_TOKEN_USAGE = _collector("gputrace_engine_token_usage_ratio", "ratio", ENGINE_LABELS,
                                "KV-cache token usage the rank last logged", "token_usage")
ENGINE_GAUGES = (ENGINE_RUNNING, ENGINE_QUEUE, ENGINE_GENERATION_THROUGHPUT, ENGINE_TOKEN_USAGE)
LOAD_INFLIGHT = _collector("gputrace_load_inflight_requests", "requests", RUN_LABELS,
                           "Requests the load generator has in flight")
LOAD_TARGET_CONCURRENCY = _collector("gputrace_load_target_concurrency", "requests", RUN_LABELS,
                                     "Concurrency the current load phase asks for")
STAGE_BUBBLE = _collector("gputrace_stage_bubble_ratio", "ratio", STAGE_LABELS,
                          "Share of the last window the stage's GPUs idled while the engine had work")
STAGE_UTILIZATION = _collector("gputrace_stage_utilization_ratio", "ratio", STAGE_LABELS,
                               "Mean NVML utilization of the stage's GPUs over the last window")
STAGE_BUSY = _collector("gputrace_stage_busy_ratio", "ratio", ("pp_rank", "signal", "run"),
                        "Share of the last window the stage's GPUs were busy, by the best signal they give "
                        "(signal: SM activity where the GPU has it, else NVML utilization)")
ENGINE_TOTAL_RUNNING = _collector("gputrace_engine_total_running_requests", "requests", RUN_LABELS,
                                  "Requests the engine runs in all its micro-batches (one stage's "
                                  "#running-req is one micro-batch)")
_POOL_FLAGS = ", ".join(f"{e.flag_for('max_running_requests')} ({e.name})" for e in ENGINE_WORDS.values())
ENGINE_POOL = _collector("gputrace_engine_max_running_requests", "requests", RUN_LABELS,
                         f"The engine's request pool: {_POOL_FLAGS}")
ENGINE_MICROBATCHES = _collector("gputrace_engine_microbatches_in_flight", "", RUN_LABELS,
                                 "Micro-batches the engine has in flight (fewer than the stages: some idle)")
ENGINE_STAGES = _collector("gputrace_engine_pipeline_stages", "", RUN_LABELS,
                           "Pipeline stages (pp_size) the micro-batches in flight are set against")
LOAD_PHASE_START = _collector("gputrace_load_phase_start_seconds", "seconds", ("phase", "run"),
                              "When each load phase of the run began (Unix time, the collector's clock)")
LOAD_TTFT = _collector("gputrace_load_ttft_seconds", "seconds", ("quantile", "run"),
                       "Time to first token of the requests completed in the last window")
LOAD_ITL = _collector("gputrace_load_itl_seconds", "seconds", ("quantile", "run"),
                      "Mean inter-token latency per request, of the requests completed in the last window")
LIVE_FINDING = _collector("gputrace_live_finding_info", "", ("cause", "finding", "run"),
                          "What the live figures say now, by the report's rules over the last window: "
                          "the cause and the line watch shows (always 1; the text is in the labels)")
LIVE_EXTRAS = (STAGE_BUSY, ENGINE_TOTAL_RUNNING, ENGINE_POOL, ENGINE_MICROBATCHES, ENGINE_STAGES,
               LOAD_PHASE_START, LOAD_TTFT, LOAD_ITL, LIVE_FINDING)

COLLECTOR_COUNTS = ("gpu_samples", "scheduler_events", "requests", "markers", "log_lines",
                    "unrecognised_lines", "rejected_records", "bad_marks", "bad_sample_lines",
                    "engine_metric_samples", "bad_clock_probes")
"""What the collector counts in a run; each is exported as gputrace_collector_<count>_total."""
COLLECTOR_COUNTERS = {
    key: MetricSpec(f"gputrace_collector_{key}_total", "collector", "counter", "", RUN_LABELS,
                    f"{key.replace('_', ' ')} captured in this run")
    for key in COLLECTOR_COUNTS
}

AGENT_METRICS: tuple[MetricSpec, ...] = (*GPU_GAUGES, GPU_ENERGY, GPU_LOST, GPU_BUSY, *AGENT_SELF, *DCGM_ALL)
COLLECTOR_METRICS: tuple[MetricSpec, ...] = (*ENGINE_GAUGES, LOAD_INFLIGHT, LOAD_TARGET_CONCURRENCY,
                                             STAGE_BUBBLE, STAGE_UTILIZATION, *LIVE_EXTRAS,
                                             *COLLECTOR_COUNTERS.values())
ALL_METRICS: tuple[MetricSpec, ...] = (*AGENT_METRICS, *COLLECTOR_METRICS)
BY_NAME: dict[str, MetricSpec] = {m.name: m for m in ALL_METRICS}
