"""A simulated GPU backend: NVML-like samples from a pattern or from the simulator's feed file.

The feed format is the simulator's contract (kernel-busy intervals per GPU, see the project brief
FEED.md); a pattern (square wave, constant, idle) lets ``gputrace agent --backend sim`` run alone.
Values follow NVML's semantics: utilization is the busy share of each driver sample period, power
lies between idle and the limit by activity, PCIe rates are bytes in the window over its length.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections import deque
from dataclasses import dataclass
from itertools import pairwise
from operator import sub
from typing import Protocol

from gputrace.errors import SourceError, UsageError
from gputrace.gpu.sampler import SampleRow
from gputrace.json_types import JsonObject
from gputrace.logsetup import get_logger
from gputrace.model import DeviceInfo, GpuSample

log = get_logger("gpu.sim")

DRIVER_PERIOD_NS = 1_000_000_000 // 6  # NVML's utilization period on recent datacenter GPUs
FEED_KIND = "gputrace-sim-gpu"
_IDLE_REASON = 0x1  # nvmlClocksEventReasonGpuIdle
# How far behind the wall clock a feed is sampled. The simulator writes a kernel's interval when it
# issues it, but it falls behind the clock on shared cores, another node's intervals reach its file
# over TCP, and a node whose clock steps keeps the frame it started in: an interval written after
# the agent sampled its period would be lost for good (a stage reading idle while it computed).
# A real driver's samples are late too (each covers the period before it).
FEED_LAG_NS = 500_000_000
_MAX_BAD_LINES_LOGGED = 10


@dataclass(frozen=True, slots=True)
class SimGpuModel:
    """The simulated GPU's constants (an H100-class part unless the feed says otherwise)."""

    name: str = "NVIDIA H100 80GB HBM3"
    power_limit_w: float = 700.0
    idle_power_w: float = 70.0
    pcie_gen: int = 5
    pcie_width: int = 16
    memory_total_bytes: int = 80 * 1024**3
    sm_clock_max_hz: float = 1.98e9
    sm_clock_idle_hz: float = 345e6
    memory_clock_hz: float = 2.619e9
    pattern_pcie_bytes_per_s: float = 2.0e9  # PCIe traffic at full activity for pattern mode


@dataclass(frozen=True, slots=True)
class FeedHeader:
    """The feed's header line: its GPUs, their host, and what they are (None: the model's own)."""

    gpus: int
    host: str | None = None
    gpu_name: str | None = None
    power_limit_w: float | None = None
    idle_power_w: float | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None
    memory_total_bytes: int | None = None

    def model(self, base: SimGpuModel) -> SimGpuModel:
        """The simulated GPU this header describes, ``base``'s constants where it names none."""
        def given(value: float | None, default: float) -> float:
            return default if value is None else value

        return SimGpuModel(
            name=base.name if self.gpu_name is None else self.gpu_name,
            power_limit_w=given(self.power_limit_w, base.power_limit_w),
            idle_power_w=given(self.idle_power_w, base.idle_power_w),
            pcie_gen=base.pcie_gen if self.pcie_gen is None else self.pcie_gen,
            pcie_width=base.pcie_width if self.pcie_width is None else self.pcie_width,
            memory_total_bytes=base.memory_total_bytes if self.memory_total_bytes is None
            else self.memory_total_bytes)


# A tick's activity: per driver period, each GPU's busy seconds; and each GPU's busy seconds, tx
# bytes and rx bytes in the tick's window.
TickActivity = tuple[list[list[float]], list[float], list[float], list[float]]


class Activity(Protocol):
    """What the GPUs did, asked once per tick for every GPU and window (the windows are shared)."""

    def windows(self, edges_ns: list[int], t0_ns: int, t1_ns: int) -> TickActivity:
        """The periods between consecutive ``edges_ns`` (the driver's), and the window t0..t1."""
        ...


class PatternActivity:
    """``square`` (period 2 s, half busy, phase shifted per GPU like pipeline stages), ``constant``
    (``constant:0.8``) or ``idle``."""

    def __init__(self, pattern: str, gpu_count: int, pcie_bytes_per_s: float) -> None:
        kind, _, arg = pattern.partition(":")
        self.kind = kind
        self.level = 0.0
        self.period_ns = 2_000_000_000
        self.duty = 0.5
        self.gpu_count = max(gpu_count, 1)
        self.pcie_bytes_per_s = pcie_bytes_per_s
        self._memo: dict[int, list[float]] = {}
        try:
            if kind == "constant":
                self.level = float(arg) if arg else 0.8
            elif kind == "square" and arg:
                period_s, _, duty = arg.partition(":")
                self.period_ns = int(float(period_s) * 1e9)
                self.duty = float(duty) if duty else 0.5
            elif kind not in ("square", "idle"):
                raise ValueError(kind)
        except ValueError as exc:
            raise UsageError(f"--sim-pattern {pattern!r}: expected square[:PERIOD_S[:DUTY]], "
                             "constant[:LEVEL] or idle") from exc
        if not (0.0 <= self.level <= 1.0 and 0.0 <= self.duty <= 1.0 and self.period_ns > 0):
            raise UsageError(f"--sim-pattern {pattern!r}: levels are 0..1, the period positive")
        # each GPU's square wave is shifted by its share of the period, like pipeline stages
        self._offsets_ns = [g * self.period_ns // self.gpu_count for g in range(self.gpu_count)]

    def windows(self, edges_ns: list[int], t0_ns: int, t1_ns: int) -> TickActivity:
        # one call, no helper calls or comprehensions (each a frame in 3.11): at 10 Hz the
        # interpreter is cold at every tick and each frame entered costs microseconds
        n = self.gpu_count
        periods: list[list[float]] = []
        if self.kind == "square":
            # each GPU's busy seconds from the epoch to t (windows chain, so remember recent ends)
            memo = self._memo
            period = self.period_ns
            busy_ns = self.duty * period
            ends: list[list[float]] = []
            for t_ns in (*edges_ns, t0_ns, t1_ns):
                values = memo.get(t_ns)
                if values is None:
                    values = []
                    append = values.append
                    # divmod(t_ns - offset, period) per GPU from one divmod of t_ns (offset < period):
                    # the same integers, without a long division per GPU
                    base_cycles, base_into = divmod(t_ns, period)
                    for offset in self._offsets_ns:
                        into = base_into - offset
                        if into < 0:
                            into += period
                            cycles = base_cycles - 1
                        else:
                            cycles = base_cycles
                        append((cycles * busy_ns + (into if into < busy_ns else busy_ns)) / 1e9)
                    if len(memo) > 4:
                        del memo[next(iter(memo))]  # the oldest end; the newer ones are asked next
                    memo[t_ns] = values
                ends.append(values)
            for i in range(len(edges_ns) - 1):
                periods.append(list(map(sub, ends[i + 1], ends[i])))  # C loops: no frames
            busy = list(map(sub, ends[-1], ends[-2]))
        else:
            level = self.level if self.kind == "constant" else 0.0
            for i in range(len(edges_ns) - 1):
                periods.append([level * (edges_ns[i + 1] - edges_ns[i]) / 1e9] * n)
            busy = [level * (t1_ns - t0_ns) / 1e9] * n
        moved = list(map(self.pcie_bytes_per_s.__mul__, busy))
        return periods, busy, moved, moved


class FeedActivity:
    """Tails the simulator's feed file: kernel-busy intervals with their PCIe bytes, per GPU."""

    def __init__(self, path: str, wait_s: float = 10.0) -> None:
        self.path = path
        self.bad_lines = 0
        self._line_no = 0
        self._partial = b""
        deadline = time.monotonic() + wait_s
        first = self._first_line()
        while first is None:
            if time.monotonic() > deadline:
                raise SourceError(f"{path}: no feed header after {wait_s:g} s "
                                  "(is `gputrace sim serve` writing it?)")
            time.sleep(0.05)
            first = self._first_line()
        self._line_no = 1
        try:
            self.header = self._checked_header(first)
        except SourceError:
            self._file.close()  # a feed refused is not tailed: its file is not left open
            raise
        self.gpu_count: int = self.header.gpus
        self.intervals: list[deque[tuple[int, int, int, int]]] = [deque() for _ in range(self.gpu_count)]

    def _first_line(self) -> bytes | None:
        """The feed's header line, with the file kept open after it; None until it is written whole."""
        try:
            self._file = open(self.path, "rb")  # noqa: SIM115  (kept open: the feed is tailed)
        except FileNotFoundError:
            return None
        first = self._file.readline()
        if not first.endswith(b"\n"):
            self._file.close()
            return None
        return first

    def _checked_header(self, first: bytes) -> FeedHeader:
        """The header line as this simulator's feed header (with a positive integer 'gpus')."""
        try:
            header = json.loads(first)
        except ValueError as exc:
            raise SourceError(f"{self.path}:1: feed header is not JSON: {exc}") from exc
        if not isinstance(header, dict):
            raise SourceError(f"{self.path}:1: feed header is not a JSON object")
        if header.get("feed") != FEED_KIND or header.get("version") != 1:
            raise SourceError(f"{self.path}: not a {FEED_KIND} version 1 feed (header {header!r})")
        gpus = header.get("gpus")
        if not isinstance(gpus, int) or gpus < 1:
            raise SourceError(f"{self.path}: feed header needs a positive integer 'gpus'")

        host, name = header.get("host"), header.get("gpu_name")
        return FeedHeader(
            gpus, host=str(host) if host else None, gpu_name=None if name is None else str(name),
            power_limit_w=self._header_number(header, "power_limit_w"),
            idle_power_w=self._header_number(header, "idle_power_w"),
            pcie_gen=self._header_count(header, "pcie_gen"),
            pcie_width=self._header_count(header, "pcie_width"),
            memory_total_bytes=self._header_count(header, "memory_total_bytes"))

    def _header_number(self, header: JsonObject, name: str) -> float | None:
        value = header.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SourceError(f"{self.path}: feed header's {name!r} is not a number: {value!a}")
        return float(value)

    def _header_count(self, header: JsonObject, name: str) -> int | None:
        value = self._header_number(header, name)
        if value is not None and not value.is_integer():
            raise SourceError(f"{self.path}: feed header's {name!r} is not a whole number: {value!a}")
        return None if value is None else int(value)

    def poll(self) -> None:
        """Read every whole line appended since the last poll."""
        chunk = self._file.read()
        if not chunk:
            return
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            self._line_no += 1
            if line.strip():
                self._add(line)

    def _add(self, line: bytes) -> None:
        try:
            row = json.loads(line)
            gpu, start, end = row["gpu"], row["start_ns"], row["end_ns"]
            tx, rx = row.get("tx_bytes", 0), row.get("rx_bytes", 0)
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (gpu, start, end, tx, rx)):
                raise ValueError("gpu, start_ns, end_ns, tx_bytes, rx_bytes must be integers")
            if not 0 <= gpu < self.gpu_count or end < start:
                raise ValueError(f"gpu {gpu} outside 0..{self.gpu_count - 1} or end before start")
        except (ValueError, KeyError, TypeError) as exc:
            self.bad_lines += 1
            if self.bad_lines <= _MAX_BAD_LINES_LOGGED:
                log.warning("bad feed line skipped", path=self.path, line=self._line_no,
                            error=str(exc), bad_lines=self.bad_lines)
            return
        self.intervals[gpu].append((start, end, tx, rx))

    def prune(self, before_ns: int) -> None:
        for queue in self.intervals:
            while queue and queue[0][1] < before_ns:
                queue.popleft()

    def busy_s(self, gpu: int, t0_ns: int, t1_ns: int) -> float:
        busy = 0
        for start, end, _, _ in self.intervals[gpu]:
            if start >= t1_ns:
                break
            if end > t0_ns:
                busy += min(end, t1_ns) - max(start, t0_ns)
        return busy / 1e9

    def pcie_bytes(self, gpu: int, t0_ns: int, t1_ns: int) -> tuple[float, float]:
        tx = rx = 0.0
        for start, end, itx, irx in self.intervals[gpu]:
            if start >= t1_ns:
                break
            if end <= t0_ns and end != start:
                continue
            # bytes are spread evenly over the interval; a zero-length one counts where it lies
            share = 1.0 if end == start else (min(end, t1_ns) - max(start, t0_ns)) / (end - start)
            if end == start and not t0_ns < start <= t1_ns:
                share = 0.0
            tx += itx * share
            rx += irx * share
        return tx, rx

    def windows(self, edges_ns: list[int], t0_ns: int, t1_ns: int) -> TickActivity:
        gpus = range(self.gpu_count)
        periods = [[self.busy_s(g, a, b) for g in gpus] for a, b in pairwise(edges_ns)]
        pcie = [self.pcie_bytes(g, t0_ns, t1_ns) for g in gpus]
        return (periods, [self.busy_s(g, t0_ns, t1_ns) for g in gpus], [tx for tx, _ in pcie],
                [rx for _, rx in pcie])

    def close(self) -> None:
        self._file.close()


class SimulatedSampler:
    """The Sampler interface over simulated GPUs (``--backend sim``)."""

    backend = "sim"

    def __init__(self, host: str | None = None, gpu_count: int = 8, *, pattern: str = "square",
                 feed_path: str | None = None, feed_wait_s: float = 10.0,
                 model: SimGpuModel | None = None, driver_period_ns: int = DRIVER_PERIOD_NS,
                 feed_lag_ns: int = FEED_LAG_NS) -> None:
        self.feed = FeedActivity(feed_path, feed_wait_s) if feed_path else None
        self.lag_ns = feed_lag_ns if self.feed is not None else 0
        base = model or SimGpuModel()
        if self.feed is not None:
            gpu_count = self.feed.gpu_count
            base = self.feed.header.model(base)
            host = host or self.feed.header.host
        if gpu_count < 1:
            raise UsageError("--sim-gpus must be at least 1")
        self.model = base
        self.host = host or socket.gethostname()
        self.gpu_count = gpu_count
        self.activity: Activity = self.feed or PatternActivity(pattern, gpu_count,
                                                               base.pattern_pcie_bytes_per_s)
        self.driver_period_ns = driver_period_ns
        now = time.time_ns() - self.lag_ns
        # every GPU is sampled at the same instants, so the driver periods and ticks are shared
        self._next_driver_ns = now // driver_period_ns * driver_period_ns  # the last period is done
        self._last_tick_ns: int | None = None
        self._energy_j = [0.0] * gpu_count
        self._temperature_c = [32.0] * gpu_count
        self._memory_used = int(base.memory_total_bytes * (0.9 if self.feed else 0.75))
        self._constants = (self.host, base.idle_power_w, base.power_limit_w - base.idle_power_w,
                           base.sm_clock_max_hz, base.sm_clock_idle_hz, base.memory_clock_hz,
                           self._memory_used, base.memory_total_bytes)  # what every tick row repeats

    def devices(self) -> list[DeviceInfo]:
        m = self.model
        return [DeviceInfo(host=self.host, gpu_index=g,
                           uuid=f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{self.host}.gpu{g}.sim')}",
                           name=m.name, pci_bus_id=f"00000000:{0x18 + 0x10 * g % 0xE0:02X}:00.0",
                           pcie_max_gen=m.pcie_gen, pcie_max_width=m.pcie_width,
                           power_limit_w=m.power_limit_w, memory_total_bytes=m.memory_total_bytes)
                for g in range(self.gpu_count)]

    def versions(self) -> dict[str, str | None]:
        return {"driver_version": None, "nvml_version": None,
                "sim_source": f"feed:{self.feed.path}" if self.feed else "pattern"}

    def sample(self, now_ns: int) -> list[GpuSample]:
        return [GpuSample(*row) for row in self.sample_rows(now_ns)]

    def sample_rows(self, now_ns: int) -> list[SampleRow]:
        if self.feed is not None:
            self.feed.poll()
            now_ns -= self.lag_ns  # the samples end where the feed is complete
        period = self.driver_period_ns
        # the driver's own samples, one per period boundary passed (at most ~2 s of them): the
        # periods end at edges[1:]
        t = self._next_driver_ns
        oldest = now_ns - 12 * period - (now_ns % period)
        if t < oldest:
            t = oldest
        edges = list(range(t - period, now_ns + 1, period)) if t <= now_ns else []
        if edges:
            self._next_driver_ns = edges[-1] + period
        last = self._last_tick_ns
        dt_ns = now_ns - last if last is not None else 100_000_000
        self._last_tick_ns = now_ns
        window = dt_ns if dt_ns > 20_000_000 else 20_000_000
        periods, busy_w, tx_w, rx_w = self.activity.windows(edges, now_ns - window, now_ns)
        driver = list(zip(edges[1:], periods, strict=True))
        cooling = dt_ns / 20e9  # first-order thermal model, 20 s time constant
        if cooling > 1.0:
            cooling = 1.0
        host, idle_w, span_w, sm_max, sm_idle, mem_clock, used, total = self._constants
        energy, temperature = self._energy_j, self._temperature_c
        same_bytes = tx_w is rx_w  # patterns move as much each way
        out: list[SampleRow] = []
        append = out.append
        for g in range(self.gpu_count):
            if driver:
                for t, busy_d in driver:  # NVML reports whole percents
                    util = int(busy_d[g] * 1e11 / period + 0.5) / 100
                    # a row of GpuSample(host, g, t, util, memory util): power_w .. seq None, lost False
                    append((host, g, t, util, int(util * 55 + 0.5) / 100, None, None, None, None, None,
                            None, None, None, None, None, None, None, None, None, None, None, False))
            busy = busy_w[g] * 1e9 / window
            if busy > 1.0:
                busy = 1.0
            power = idle_w + span_w * busy
            energy_j = energy[g] = energy[g] + power * dt_ns / 1e9
            temp = temperature[g]
            temp = temperature[g] = temp + (32.0 + 40.0 * busy - temp) * cooling  # towards 32..72 C
            active = busy > 0.01
            tx = tx_w[g] * 1e9 / window
            # every GpuSample field in order; the NVLink rates and seq None, lost False
            append((host, g, now_ns, None, None, power, energy_j, tx,
                    tx if same_bytes else rx_w[g] * 1e9 / window, sm_max if active else sm_idle, mem_clock,
                    used, total, temp, 0 if active else _IDLE_REASON, 0.9 * busy, 0.35 * busy, 0.55 * busy,
                    None, None, None, False))
        if self.feed is not None:
            self.feed.prune(now_ns - 4 * 1_000_000_000)
        return out

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()
