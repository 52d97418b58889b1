"""The agent's Prometheus exposition: a custom Collector that builds fresh families at scrape time.

Nothing is kept in global gauges: every scrape reads the newest sample per GPU, so a GPU that stops
reporting a metric simply loses that series (None is never exported as 0).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from gputrace.agent.sampling import LoopStats, SampleRing
from gputrace.gpu.sampler import ROW_INDEX, SampleRow
from gputrace.model import DeviceInfo

# (metric name, help, GpuSample field, scale): utilization comes from the newest driver sample
GPU_GAUGES: tuple[tuple[str, str, str, float], ...] = (
    ("gputrace_gpu_utilization_ratio", "Share of the last NVML period a kernel ran "
     "(utilization.gpu / 100)", "utilization_ratio", 1.0),
    ("gputrace_gpu_memory_utilization_ratio", "Share of the last NVML period device memory was "
     "read or written (utilization.memory / 100)", "memory_utilization_ratio", 1.0),
    ("gputrace_gpu_power_watts", "Power draw, instant where supported (power.draw)", "power_w", 1.0),
    ("gputrace_gpu_pcie_tx_bytes_per_second", "PCIe bytes sent by the GPU per second",
     "pcie_tx_bytes_per_s", 1.0),
    ("gputrace_gpu_pcie_rx_bytes_per_second", "PCIe bytes received by the GPU per second",
     "pcie_rx_bytes_per_s", 1.0),
    ("gputrace_gpu_sm_clock_hertz", "SM clock (clocks.sm)", "sm_clock_hz", 1.0),
    ("gputrace_gpu_memory_clock_hertz", "Memory clock (clocks.mem)", "memory_clock_hz", 1.0),
    ("gputrace_gpu_memory_used_bytes", "Device memory used (memory.used)", "memory_used_bytes", 1.0),
    ("gputrace_gpu_memory_total_bytes", "Device memory total (memory.total)", "memory_total_bytes", 1.0),
    ("gputrace_gpu_temperature_celsius", "GPU core temperature (temperature.gpu)", "temperature_c", 1.0),
    ("gputrace_gpu_clock_event_reasons", "Active clock event (throttle) reasons, NVML bitmask "
     "(clocks_event_reasons.active)", "clock_event_reasons", 1.0),
    ("gputrace_gpu_sm_active_ratio", "GPM SM activity (Hopper and newer)", "sm_active_ratio", 1.0),
    ("gputrace_gpu_sm_occupancy_ratio", "GPM SM occupancy", "sm_occupancy_ratio", 1.0),
    ("gputrace_gpu_tensor_active_ratio", "GPM tensor pipe activity", "tensor_active_ratio", 1.0),
    ("gputrace_gpu_nvlink_tx_bytes_per_second", "GPM NVLink bytes sent per second",
     "nvlink_tx_bytes_per_s", 1.0),
    ("gputrace_gpu_nvlink_rx_bytes_per_second", "GPM NVLink bytes received per second",
     "nvlink_rx_bytes_per_s", 1.0),
)


# DCGM-exporter names and units, so existing DCGM dashboards work unchanged (counters as gauges:
# dcgm-exporter exposes them without the _total suffix that a counter family would add)
DCGM_GAUGES: tuple[tuple[str, str, str, float], ...] = (
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "utilization_ratio", 100.0),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", "memory_utilization_ratio", 100.0),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "power_w", 1.0),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "Total energy consumption since boot (in mJ).",
     "energy_j", 1000.0),
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", "sm_clock_hz", 1e-6),
    ("DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz).", "memory_clock_hz", 1e-6),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "temperature_c", 1.0),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "memory_used_bytes", 1.0 / 2**20),
    ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "Current clock event reasons (bitmask).",
     "clock_event_reasons", 1.0),
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "Ratio of time the graphics engine is active.",
     "utilization_ratio", 1.0),
    ("DCGM_FI_PROF_SM_ACTIVE", "The ratio of cycles an SM has at least 1 warp assigned.",
     "sm_active_ratio", 1.0),
    ("DCGM_FI_PROF_SM_OCCUPANCY", "The ratio of number of warps resident on an SM.",
     "sm_occupancy_ratio", 1.0),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "Ratio of cycles the tensor (HMMA) pipe is active.",
     "tensor_active_ratio", 1.0),
    ("DCGM_FI_PROF_PCIE_TX_BYTES", "The rate of data transmitted over the PCIe bus, in bytes per "
     "second.", "pcie_tx_bytes_per_s", 1.0),
    ("DCGM_FI_PROF_PCIE_RX_BYTES", "The rate of data received over the PCIe bus, in bytes per "
     "second.", "pcie_rx_bytes_per_s", 1.0),
    ("DCGM_FI_PROF_NVLINK_TX_BYTES", "The rate of data transmitted over NVLink, in bytes per "
     "second.", "nvlink_tx_bytes_per_s", 1.0),
    ("DCGM_FI_PROF_NVLINK_RX_BYTES", "The rate of data received over NVLink, in bytes per second.",
     "nvlink_rx_bytes_per_s", 1.0),
)
DCGM_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname")
_ENERGY, _LOST = ROW_INDEX["energy_j"], ROW_INDEX["lost"]


class GpuCollector(Collector):
    """Builds gputrace_* (and optionally DCGM_FI_*) families from the newest samples per GPU."""

    def __init__(self, stats: LoopStats, ring: SampleRing, devices: Sequence[DeviceInfo], host: str,
                 placements: Mapping[int, tuple[int, int]] | None = None, dcgm_compat: bool = False) -> None:
        self.stats = stats
        self.ring = ring
        self.host = host
        self.dcgm_compat = dcgm_compat
        self.placements = placements or {}
        self.label_names = ["host", "gpu", "uuid", "model"] + (["pp_rank", "tp_rank"] if placements else [])
        self._labels: dict[int, list[str]] = {}
        self._dcgm_labels: dict[int, list[str]] = {}
        self._label_dicts: dict[int, dict[str, str]] = {}
        self._dcgm_label_dicts: dict[int, dict[str, str]] = {}
        for d in devices:
            labels = [host, str(d.gpu_index), d.uuid or "", d.name or ""]
            if placements:
                pp_tp = self.placements.get(d.gpu_index)
                labels += [str(pp_tp[0]), str(pp_tp[1])] if pp_tp else ["", ""]
            self._labels[d.gpu_index] = labels
            self._dcgm_labels[d.gpu_index] = [str(d.gpu_index), d.uuid or "", d.pci_bus_id or "",
                                              f"nvidia{d.gpu_index}", d.name or "", host]
            # built once and shared by every series of the GPU (the exposition only reads them)
            self._label_dicts[d.gpu_index] = dict(zip(self.label_names, labels, strict=True))
            self._dcgm_label_dicts[d.gpu_index] = dict(zip(DCGM_LABELS, self._dcgm_labels[d.gpu_index],
                                                           strict=True))

    def describe(self) -> Iterable[Metric]:
        return []  # families depend on what the GPUs support: built at scrape time only

    def collect(self) -> Iterable[Metric]:
        started = time.perf_counter()
        latest, latest_util, latest_memory_util = self.ring.latest()
        # utilization fields come from the newest driver sample carrying them, the rest from ticks
        sources = {"utilization_ratio": latest_util, "memory_utilization_ratio": latest_memory_util}
        families: list[Metric] = []
        families += self._families(GPU_GAUGES, self._label_dicts, latest, sources)
        energy = CounterMetricFamily("gputrace_gpu_energy_joules", "Energy used since the driver "
                                     "loaded (total_energy_consumption)", labels=self.label_names)
        lost = GaugeMetricFamily("gputrace_gpu_lost", "1 when the GPU fell off the bus",
                                 labels=self.label_names)
        for gpu, labels in self._labels.items():
            s = latest.get(gpu)
            if s is None:
                continue
            if s[_ENERGY] is not None:
                energy.add_metric(labels, s[_ENERGY])
            lost.add_metric(labels, 1.0 if s[_LOST] else 0.0)
        families += [energy, lost]
        if self.dcgm_compat:
            families += self._families(DCGM_GAUGES, self._dcgm_label_dicts, latest, sources)
        st = self.stats
        families.append(GaugeMetricFamily("gputrace_agent_up", "1 while the agent samples", value=1.0))
        families.append(CounterMetricFamily("gputrace_agent_samples", "Samples taken since start",
                                            value=float(st.samples)))
        families.append(CounterMetricFamily("gputrace_agent_sampling_errors", "Failed sampling ticks",
                                            value=float(st.errors)))
        families.append(GaugeMetricFamily("gputrace_agent_ring_samples", "Samples held for /v1/samples",
                                          value=float(len(self.ring))))
        families.append(GaugeMetricFamily("gputrace_agent_sample_duration_seconds", "CPU-side time "
                                          "of the last sampling tick", value=st.last_sample_cost_s))
        families.append(GaugeMetricFamily("gputrace_agent_scrape_duration_seconds", "Time to build "
                                          "this scrape's metric families",
                                          value=time.perf_counter() - started))
        return families

    @staticmethod
    def _families(spec: Sequence[tuple[str, str, str, float]], labels_by_gpu: Mapping[int, dict[str, str]],
                  latest: Mapping[int, SampleRow],
                  sources: Mapping[str, Mapping[int, SampleRow]]) -> list[Metric]:
        out: list[Metric] = []
        for name, doc, attr, scale in spec:
            fam = GaugeMetricFamily(name, doc)
            samples = fam.samples
            source = sources.get(attr, latest)
            index = ROW_INDEX[attr]
            for gpu, labels in labels_by_gpu.items():
                s = source.get(gpu)
                value = s[index] if s is not None else None
                if value is not None:
                    samples.append(Sample(name, labels, value * scale))
            if samples:
                out.append(fam)
        return out
