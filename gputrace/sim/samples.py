"""GPU samples with NVML semantics from the simulator's kernel-busy intervals, vectorised, and the
``nvidia-smi --query-gpu ... --format=csv`` text of them.

Utilization over a sample period [t - P, t] is the busy time overlapping it over P; PCIe rates
are the hand-off bytes in the window over P (bytes spread evenly over the interval that moved
them); power lies between idle and the limit by activity.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator

import numpy as np

from gputrace.sim.params import SimParams

IDLE_SM_CLOCK_HZ = 345e6
BUSY_SM_CLOCK_HZ = 1.755e9
MEMORY_CLOCK_HZ = 2.619e9
_GPU_IDLE_REASON = 0x1  # nvmlClocksEventReasonGpuIdle


def cumulative(starts: np.ndarray, ends: np.ndarray, xs: np.ndarray,
               amounts: np.ndarray | None = None) -> np.ndarray:
    """For sorted, non-overlapping intervals carrying ``amounts`` (default: their length) spread
    evenly over them: the amount accumulated up to each time in ``xs``."""
    if starts.size == 0:
        return np.zeros(xs.shape, dtype=np.float64)
    lengths = ends - starts
    amt = lengths if amounts is None else amounts
    before = np.concatenate(([0.0], np.cumsum(amt)))
    idx = np.searchsorted(starts, xs, side="right") - 1
    safe = np.clip(idx, 0, None)
    rate = np.divide(amt, lengths, out=np.zeros_like(amt, dtype=np.float64), where=lengths > 0)
    partial = np.clip(xs - starts[safe], 0.0, lengths[safe]) * rate[safe]
    return np.where(idx >= 0, before[safe] + partial, 0.0)


def gpu_sample_columns(p: SimParams, start_ns: int, end_s: float, intervals: dict[str, np.ndarray],
                       kv_t_s: np.ndarray, kv_used: np.ndarray, host: str,
                       work_spans: tuple[np.ndarray, np.ndarray] | None = None
                       ) -> dict[str, np.ndarray | list[str]]:
    """The gpu_samples table of a run (every GPU every ``sample_period_s``), as columns.
    ``work_spans`` (starts, ends): when the engine held requests, for NCCL's spinning receive."""
    period = p.sample_period_s
    times = np.arange(1, int(end_s / period) + 1, dtype=np.float64) * period
    edges = np.concatenate(([0.0], times))
    if p.nccl_spin and work_spans is not None and work_spans[0].size:
        ends = np.minimum(work_spans[1], end_s + period)
        has_work = np.clip(np.diff(cumulative(work_spans[0], ends, edges)) / period, 0.0, 1.0)
    else:
        has_work = np.zeros(times.size)
    rng = np.random.default_rng(p.seed + 7919)
    cols: dict[str, list[np.ndarray]] = {}
    kv_at = _step_values(kv_t_s, kv_used.astype(np.float64), times)
    for stage in range(p.pp_size):
        sel = intervals["stage"] == stage
        st, en = intervals["start_s"][sel], intervals["end_s"][sel]
        busy = np.diff(cumulative(st, en, edges))
        compute = np.clip(busy / period, 0.0, 1.0)  # the share of the period a kernel computed
        util = compute
        if p.nccl_spin:  # a waiting rank's receive kernel counts in utilization.gpu, not in SMs
            util = np.ones(times.size) if stage > 0 else np.maximum(compute, has_work)
        tx = np.diff(cumulative(st, en, np.concatenate(([0.0], times)), intervals["tx_bytes"][sel])) / period
        rx = np.diff(cumulative(st, en, np.concatenate(([0.0], times)), intervals["rx_bytes"][sel])) / period
        for tp in range(p.tp_size):
            gpu = stage * p.tp_size + tp
            noise = rng.normal(0.0, p.power_noise_w, times.size) if p.power_noise_w else 0.0
            power = np.clip(p.idle_power_w + (p.power_limit_w - p.idle_power_w) * 0.85 * compute + noise,
                            p.idle_power_w * 0.9, p.power_limit_w)
            energy = np.cumsum(power * period) + 1.0e6 * (gpu + 1)
            mem_used = p.weights_bytes_per_gpu + kv_at * p.kv_bytes_per_token_per_gpu
            _add(cols, "gpu_index", np.full(times.size, gpu, dtype=np.int64))
            _add(cols, "ts_ns", start_ns + np.round(times * 1e9).astype(np.int64))
            _add(cols, "utilization_ratio", np.round(util, 4))
            _add(cols, "memory_utilization_ratio", np.round(compute * 0.55, 4))
            _add(cols, "power_w", np.round(power, 2))
            _add(cols, "energy_j", np.round(energy, 1))
            _add(cols, "pcie_tx_bytes_per_s", np.round(tx))
            _add(cols, "pcie_rx_bytes_per_s", np.round(rx))
            _add(cols, "sm_clock_hz", np.where(util > 0, BUSY_SM_CLOCK_HZ, IDLE_SM_CLOCK_HZ))
            _add(cols, "memory_clock_hz", np.full(times.size, MEMORY_CLOCK_HZ))
            _add(cols, "memory_used_bytes", np.minimum(mem_used, p.memory_total_bytes).astype(np.int64))
            _add(cols, "memory_total_bytes", np.full(times.size, p.memory_total_bytes, dtype=np.int64))
            _add(cols, "temperature_c", np.round(32.0 + 0.12 * (power - p.idle_power_w), 1))
            _add(cols, "clock_event_reasons", np.where(util > 0, 0, _GPU_IDLE_REASON).astype(np.int64))
            # SM activity: the compute share (a decode step's kernels are taken to fill the SMs)
            _add(cols, "sm_active_ratio", np.round(compute, 4))
            _add(cols, "tensor_active_ratio", np.round(compute * 0.6, 4))
    out: dict[str, np.ndarray | list[str]] = {k: np.concatenate(v) for k, v in cols.items()}
    n_rows = len(out["ts_ns"])
    out["host"] = [host] * n_rows
    # Rows in time order, GPUs in index order within one instant, as a sampler writes them.
    order = np.lexsort((np.asarray(out["gpu_index"]), np.asarray(out["ts_ns"])))
    return {k: (v if isinstance(v, list) else v[order]) for k, v in out.items()}


def _add(cols: dict[str, list[np.ndarray]], name: str, values: np.ndarray) -> None:
    cols.setdefault(name, []).append(values)


def _step_values(t: np.ndarray, v: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """The last value set at or before each x (0 before the first)."""
    if t.size == 0:
        return np.zeros(xs.shape)
    idx = np.searchsorted(t, xs, side="right") - 1
    return np.where(idx >= 0, v[np.clip(idx, 0, None)], 0.0)


SMI_FIELDS = ("timestamp", "index", "name", "utilization.gpu", "utilization.memory", "power.draw",
              "memory.used", "memory.total", "temperature.gpu", "clocks.sm", "clocks.mem",
              "pcie.link.gen.current", "pcie.link.width.current")
SMI_HEADER = ("timestamp, index, name, utilization.gpu [%], utilization.memory [%], power.draw [W], "
              "memory.used [MiB], memory.total [MiB], temperature.gpu, clocks.sm [MHz], clocks.mem [MHz], "
              "pcie.link.gen.current, pcie.link.width.current")


def smi_csv_lines(p: SimParams, cols: dict[str, np.ndarray | list[str]]) -> Iterator[str]:
    """``nvidia-smi --query-gpu=<SMI_FIELDS> --format=csv -lms PERIOD`` output (UTC timestamps)."""
    yield SMI_HEADER
    ts = np.asarray(cols["ts_ns"])
    gpu = np.asarray(cols["gpu_index"])
    util = np.rint(np.asarray(cols["utilization_ratio"]) * 100).astype(np.int64)
    mem_util = np.rint(np.asarray(cols["memory_utilization_ratio"]) * 100).astype(np.int64)
    power = np.asarray(cols["power_w"])
    used_mib = np.asarray(cols["memory_used_bytes"]) // (1 << 20)
    total_mib = p.memory_total_bytes // (1 << 20)
    temp = np.rint(np.asarray(cols["temperature_c"])).astype(np.int64)
    sm_mhz = np.rint(np.asarray(cols["sm_clock_hz"]) / 1e6).astype(np.int64)
    mem_mhz = np.rint(np.asarray(cols["memory_clock_hz"]) / 1e6).astype(np.int64)
    last_ms = -1
    stamp = ""
    for i in range(ts.size):
        ms = int(ts[i]) // 1_000_000
        if ms != last_ms:
            last_ms = ms
            when = dt.datetime.fromtimestamp(ms // 1000, dt.UTC)
            stamp = f"{when:%Y/%m/%d %H:%M:%S}.{ms % 1000:03d}"
        yield (f"{stamp}, {gpu[i]}, {p.gpu_name}, {util[i]} %, {mem_util[i]} %, {power[i]:.2f} W, "
               f"{used_mib[i]} MiB, {total_mib} MiB, {temp[i]}, {sm_mhz[i]} MHz, {mem_mhz[i]} MHz, "
               f"{p.pcie_gen}, {p.pcie_width}")
