"""Small run stores built directly from records for the analysis tests (no simulator needed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gputrace.model import ClockProbe, DeviceInfo, EngineConfig, Marker, RequestRecord, SchedulerEvent
from gputrace.store import Store
from gputrace.topology import single_node_placements, topology_to_meta

T0 = 1_764_486_000_000_000_000


@dataclass
class Level:
    """One load level: its label, target and in-flight requests, per-stage busy share, micro-batch."""

    label: str
    target: int
    inflight: int
    busy_by_stage: list[float]
    microbatch: int
    duration_s: float = 20.0
    queue: int = 0
    token_usage: float = 0.3


@dataclass
class SynthRun:
    levels: list[Level]
    pp: int = 4
    tp: int = 1
    period_ms: int = 100
    gpu_offset_ns: int = 0  # the GPU host's clock minus the client's
    engine: dict[str, int] = field(default_factory=lambda: {"max_running_requests": 64})
    recv_times: bool = True
    markers: bool = True
    decode_log_interval: int = 1


def build(path: Path, spec: SynthRun, seed: int = 0) -> dict[str, dict[int, float]]:
    """Write the store; return the true busy fraction per level label and stage."""
    rng = np.random.default_rng(seed)
    period = spec.period_ms * 1_000_000
    n_gpu = spec.pp * spec.tp
    placements = single_node_placements("node0", spec.pp, spec.tp)
    store = Store.create(path, topology=topology_to_meta(spec.pp, spec.tp, 1, placements, "test"))
    truth: dict[str, dict[int, float]] = {}
    t = T0
    markers, reqs, events = [], [], []
    ts_all, util_all, gpu_all = [], [], []
    line = 0
    for lv in spec.levels:
        n = int(lv.duration_s * 1e9 // period)
        cells = t + period * np.arange(1, n + 1)
        markers.append(Marker("client", t, lv.label, "phase", lv.target))
        truth[lv.label] = {}
        for p in placements:
            busy = lv.busy_by_stage[p.pp_rank]
            u = np.clip(busy + rng.normal(0, 0.05, n), 0, 1)
            u += busy - u.mean()  # exact mean, so the truth is known
            u = np.clip(u, 0, 1)
            truth[lv.label][p.pp_rank] = float(u.mean())
            ts_all.append(cells + spec.gpu_offset_ns)
            util_all.append(u)
            gpu_all.append(np.full(n, p.gpu_index))
        # Closed-loop requests: `inflight` lanes, each request 2 s long, back to back to the end.
        for lane in range(lv.inflight):
            s = t + int(rng.uniform(0, 0.1e9))
            while s < t + lv.duration_s * 1e9 - 1e9:
                e = s + 2_000_000_000
                reqs.append(RequestRecord("client", f"{lv.label}-{lane}-{s}", s, s + 200_000_000, e,
                                          100, 40, phase=lv.label))
                s = e
        for sec in range(int(lv.duration_s)):
            for st in range(spec.pp):
                for k in range(4):
                    emit = t + sec * 1_000_000_000 + k * 250_000_000 + 1000 * st
                    line += 1
                    events.append(SchedulerEvent(
                        "node0", "log", "sglang", "decode", line,
                        log_ts_ns=(emit + spec.gpu_offset_ns) // 1_000_000_000 * 1_000_000_000,
                        ts_resolution_ns=1_000_000_000, recv_ts_ns=emit if spec.recv_times else None,
                        pp_rank=st, tp_rank=0, running_req=lv.microbatch, queue_req=lv.queue,
                        token_usage=lv.token_usage, gen_throughput_tok_s=100.0))
        t += int(lv.duration_s * 1e9)
    if spec.markers:
        markers.append(Marker("client", t, "end", "end"))
        store.append(markers)
    store.append(reqs)
    store.append(events)
    store.append_columns("gpu_samples", {
        "host": ["node0"] * sum(len(x) for x in ts_all), "gpu_index": np.concatenate(gpu_all),
        "ts_ns": np.concatenate(ts_all), "utilization_ratio": np.concatenate(util_all),
        "power_w": 60 + 290 * np.concatenate(util_all)})
    store.append([DeviceInfo("node0", g, power_limit_w=350.0, pcie_max_gen=5, pcie_max_width=16)
                  for g in range(n_gpu)])
    store.append([EngineConfig("node0", "log", "sglang", 0, pp_size=spec.pp, tp_size=spec.tp,
                               decode_log_interval=spec.decode_log_interval,
                               **spec.engine)])  # type: ignore[arg-type]
    rtts = [5_000_000, 200_000, 3_000_000]
    probes = []
    for i, rtt in enumerate(rtts):
        send = T0 + i * 1000
        probes.append(ClockProbe("node0", send, send + rtt // 2 + spec.gpu_offset_ns, send + rtt))
    store.append(probes)
    store.close()
    return truth


def capped_run(path: Path) -> Path:
    """PP4, a pool of 64, --pp-max-micro-batch-size 4: C=1, then C=32 with every slot at K (16
    running) and 16 waiting while the pool has rows: the micro-batch cap."""
    build(path, SynthRun([Level("C=1", 1, 1, [0.125] * 4, 1, 6),
                          Level("C=32", 32, 32, [0.9] * 4, 4, 6, queue=16)], pp=4,
                         engine={"max_running_requests": 64, "pp_max_micro_batch_size": 4}))
    return path


def fixed_run(path: Path) -> Path:
    """The same with K 64 and C=32 running in 4 micro-batches of 8 with no queue."""
    build(path, SynthRun([Level("C=1", 1, 1, [0.125] * 4, 1, 6),
                          Level("C=32", 32, 32, [0.95] * 4, 8, 6)], pp=4,
                         engine={"max_running_requests": 64, "pp_max_micro_batch_size": 64}))
    return path
