"""The NVML backend against fakes at the pynvml boundary (the only fake besides the simulator)."""

from __future__ import annotations

import ctypes
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pynvml
import pytest
import structlog
from structlog.testing import capture_logs

from gputrace.cli import main
from gputrace.errors import NvmlError
from gputrace.gpu.nvml import DRIVER_SAMPLES_PERIOD_NS, NvmlSampler

NOW_NS = 1_764_486_000_000_000_000


@pytest.fixture(autouse=True)
def _reset_logging() -> Any:
    """The CLI binds logging to the captured stderr; later tests must not write to a closed one."""
    yield
    structlog.reset_defaults()


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


@dataclass
class FakeGpu:
    """One fake device: what each pynvml call returns, which calls fail and with what."""

    index: int
    fail: dict[str, int] = field(default_factory=dict)  # pynvml function name -> NVML error code
    lost: bool = False
    util_samples: list[tuple[int, int]] = field(default_factory=list)  # (timestamp us, percent)
    mem_samples: list[tuple[int, int]] = field(default_factory=list)
    samples_not_found: bool = False  # the real driver's answer when no new sample exists
    rates: tuple[int, int] = (0, 0)
    power_mw: int = 250_000
    instant_power_mw: int | None = 312_500
    pcie_counts: tuple[int, int, int] | None = None  # (timestamp us, tx bytes, rx bytes)
    energy_mj: int = 9_000_000
    energy_field: bool = True  # NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION answered by field values
    gpm: dict[int, float] = field(default_factory=dict)
    calls: Counter[str] = field(default_factory=Counter)
    seen_args: list[int] = field(default_factory=list)


class FakeNvml:
    """Installs pynvml function replacements that dispatch to FakeGpu objects (the handles)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, gpus: list[FakeGpu]) -> None:
        self.gpus = gpus
        self.init_error: int | None = None
        for name in dir(self):
            if name.startswith("nvml"):
                monkeypatch.setattr(pynvml, name, getattr(self, name))

    def _enter(self, gpu: FakeGpu, fn: str) -> None:
        gpu.calls[fn] += 1
        if gpu.lost:
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        if fn in gpu.fail:
            raise _err(gpu.fail[fn])

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise _err(self.init_error)

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeGpu:
        return self.gpus[i]

    def nvmlSystemGetDriverVersion(self) -> str:
        return "570.86.15"

    def nvmlSystemGetNVMLVersion(self) -> bytes:
        return b"12.570.86.15"

    def nvmlDeviceGetUUID(self, g: FakeGpu) -> str:
        self._enter(g, "nvmlDeviceGetUUID")
        return f"GPU-fake-{g.index}"

    def nvmlDeviceGetName(self, g: FakeGpu) -> str:
        self._enter(g, "nvmlDeviceGetName")
        return "NVIDIA H200"

    def nvmlDeviceGetPciInfo(self, g: FakeGpu) -> Any:
        self._enter(g, "nvmlDeviceGetPciInfo")
        info = pynvml.nvmlPciInfo_t()
        info.busId = f"00000000:{0x18 + g.index:02X}:00.0".encode()
        return info

    def nvmlDeviceGetMaxPcieLinkGeneration(self, g: FakeGpu) -> int:
        self._enter(g, "nvmlDeviceGetMaxPcieLinkGeneration")
        return 5

    def nvmlDeviceGetMaxPcieLinkWidth(self, g: FakeGpu) -> int:
        self._enter(g, "nvmlDeviceGetMaxPcieLinkWidth")
        return 16

    def nvmlDeviceGetEnforcedPowerLimit(self, g: FakeGpu) -> int:
        self._enter(g, "nvmlDeviceGetEnforcedPowerLimit")
        return 700_000

    def nvmlDeviceGetMemoryInfo(self, g: FakeGpu) -> Any:
        self._enter(g, "nvmlDeviceGetMemoryInfo")
        mem = pynvml.c_nvmlMemory_t()
        mem.total, mem.used, mem.free = 141 * 2**30, 100 * 2**30, 41 * 2**30
        return mem

    def nvmlGpmQueryDeviceSupport(self, g: FakeGpu) -> Any:
        self._enter(g, "nvmlGpmQueryDeviceSupport")
        support = pynvml.c_nvmlGpmSupport_t()
        support.isSupportedDevice = 1 if g.gpm else 0
        return support

    def nvmlGpmSampleAlloc(self) -> Any:  # no device argument, as pynvml's
        return pynvml.c_nvmlGpmSample_t()

    def nvmlGpmSampleGet(self, g: FakeGpu, sample: Any) -> Any:
        self._enter(g, "nvmlGpmSampleGet")
        return sample

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        pass

    def nvmlGpmMetricsGet(self, request: Any) -> Any:
        gpu = next(g for g in self.gpus if g.gpm)  # one GPM GPU in these tests
        self._enter(gpu, "nvmlGpmMetricsGet")
        for i in range(request.numMetrics):
            metric = request.metrics[i]
            if metric.metricId in gpu.gpm:
                metric.value = gpu.gpm[metric.metricId]
                metric.nvmlReturn = pynvml.NVML_SUCCESS
            else:
                metric.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return request

    def nvmlDeviceGetSamples(self, g: FakeGpu, kind: int, last_seen: int) -> tuple[int, list[Any]]:
        self._enter(g, "nvmlDeviceGetSamples")
        if kind == pynvml.NVML_GPU_UTILIZATION_SAMPLES:
            g.seen_args.append(last_seen)
        rows = g.util_samples if kind == pynvml.NVML_GPU_UTILIZATION_SAMPLES else g.mem_samples
        fresh = [(ts, v) for ts, v in rows if ts > last_seen]
        if g.samples_not_found:
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        out = []
        for ts, v in fresh:
            s = pynvml.c_nvmlSample_t()
            s.timeStamp = ts
            s.sampleValue.uiVal = v
            out.append(s)
        return pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, out

    def nvmlDeviceGetUtilizationRates(self, g: FakeGpu) -> Any:
        self._enter(g, "nvmlDeviceGetUtilizationRates")
        u = pynvml.c_nvmlUtilization_t()
        u.gpu, u.memory = g.rates
        return u

    def nvmlDeviceGetFieldValues(self, g: FakeGpu, field_ids: list[int]) -> Any:
        self._enter(g, "nvmlDeviceGetFieldValues")
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for v, fid in zip(values, field_ids, strict=True):
            v.fieldId = fid
            v.nvmlReturn = pynvml.NVML_SUCCESS
            if fid == pynvml.NVML_FI_DEV_POWER_INSTANT and g.instant_power_mw is not None:
                v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                v.value.uiVal = g.instant_power_mw
            elif fid in (pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES) \
                    and g.pcie_counts is not None:
                v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                ts, tx, rx = g.pcie_counts
                v.timestamp = ts
                v.value.ullVal = tx if fid == pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES else rx
            elif fid == pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION and g.energy_field:
                v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                v.value.ullVal = g.energy_mj
            else:
                v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlDeviceGetPowerUsage(self, g: FakeGpu) -> int:
        self._enter(g, "nvmlDeviceGetPowerUsage")
        return g.power_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, g: FakeGpu) -> int:
        self._enter(g, "nvmlDeviceGetTotalEnergyConsumption")
        return g.energy_mj

    def nvmlDeviceGetClockInfo(self, g: FakeGpu, clock: int) -> int:
        self._enter(g, "nvmlDeviceGetClockInfo")
        return 1980 if clock == pynvml.NVML_CLOCK_SM else 2619

    def nvmlDeviceGetCurrentClocksEventReasons(self, g: FakeGpu) -> int:
        self._enter(g, "nvmlDeviceGetCurrentClocksEventReasons")
        return 0x4  # sw power cap

    def nvmlDeviceGetTemperature(self, g: FakeGpu, sensor: int) -> int:
        self._enter(g, "nvmlDeviceGetTemperature")
        return 61

    def nvmlDeviceGetPcieThroughput(self, g: FakeGpu, counter: int) -> int:
        self._enter(g, "nvmlDeviceGetPcieThroughput")
        return 1000 if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else 2000


def _tick(samples: list[Any], gpu: int, ts_ns: int) -> Any:
    return next(s for s in samples if s.gpu_index == gpu and s.ts_ns == ts_ns)


def test_device_info_and_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device facts come from NVML with units converted (mW -> W, bytes) and versions decoded."""
    FakeNvml(monkeypatch, [FakeGpu(0)])
    sampler = NvmlSampler("node1")
    (info,) = sampler.devices()
    assert (info.uuid, info.name, info.pci_bus_id) == ("GPU-fake-0", "NVIDIA H200", "00000000:18:00.0")
    assert (info.pcie_max_gen, info.pcie_max_width, info.power_limit_w) == (5, 16, 700.0)
    assert info.memory_total_bytes == 141 * 2**30
    assert sampler.versions() == {"driver_version": "570.86.15", "nvml_version": "12.570.86.15"}


def test_every_driver_sample_keeps_its_timestamp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each driver sample becomes a record at its own time, and the next call asks only after it."""
    gpu = FakeGpu(0, util_samples=[(1_000_000, 40), (1_166_667, 100)], mem_samples=[(1_166_667, 30)])
    FakeNvml(monkeypatch, [gpu])
    sampler = NvmlSampler("node1")
    first = sampler.sample(NOW_NS)
    driver = [s for s in first if s.ts_ns != NOW_NS]
    assert [(s.ts_ns, s.utilization_ratio, s.memory_utilization_ratio) for s in driver] == [
        (1_000_000_000, 0.4, None), (1_166_667_000, 1.0, 0.3)]
    assert _tick(first, 0, NOW_NS).utilization_ratio is None  # utilization lives on driver records
    gpu.util_samples.append((1_333_333, 75))
    inside = sampler.sample(NOW_NS + 100_000_000)  # the buffer is read every DRIVER_SAMPLES_PERIOD_NS
    assert [s.ts_ns for s in inside] == [NOW_NS + 100_000_000] and gpu.seen_args == [0]
    second = sampler.sample(NOW_NS + DRIVER_SAMPLES_PERIOD_NS)
    assert [(s.ts_ns, s.utilization_ratio) for s in second if s.utilization_ratio is not None] == [
        (1_333_333_000, 0.75)]
    assert gpu.seen_args == [0, 1_166_667]


def test_tick_metrics_and_units(monkeypatch: pytest.MonkeyPatch) -> None:
    """Instant power, energy, clocks, memory, temperature and reasons arrive in the record's units."""
    gpu = FakeGpu(0, util_samples=[(1, 50)], pcie_counts=(5_000_000, 10_000, 20_000))
    FakeNvml(monkeypatch, [gpu])
    sampler = NvmlSampler("node1")
    s = _tick(sampler.sample(NOW_NS), 0, NOW_NS)
    assert (s.power_w, s.energy_j, s.sm_clock_hz, s.memory_clock_hz) == (312.5, 9000.0, 1.98e9, 2.619e9)
    assert (s.memory_used_bytes, s.temperature_c, s.clock_event_reasons) == (100 * 2**30, 61, 0x4)
    assert s.pcie_tx_bytes_per_s is None  # a rate needs two counter readings
    gpu.pcie_counts = (5_500_000, 10_000 + 500_000, 20_000 + 1_000_000)  # 0.5 s later
    s2 = _tick(sampler.sample(NOW_NS + 1), 0, NOW_NS + 1)
    assert (s2.pcie_tx_bytes_per_s, s2.pcie_rx_bytes_per_s) == (1_000_000.0, 2_000_000.0)
    assert gpu.calls["nvmlDeviceGetPowerUsage"] == 0  # the instant field was there
    assert gpu.calls["nvmlDeviceGetTotalEnergyConsumption"] == 0  # so was the energy field


def test_slow_metrics_are_read_once_a_second_and_repeated(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tick costs a GPU one field-values call (GPM adds 2; there were 11 calls): the driver's
    utilization samples are read every DRIVER_SAMPLES_PERIOD_NS (2 calls), energy, clocks, reasons,
    memory and temperature once a second, and every tick record carries their latest reading,
    while power follows every tick."""
    gpu = FakeGpu(0, util_samples=[(1, 50)], pcie_counts=(1, 0, 0))
    FakeNvml(monkeypatch, [gpu])
    sampler = NvmlSampler("node1")
    gpu.calls.clear()
    ticks = []
    for i in range(15):  # 100 ms ticks up to 1.4 s
        if i == 12:
            gpu.instant_power_mw = 400_000
        gpu.util_samples.append((2 + i * 100_000, 50))  # a busy GPU: driver samples keep coming
        ts = NOW_NS + i * 100_000_000
        ticks.append(_tick(sampler.sample(ts), 0, ts))
    assert all((t.temperature_c, t.sm_clock_hz, t.clock_event_reasons, t.memory_used_bytes)
               == (61, 1.98e9, 0x4, 100 * 2**30) for t in ticks)
    assert [t.power_w for t in ticks] == [312.5] * 12 + [400.0] * 3
    per_tick = {"nvmlDeviceGetSamples": 2 * 2, "nvmlDeviceGetFieldValues": 15}  # samples at 0 and 1 s
    per_second = {"nvmlDeviceGetClockInfo": 2 * 2, "nvmlDeviceGetCurrentClocksEventReasons": 2,
                  "nvmlDeviceGetMemoryInfo": 2, "nvmlDeviceGetTemperature": 2}
    assert dict(gpu.calls) == per_tick | per_second  # at t = 0 and t = 1 s
    assert [t.energy_j for t in ticks] == [9000.0] * 15
    gpu.energy_field = False  # an older driver: the energy call, once a second
    for i in range(15, 30):
        sampler.sample(NOW_NS + i * 100_000_000)
    assert gpu.calls["nvmlDeviceGetTotalEnergyConsumption"] == 1  # at t = 2 s


def test_gpu_lost_during_a_slow_read_is_marked(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU_IS_LOST from a once-a-second call marks the GPU lost like any other call."""
    gpu = FakeGpu(0, util_samples=[(1, 50)])
    FakeNvml(monkeypatch, [gpu])
    sampler = NvmlSampler("node1")
    sampler.sample(NOW_NS)
    gpu.fail["nvmlDeviceGetTemperature"] = pynvml.NVML_ERROR_GPU_IS_LOST
    assert not _tick(sampler.sample(NOW_NS + 100_000_000), 0, NOW_NS + 100_000_000).lost
    assert _tick(sampler.sample(NOW_NS + 10**9), 0, NOW_NS + 10**9).lost


def test_not_supported_metrics_are_none_and_logged_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A metric the GPU lacks is None on every sample, logged once, and not asked for again."""
    gpu = FakeGpu(0, util_samples=[(1, 10)], instant_power_mw=None,
                  fail={"nvmlDeviceGetPowerUsage": pynvml.NVML_ERROR_NOT_SUPPORTED,
                        "nvmlDeviceGetTemperature": pynvml.NVML_ERROR_NOT_SUPPORTED,
                        "nvmlDeviceGetCurrentClocksEventReasons": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND})
    FakeNvml(monkeypatch, [gpu])
    sampler = NvmlSampler("node1")
    with capture_logs() as logs:
        ticks = [_tick(sampler.sample(NOW_NS + i), 0, NOW_NS + i) for i in range(3)]
    assert all(t.power_w is None and t.temperature_c is None and t.clock_event_reasons is None
               for t in ticks)
    assert all(t.sm_clock_hz == 1.98e9 for t in ticks)  # the supported ones keep coming
    unsupported = Counter(e["metric"] for e in logs if e["event"].startswith("metric not supported"))
    assert unsupported == {"power_instant": 1, "power": 1, "temperature": 1, "clock_event_reasons": 1,
                           "pcie_tx_count": 1, "pcie_rx_count": 1}
    assert gpu.calls["nvmlDeviceGetTemperature"] == 1 and gpu.calls["nvmlDeviceGetPowerUsage"] == 1


def test_gpu_lost_mid_run_is_marked_and_others_keep_sampling(monkeypatch: pytest.MonkeyPatch) -> None:
    """After GPU_IS_LOST a GPU's samples say lost=True while the other GPU's values keep coming."""
    gpus = [FakeGpu(0, util_samples=[(1, 20)]), FakeGpu(1, util_samples=[(1, 30)])]
    FakeNvml(monkeypatch, gpus)
    sampler = NvmlSampler("node1")
    assert not any(s.lost for s in sampler.sample(NOW_NS))
    gpus[1].lost = True
    with capture_logs() as logs:
        later = [sampler.sample(NOW_NS + i) for i in (1, 2)]
    for i, batch in zip((1, 2), later, strict=True):
        lost = _tick(batch, 1, NOW_NS + i)
        assert lost.lost and lost.power_w is None
        assert _tick(batch, 0, NOW_NS + i).power_w == 312.5
    assert sum(e["event"].startswith("GPU lost") for e in logs) == 1
    calls = gpus[1].calls.total()
    sampler.sample(NOW_NS + 3)
    assert gpus[1].calls.total() == calls  # a lost GPU is not asked again


def test_library_not_found_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """No NVML library: a one-line NvmlError naming the cause and suggesting --backend sim."""
    fake = FakeNvml(monkeypatch, [])
    fake.init_error = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    with pytest.raises(NvmlError) as info:
        NvmlSampler("node1")
    message = str(info.value)
    assert "libnvidia-ml.so.1" in message and "--backend sim" in message and "\n" not in message


def test_cli_reports_missing_nvml_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`gputrace agent` without a driver exits 1 with one `gputrace: error:` line."""
    fake = FakeNvml(monkeypatch, [])
    fake.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    with pytest.raises(SystemExit) as exit_info:
        main(["agent", "--backend", "nvml", "--listen", "127.0.0.1:0"])
    assert exit_info.value.code == 1
    err_lines = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert err_lines == ["gputrace: error: the NVIDIA kernel driver is not loaded; "
                         "to try gputrace without a GPU use `--backend sim`"]


@pytest.mark.parametrize("not_found", [True, False], ids=["NOT_FOUND", "empty"])
def test_idle_gpu_without_driver_samples_reads_rates(monkeypatch: pytest.MonkeyPatch,
                                                     not_found: bool) -> None:
    """getSamples giving nothing (idle) falls back to the plain rates, without inventing samples."""
    gpu = FakeGpu(0, util_samples=[], samples_not_found=not_found, rates=(0, 0))
    FakeNvml(monkeypatch, [gpu])
    sampler = NvmlSampler("node1")
    batch = sampler.sample(NOW_NS)
    assert len(batch) == 1
    assert (batch[0].utilization_ratio, batch[0].memory_utilization_ratio) == (0.0, 0.0)
    assert gpu.calls["nvmlDeviceGetUtilizationRates"] == 1


def test_fresh_driver_samples_suppress_rates_until_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    """While driver samples arrive the plain rates are not read; after >1 s without any they are."""
    gpu = FakeGpu(0, util_samples=[(1, 90)], rates=(0, 0))
    FakeNvml(monkeypatch, [gpu])
    sampler = NvmlSampler("node1")
    sampler.sample(NOW_NS)
    sampler.sample(NOW_NS + 500_000_000)
    assert gpu.calls["nvmlDeviceGetUtilizationRates"] == 0
    tick = _tick(sampler.sample(NOW_NS + 1_500_000_000), 0, NOW_NS + 1_500_000_000)
    assert tick.utilization_ratio == 0.0 and gpu.calls["nvmlDeviceGetUtilizationRates"] == 1


def test_samples_unsupported_falls_back_to_rates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without nvmlDeviceGetSamples the tick record carries nvmlDeviceGetUtilizationRates."""
    gpu = FakeGpu(0, rates=(63, 21), fail={"nvmlDeviceGetSamples": pynvml.NVML_ERROR_NOT_SUPPORTED})
    FakeNvml(monkeypatch, [gpu])
    sampler = NvmlSampler("node1")
    for i in range(2):
        (s,) = sampler.sample(NOW_NS + i)
        assert (s.utilization_ratio, s.memory_utilization_ratio) == (0.63, 0.21)


def test_gpm_metrics_on_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPM percentages become ratios and MiB/s become bytes/s; PCIe falls back to GPM's rates."""
    gpu = FakeGpu(0, util_samples=[(1, 50)], gpm={
        pynvml.NVML_GPM_METRIC_SM_UTIL: 42.0, pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: 12.5,
        pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 30.0, pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: 3.0,
        pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: 1.5})
    FakeNvml(monkeypatch, [gpu])
    sampler = NvmlSampler("node1")
    s = _tick(sampler.sample(NOW_NS), 0, NOW_NS)
    assert (s.sm_active_ratio, s.sm_occupancy_ratio, s.tensor_active_ratio) == (0.42, 0.125, 0.3)
    assert (s.pcie_tx_bytes_per_s, s.pcie_rx_bytes_per_s) == (3.0 * 2**20, 1.5 * 2**20)
    assert s.nvlink_tx_bytes_per_s is None  # NOT_SUPPORTED per metric
    assert gpu.calls["nvmlDeviceGetPcieThroughput"] == 0


def test_gpm_pcie_rates_spare_the_byte_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where GPM gives PCIe rates a tick asks the field values for the instant power alone: on the
    H200 the two byte counters cost 0.2-0.3 ms of CPU a tick, GPM's sample about 55 us."""
    gpu = FakeGpu(0, util_samples=[(1, 50)], pcie_counts=(1, 0, 0), gpm={
        pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: 3.0, pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: 1.5})
    asked: list[list[int]] = []
    FakeNvml(monkeypatch, [gpu])
    real = pynvml.nvmlDeviceGetFieldValues

    def field_values(handle: Any, ids: list[int]) -> Any:
        asked.append(list(ids))
        return real(handle, ids)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetFieldValues", field_values)
    sampler = NvmlSampler("node1")
    ticks = [_tick(sampler.sample(NOW_NS + i * 100_000_000), 0, NOW_NS + i * 100_000_000) for i in range(3)]
    assert all((t.pcie_tx_bytes_per_s, t.pcie_rx_bytes_per_s) == (3.0 * 2**20, 1.5 * 2**20) for t in ticks)
    assert all(pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES not in ids for ids in asked)
    assert asked[1:] == [[pynvml.NVML_FI_DEV_POWER_INSTANT]] * 2  # the first also asks the energy


def test_pcie_throughput_call_is_rate_limited(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without counters or GPM, the blocking 20 ms throughput call runs at most once a second."""
    gpu = FakeGpu(0, util_samples=[(1, 50)])
    FakeNvml(monkeypatch, [gpu])
    sampler = NvmlSampler("node1")
    first = _tick(sampler.sample(NOW_NS), 0, NOW_NS)
    assert (first.pcie_tx_bytes_per_s, first.pcie_rx_bytes_per_s) == (1000 * 1024.0, 2000 * 1024.0)
    for i in range(1, 15):  # 100 ms ticks up to 1.4 s
        sampler.sample(NOW_NS + i * 100_000_000)
    assert gpu.calls["nvmlDeviceGetPcieThroughput"] == 2 * 2  # at t=0 and t=1 s, TX and RX each


def test_ctypes_sample_values_follow_declared_type(monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver sample declared as double is read from the union's double member."""
    gpu = FakeGpu(0)
    fake = FakeNvml(monkeypatch, [gpu])

    def double_samples(g: FakeGpu, kind: int, last_seen: int) -> tuple[int, list[Any]]:
        s = pynvml.c_nvmlSample_t()
        s.timeStamp = 7
        s.sampleValue.dVal = ctypes.c_double(55.0).value
        return pynvml.NVML_VALUE_TYPE_DOUBLE, [s] if last_seen < 7 else []

    monkeypatch.setattr(pynvml, "nvmlDeviceGetSamples", double_samples)
    sampler = NvmlSampler("node1")
    (driver,) = [s for s in sampler.sample(NOW_NS) if s.ts_ns == 7000]
    assert driver.utilization_ratio == 0.55 and fake.gpus[0] is gpu


async def test_agent_serves_nvml_backend_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the agent: memory utilization from its own driver samples, a lost GPU flagged."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    from gputrace.agent.server import Agent, AgentSettings

    gpus = [FakeGpu(0, util_samples=[(1_000, 80)], mem_samples=[(1_500, 40)]),
            FakeGpu(1, util_samples=[(1, 5)])]
    FakeNvml(monkeypatch, gpus)
    agent = Agent(NvmlSampler("node1"), AgentSettings(port=0, interval_s=60), host="node1")
    await agent.start()
    try:
        gpus[1].lost = True
        agent.loop.tick()
        async with aiohttp.ClientSession() as session, \
                session.get(f"http://127.0.0.1:{agent.port}/metrics") as resp:
            text = await resp.text()
    finally:
        await agent.stop()
    values = {(s.name, s.labels["gpu"]): s.value for f in text_string_to_metric_families(text)
              for s in f.samples if "gpu" in s.labels}
    assert values[("gputrace_gpu_utilization_ratio", "0")] == 0.8
    assert values[("gputrace_gpu_memory_utilization_ratio", "0")] == 0.4
    assert values[("gputrace_gpu_lost", "0")] == 0.0 and values[("gputrace_gpu_lost", "1")] == 1.0
    assert ("gputrace_gpu_power_watts", "1") not in values  # a lost GPU's values are not exported
    assert values[("gputrace_gpu_power_watts", "0")] == 312.5


def test_the_prepared_h200_probe_runs_against_the_fake(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Any) -> None:
    """bench/agent_h200.py's NVML probe (run only where a device is lent, where a crash would waste
    the device time) completes on the fake and reports each call's cost and GPM's answers."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "agent_h200.py"
    spec = importlib.util.spec_from_file_location("agent_h200", path)
    assert spec is not None and spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    gpu = FakeGpu(0, util_samples=[(1_000_000, 40), (1_166_667, 90)], pcie_counts=(1, 0, 0),
                  gpm={pynvml.NVML_GPM_METRIC_SM_UTIL: 42.0})
    FakeNvml(monkeypatch, [gpu])
    monkeypatch.setattr(probe.time, "sleep", lambda _s: None)
    probe.run_probe(str(tmp_path / "probe.json"))
    result = json.loads((tmp_path / "probe.json").read_text())
    assert result["samples_gpu"]["median_period_us"] == 166_667
    assert result["gpm"]["SM_UTIL"] == 42.0
    assert set(result["fields"].values()) == {"ok"}
    assert result["sampler"]["ticks"] == 50 and result["sampler"]["rows"] >= 50
    costs = result["call_cost_us"]
    assert len(costs) == 14 and all(isinstance(v, float) for v in costs.values())  # GPM's included


def test_the_prepared_h200_summary_reads_each_phase(tmp_path: Any) -> None:
    """bench/agent_h200.py's summary of the files a device run leaves: per phase (matmul, one
    spinning thread, idle) the agent's utilization and SM activity beside nvidia-smi's."""
    import importlib.util
    import json
    from datetime import UTC, datetime
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "agent_h200.py"
    spec = importlib.util.spec_from_file_location("agent_h200", path)
    assert spec is not None and spec.loader is not None
    h200 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(h200)
    s = 10**9
    t0 = 1_780_000_000 * s
    (tmp_path / "matmul.json").write_text(json.dumps(
        {"start_ns": t0 + 5 * s, "end_ns": t0 + 20 * s, "spin_end_ns": t0 + 25 * s, "matmuls": 1,
         "spins": 1}))

    def phase(ts: int) -> tuple[float, float]:  # utilization, SM activity
        if t0 + 5 * s <= ts < t0 + 20 * s:
            return 1.0, 0.95
        return (1.0, 0.01) if ts < t0 + 25 * s else (0.0, 0.0)

    ticks = range(t0, t0 + 30 * s, s // 10)
    (tmp_path / "agent_samples.ndjson").write_text("".join(
        json.dumps({"seq": i, "gpu_index": 0, "ts_ns": ts, "utilization_ratio": phase(ts)[0],
                    "sm_active_ratio": phase(ts)[1], "tensor_active_ratio": None, "power_w": 100.0}) + "\n"
        for i, ts in enumerate(ticks)))
    smi_lines = ["timestamp, utilization.gpu [%], power.draw [W]"] + [
        f"{datetime.fromtimestamp(ts / s, UTC).strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]}, "
        f"{int(phase(ts)[0] * 100)} %, 100.00 W" for ts in ticks]
    (tmp_path / "nvidia_smi.csv").write_text("\n".join(smi_lines) + "\n")
    summary = h200.summarize(tmp_path, agent_cpu_s=0.1, wall_s=30.0)
    means = summary["phase_means"]
    assert means["matmul"] == {"agent_utilization": 1.0, "agent_sm_active": 0.95, "agent_tensor_active": None,
                               "smi_utilization": 1.0}
    assert means["spin"]["agent_utilization"] == 1.0 and means["spin"]["agent_sm_active"] == 0.01
    assert means["idle_after"]["smi_utilization"] == 0.0
    assert summary["util_1s_bins_mean_abs_diff"] == 0.0
    assert summary["fall_s_agent"] == summary["fall_s_smi"] == 0.0


def test_the_fake_takes_the_arguments_pynvml_takes() -> None:
    """The fake stands at the pynvml boundary, so each of its functions must take what pynvml's own
    takes: a fake that took a device handle for nvmlGpmSampleAlloc hid a TypeError that stopped the
    agent at its start on the first real H200 it ran on."""
    import inspect

    mismatched = {}
    for name in dir(FakeNvml):
        if not name.startswith("nvml"):
            continue
        fake = list(inspect.signature(getattr(FakeNvml, name)).parameters)[1:]  # without self
        real = inspect.signature(getattr(pynvml, name)).parameters.values()
        required = [p.name for p in real if p.default is inspect.Parameter.empty]
        if not len(required) <= len(fake) <= len(real):
            mismatched[name] = (fake, required)
    assert not mismatched
