"""The NVML backend: the only module that imports pynvml (nvidia-ml-py).

Utilization comes from ``nvmlDeviceGetSamples`` (every driver sample with its own timestamp) where
the GPU supports it, else ``nvmlDeviceGetUtilizationRates``. A metric a GPU does not support is None
and logged once; NVML missing at start is a one-line NvmlError; a GPU lost mid-run is marked
``lost=True`` while the others keep sampling.

Each tick costs NVML calls, and each call is a driver round trip (an ioctl), so a tick asks only
for what moves at the tick's rate: the driver's utilization samples, one field-values call (instant
power, energy, PCIe byte counters) and GPM. Clocks, clock event reasons, memory use and temperature
are read once a second and repeated in each tick's record until the next reading.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

import pynvml

from gputrace.errors import NvmlError
from gputrace.gpu.sampler import SampleRow, sample_row
from gputrace.logsetup import get_logger
from gputrace.model import DeviceInfo, GpuSample

log = get_logger("gpu.nvml")

_UNSUPPORTED = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND})
_START_CAUSES = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: "the NVML library (libnvidia-ml.so.1) was not found: "
                                         "no NVIDIA driver is installed on this host",
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: "the NVIDIA kernel driver is not loaded",
    pynvml.NVML_ERROR_NO_PERMISSION: "no permission to open the NVIDIA device files",
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: "the NVML library and the loaded kernel driver "
                                               "have different versions (reload the driver)",
}
_SIM_HINT = "; to try gputrace without a GPU use `--backend sim`"
# idle GPUs produce no driver samples; after this long without one, read the plain rates instead
_STALE_SAMPLES_NS = 1_000_000_000
# clocks, clock event reasons, memory use and temperature: read at most this often per GPU
SLOW_METRICS_PERIOD_NS = 1_000_000_000
# nvmlDeviceGetPcieThroughput blocks ~20 ms per counter: call it at most this often per GPU
_PCIE_THROUGHPUT_MIN_PERIOD_NS = 1_000_000_000
_GPM_METRICS = (  # (GpuSample field, metric id, scale to the field's unit)
    ("sm_active_ratio", pynvml.NVML_GPM_METRIC_SM_UTIL, 0.01),
    ("sm_occupancy_ratio", pynvml.NVML_GPM_METRIC_SM_OCCUPANCY, 0.01),
    ("tensor_active_ratio", pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL, 0.01),
    ("pcie_tx_bytes_per_s", pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC, 1024.0**2),
    ("pcie_rx_bytes_per_s", pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC, 1024.0**2),
    ("nvlink_tx_bytes_per_s", pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC, 1024.0**2),
    ("nvlink_rx_bytes_per_s", pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC, 1024.0**2),
)
# the newer name (driver 535+) where this nvidia-ml-py has it
_CLOCK_EVENTS_FN = ("nvmlDeviceGetCurrentClocksEventReasons"
                    if hasattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons")
                    else "nvmlDeviceGetCurrentClocksThrottleReasons")
_FIELDS = (  # nvmlDeviceGetFieldValues ids read in one call per tick
    ("power_instant", pynvml.NVML_FI_DEV_POWER_INSTANT),  # mW
    ("pcie_tx_count", pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES),  # cumulative bytes
    ("pcie_rx_count", pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES),
)
# read with the slow metrics: on the H200 (driver 580) the energy counter costs about 3.5 ms of CPU
# per read, where the instant power costs microseconds; a cumulative counter read once a second
# loses nothing
_SLOW_FIELDS = (("energy_count", pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION),)  # mJ since driver load
# the driver keeps its utilization samples (one per 200 ms on the H200) in a buffer: read it once a
# second (each keeps its own timestamp), since each nvmlDeviceGetSamples costs 1.4-1.9 ms of CPU
# there whatever it returns
DRIVER_SAMPLES_PERIOD_NS = 1_000_000_000
_PCIE_COUNT_FIELDS = ("pcie_tx_count", "pcie_rx_count")


@dataclass(frozen=True, slots=True)
class _SlowMetrics:
    """The metrics read once a second (``_slow_metrics``), repeated in each tick's record."""

    energy_j: float | None = None
    sm_clock_hz: float | None = None
    memory_clock_hz: float | None = None
    clock_event_reasons: int | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_c: float | None = None


@dataclass(frozen=True, slots=True)
class _FieldReading:
    """One nvmlFieldValue_t that succeeded: its number (in NVML's unit) and the driver's stamp."""

    value: float
    ts_us: int


class _GpuLost(Exception):
    """Internal: NVML_ERROR_GPU_IS_LOST from any call on a device."""


@dataclass(slots=True)
class _Device:
    index: int
    handle: Any
    info: DeviceInfo
    unsupported: set[str] = field(default_factory=set)
    logged: set[tuple[str, int]] = field(default_factory=set)
    lost: bool = False
    seen_ts_us: dict[int, int] = field(default_factory=dict)  # sampling type -> last-seen stamp
    last_driver_sample_ns: int | None = None
    samples_read_ns: int | None = None  # when nvmlDeviceGetSamples was last asked
    pcie_prev: tuple[int, int, int] | None = None  # (ts_us, tx bytes, rx bytes) of the counters
    pcie_throughput_at_ns: int = 0
    gpm_prev: Any = None
    gpm_cur: Any = None
    slow_read_ns: int | None = None  # when the slow metrics were last read
    slow_values: _SlowMetrics = field(default_factory=_SlowMetrics)


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _union_value(value: Any, value_type: int) -> float:
    """The number in an nvmlValue_t union according to its declared type."""
    attr = {pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal", pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
            pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
            pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
            pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
            pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
            pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal"}.get(value_type, "uiVal")
    return float(getattr(value, attr))


class NvmlSampler:
    """The Sampler interface over the GPUs NVML sees on this host."""

    backend = "nvml"
    lag_ns = 0

    def __init__(self, host: str | None = None) -> None:
        self.host = host or socket.gethostname()
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            cause = _START_CAUSES.get(exc.value, f"NVML failed to start: {exc}")
            raise NvmlError(cause + _SIM_HINT) from exc
        try:
            count = pynvml.nvmlDeviceGetCount()
            self._devices = [self._open(i) for i in range(count)]
            self._versions = {"driver_version": _decode(pynvml.nvmlSystemGetDriverVersion()),
                              "nvml_version": _decode(pynvml.nvmlSystemGetNVMLVersion())}
        except pynvml.NVMLError as exc:
            pynvml.nvmlShutdown()
            raise NvmlError(f"NVML could not list the GPUs: {exc}" + _SIM_HINT) from exc
        if not self._devices:
            pynvml.nvmlShutdown()
            raise NvmlError("NVML sees no GPU on this host" + _SIM_HINT)

    def _open(self, index: int) -> _Device:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        dev = _Device(index, handle, DeviceInfo(self.host, index))
        try:
            self._describe(dev)
        except _GpuLost:
            dev.lost = True
            log.error("GPU lost at start; its samples are marked lost", gpu=index)
        return dev

    def _describe(self, dev: _Device) -> None:
        index = dev.index
        pci = self._call(dev, "pci_info", "nvmlDeviceGetPciInfo")
        limit_mw = self._call(dev, "power_limit", "nvmlDeviceGetEnforcedPowerLimit")
        memory = self._call(dev, "memory", "nvmlDeviceGetMemoryInfo")
        uuid = self._call(dev, "uuid", "nvmlDeviceGetUUID")
        name = self._call(dev, "name", "nvmlDeviceGetName")
        dev.info = DeviceInfo(
            host=self.host, gpu_index=index,
            uuid=_decode(uuid) if uuid is not None else None,
            name=_decode(name) if name is not None else None,
            pci_bus_id=_decode(pci.busId) if pci is not None else None,
            pcie_max_gen=self._call(dev, "pcie_max_gen", "nvmlDeviceGetMaxPcieLinkGeneration"),
            pcie_max_width=self._call(dev, "pcie_max_width", "nvmlDeviceGetMaxPcieLinkWidth"),
            power_limit_w=limit_mw / 1000.0 if limit_mw is not None else None,
            memory_total_bytes=int(memory.total) if memory is not None else None,
        )
        support = self._call(dev, "gpm", "nvmlGpmQueryDeviceSupport")
        if support is not None and support.isSupportedDevice:
            dev.gpm_prev = self._gpm_sample_alloc(dev)
            dev.gpm_cur = self._gpm_sample_alloc(dev)
            if (dev.gpm_prev is None or dev.gpm_cur is None
                    or self._call(dev, "gpm", "nvmlGpmSampleGet", dev.gpm_prev) is None):
                dev.unsupported.add("gpm")
        else:
            dev.unsupported.add("gpm")

    def devices(self) -> list[DeviceInfo]:
        return [d.info for d in self._devices]

    def versions(self) -> dict[str, str | None]:
        return dict(self._versions)

    def _failed(self, dev: _Device, metric: str, code: int) -> None:
        if code == pynvml.NVML_ERROR_GPU_IS_LOST:
            raise _GpuLost
        if code in _UNSUPPORTED:
            dev.unsupported.add(metric)
            log.info("metric not supported on this GPU; reported as unavailable",
                     gpu=dev.index, metric=metric)
        elif (metric, code) not in dev.logged:
            dev.logged.add((metric, code))
            log.warning("nvml_call_failed",
                        gpu=dev.index, metric=metric, error=str(pynvml.NVMLError(code)))

    def _gpm_sample_alloc(self, dev: _Device) -> Any:
        """A GPM sample buffer, or None (nvmlGpmSampleAlloc takes no device handle, unlike _call's)."""
        try:
            return pynvml.nvmlGpmSampleAlloc()
        except pynvml.NVMLError as exc:
            self._failed(dev, "gpm", exc.value)
            return None

    def _call(self, dev: _Device, metric: str, fn_name: str, *args: Any) -> Any:
        """pynvml.<fn_name>(handle, *args), or None when the metric is unavailable."""
        if metric in dev.unsupported:
            return None
        try:
            return getattr(pynvml, fn_name)(dev.handle, *args)
        except pynvml.NVMLError as exc:
            self._failed(dev, metric, exc.value)
            return None

    def sample(self, now_ns: int) -> list[GpuSample]:
        out: list[GpuSample] = []
        for dev in self._devices:
            if not dev.lost:
                try:
                    out.append(self._sample_device(dev, now_ns, out))
                    continue
                except _GpuLost:
                    dev.lost = True
                    log.error("GPU lost (fell off the bus); its samples are marked lost, "
                              "the other GPUs keep sampling", gpu=dev.index, uuid=dev.info.uuid)
            out.append(GpuSample(self.host, dev.index, now_ns, lost=True))
        return out

    def sample_rows(self, now_ns: int) -> list[SampleRow]:
        # records first: their cost is small beside the NVML calls that fill them
        return [sample_row(s) for s in self.sample(now_ns)]

    def _sample_device(self, dev: _Device, now_ns: int, out: list[GpuSample]) -> GpuSample:
        if dev.samples_read_ns is None or now_ns - dev.samples_read_ns >= DRIVER_SAMPLES_PERIOD_NS:
            dev.samples_read_ns = now_ns
            if self._driver_samples(dev, out):
                dev.last_driver_sample_ns = now_ns
        stale = dev.last_driver_sample_ns is None or now_ns - dev.last_driver_sample_ns > _STALE_SAMPLES_NS
        utilization = memory_utilization = None
        if "gpu_samples" in dev.unsupported or stale:
            rates = self._call(dev, "utilization", "nvmlDeviceGetUtilizationRates")
            if rates is not None:
                utilization, memory_utilization = rates.gpu / 100.0, rates.memory / 100.0
        slow_due = dev.slow_read_ns is None or now_ns - dev.slow_read_ns >= SLOW_METRICS_PERIOD_NS
        gpm = self._gpm(dev)
        tick_fields: tuple[tuple[str, int], ...] = _FIELDS
        if gpm.get("pcie_tx_bytes_per_s") is not None and gpm.get("pcie_rx_bytes_per_s") is not None:
            # GPM's PCIe rates come with its sample (about 55 us on the H200); the byte counters
            # would cost 0.2-0.3 ms more a tick there
            tick_fields = tuple(f for f in _FIELDS if f[0] not in _PCIE_COUNT_FIELDS)
        fields = self._fields(dev, tick_fields + _SLOW_FIELDS if slow_due else tick_fields)  # one call
        power = fields.get("power_instant")
        power_mw = power.value if power is not None else self._call(dev, "power", "nvmlDeviceGetPowerUsage")
        if slow_due:
            energy = fields.get("energy_count")
            dev.slow_values = self._slow_metrics(dev, energy.value if energy is not None else None)
            dev.slow_read_ns = now_ns
        slow = dev.slow_values
        pcie_tx, pcie_rx = self._pcie(dev, fields, gpm.get("pcie_tx_bytes_per_s"),
                                      gpm.get("pcie_rx_bytes_per_s"), now_ns)
        return GpuSample(
            self.host, dev.index, now_ns, utilization_ratio=utilization,
            memory_utilization_ratio=memory_utilization,
            power_w=power_mw / 1000.0 if power_mw is not None else None, energy_j=slow.energy_j,
            pcie_tx_bytes_per_s=pcie_tx, pcie_rx_bytes_per_s=pcie_rx, sm_clock_hz=slow.sm_clock_hz,
            memory_clock_hz=slow.memory_clock_hz, memory_used_bytes=slow.memory_used_bytes,
            memory_total_bytes=slow.memory_total_bytes, temperature_c=slow.temperature_c,
            clock_event_reasons=slow.clock_event_reasons, sm_active_ratio=gpm.get("sm_active_ratio"),
            sm_occupancy_ratio=gpm.get("sm_occupancy_ratio"),
            tensor_active_ratio=gpm.get("tensor_active_ratio"),
            nvlink_tx_bytes_per_s=gpm.get("nvlink_tx_bytes_per_s"),
            nvlink_rx_bytes_per_s=gpm.get("nvlink_rx_bytes_per_s"))

    def _slow_metrics(self, dev: _Device, energy_mj: float | None) -> _SlowMetrics:
        """Energy, clocks, clock event reasons, memory use and temperature (they move slowly)."""
        if energy_mj is None:  # no energy field on this driver
            energy_mj = self._call(dev, "energy", "nvmlDeviceGetTotalEnergyConsumption")
        sm_mhz = self._call(dev, "sm_clock", "nvmlDeviceGetClockInfo", pynvml.NVML_CLOCK_SM)
        mem_mhz = self._call(dev, "memory_clock", "nvmlDeviceGetClockInfo", pynvml.NVML_CLOCK_MEM)
        reasons = self._call(dev, "clock_event_reasons", _CLOCK_EVENTS_FN)
        memory = self._call(dev, "memory", "nvmlDeviceGetMemoryInfo")
        temperature = self._call(dev, "temperature", "nvmlDeviceGetTemperature", pynvml.NVML_TEMPERATURE_GPU)
        return _SlowMetrics(
            energy_j=energy_mj / 1000.0 if energy_mj is not None else None,
            sm_clock_hz=sm_mhz * 1e6 if sm_mhz is not None else None,
            memory_clock_hz=mem_mhz * 1e6 if mem_mhz is not None else None,
            clock_event_reasons=reasons,
            memory_used_bytes=int(memory.used) if memory is not None else None,
            memory_total_bytes=int(memory.total) if memory is not None else None,
            temperature_c=temperature)

    def _driver_samples(self, dev: _Device, out: list[GpuSample]) -> bool:
        """Append one record per new driver sample (own timestamp); True if any GPU sample came."""
        merged: dict[int, list[float | None]] = {}
        for slot, (metric, kind) in enumerate((("gpu_samples", pynvml.NVML_GPU_UTILIZATION_SAMPLES),
                                               ("memory_samples", pynvml.NVML_MEMORY_UTILIZATION_SAMPLES))):
            if metric in dev.unsupported:
                continue
            seen = dev.seen_ts_us.get(kind, 0)
            try:
                value_type, samples = pynvml.nvmlDeviceGetSamples(dev.handle, kind, seen)
            except pynvml.NVMLError as exc:
                if exc.value != pynvml.NVML_ERROR_NOT_FOUND:  # NOT_FOUND: no sample since `seen`
                    self._failed(dev, metric, exc.value)
                continue
            for s in samples:
                ts_us = int(s.timeStamp)
                if ts_us <= seen:
                    continue
                merged.setdefault(ts_us, [None, None])[slot] = _union_value(s.sampleValue, value_type) / 100
                dev.seen_ts_us[kind] = max(dev.seen_ts_us.get(kind, 0), ts_us)
        for ts_us in sorted(merged):
            util, mem_util = merged[ts_us]
            out.append(GpuSample(self.host, dev.index, ts_us * 1000, utilization_ratio=util,
                                 memory_utilization_ratio=mem_util))
        return any(v[0] is not None for v in merged.values())

    def _fields(self, dev: _Device, which: tuple[tuple[str, int], ...]) -> dict[str, _FieldReading]:
        """The field values that succeeded, by their name in ``which``."""
        wanted = [(name, fid) for name, fid in which if name not in dev.unsupported]
        if not wanted:
            return {}
        raw = self._call(dev, "field_values", "nvmlDeviceGetFieldValues", [fid for _, fid in wanted])
        if raw is None:
            return {}
        got: dict[str, _FieldReading] = {}
        for (name, _), fv in zip(wanted, raw, strict=False):
            if fv.nvmlReturn != pynvml.NVML_SUCCESS:
                self._failed(dev, name, int(fv.nvmlReturn))
                continue
            got[name] = _FieldReading(_union_value(fv.value, int(fv.valueType)), int(fv.timestamp))
        return got

    def _pcie(self, dev: _Device, fields: dict[str, _FieldReading], gpm_tx: float | None,
              gpm_rx: float | None, now_ns: int) -> tuple[float | None, float | None]:
        """PCIe (tx, rx) rates: GPM's (then no counters were read), else the byte counters, else the
        20 ms throughput call."""
        tx, rx = fields.get("pcie_tx_count"), fields.get("pcie_rx_count")
        if tx is not None and rx is not None:
            cur = (tx.ts_us, int(tx.value), int(rx.value))
            prev, dev.pcie_prev = dev.pcie_prev, cur
            if prev is not None and cur[0] > prev[0]:
                dt_s = (cur[0] - prev[0]) / 1e6
                return (cur[1] - prev[1]) / dt_s, (cur[2] - prev[2]) / dt_s
            return gpm_tx, gpm_rx
        if gpm_tx is not None or now_ns - dev.pcie_throughput_at_ns < _PCIE_THROUGHPUT_MIN_PERIOD_NS:
            return gpm_tx, gpm_rx
        dev.pcie_throughput_at_ns = now_ns
        kb_tx, kb_rx = (self._call(dev, "pcie_throughput", "nvmlDeviceGetPcieThroughput", counter)
                        for counter in (pynvml.NVML_PCIE_UTIL_TX_BYTES, pynvml.NVML_PCIE_UTIL_RX_BYTES))
        return (kb_tx * 1024.0 if kb_tx is not None else None, kb_rx * 1024.0 if kb_rx is not None else None)

    def _gpm(self, dev: _Device) -> dict[str, float]:
        """GPM metrics (Hopper and newer) between the previous tick's GPM sample and this one."""
        if "gpm" in dev.unsupported:
            return {}
        if self._call(dev, "gpm", "nvmlGpmSampleGet", dev.gpm_cur) is None:
            return {}
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(_GPM_METRICS)
        request.sample1 = dev.gpm_prev
        request.sample2 = dev.gpm_cur
        for i, (_, metric_id, _) in enumerate(_GPM_METRICS):
            request.metrics[i].metricId = metric_id
        dev.gpm_prev, dev.gpm_cur = dev.gpm_cur, dev.gpm_prev
        try:
            pynvml.nvmlGpmMetricsGet(request)
        except pynvml.NVMLError as exc:
            self._failed(dev, "gpm", exc.value)
            return {}
        got: dict[str, float] = {}
        for i, (name, _, scale) in enumerate(_GPM_METRICS):
            metric = request.metrics[i]
            if name in dev.unsupported:
                continue
            if metric.nvmlReturn != pynvml.NVML_SUCCESS:
                self._failed(dev, name, int(metric.nvmlReturn))
                continue
            got[name] = float(metric.value) * scale
        return got

    def close(self) -> None:
        for dev in self._devices:
            for gpm in (dev.gpm_prev, dev.gpm_cur):
                if gpm is not None:
                    try:
                        pynvml.nvmlGpmSampleFree(gpm)
                    except pynvml.NVMLError:
                        log.debug("gpm_sample_free_failed", gpu=dev.index)
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.debug("nvml_shutdown_failed", error=str(exc))
