"""Small runs built directly from records for the analysis tests (no simulator needed): written to a
run store (``build``) or held in memory as the store would read them (``synth_tables``)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gputrace import __version__
from gputrace.model import (
    ClockProbe,
    DeviceInfo,
    EngineConfig,
    Marker,
    RequestRecord,
    RunMeta,
    SchedulerEvent,
    is_abandoned,
)
from gputrace.run_tables import (
    EVENT_KINDS,
    GPU_METRICS,
    EngineSettings,
    GpuSampleColumns,
    LoadGaugeColumns,
    RequestColumns,
    RunTables,
    SchedulerEventColumns,
    probe_columns,
)
from gputrace.store import SCHEMA_VERSION, Store
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


@dataclass
class SynthRecords:
    """A synthetic run's records, before they go anywhere."""

    topology: dict[str, object]
    markers: list[Marker]
    requests: list[RequestRecord]
    events: list[SchedulerEvent]
    gpu_columns: dict[str, Any]  # gpu_samples columns: host, gpu_index, ts_ns and two metrics
    devices: list[DeviceInfo]
    configs: list[EngineConfig]
    probes: list[ClockProbe]


def synth_records(spec: SynthRun, seed: int = 0) -> tuple[SynthRecords, dict[str, dict[int, float]]]:
    """The run's records, and the true busy fraction per level label and stage."""
    rng = np.random.default_rng(seed)
    period = spec.period_ms * 1_000_000
    n_gpu = spec.pp * spec.tp
    placements = single_node_placements("node0", spec.pp, spec.tp)
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
    else:
        markers = []
    gpu_columns = {
        "host": ["node0"] * sum(len(x) for x in ts_all), "gpu_index": np.concatenate(gpu_all),
        "ts_ns": np.concatenate(ts_all), "utilization_ratio": np.concatenate(util_all),
        "power_w": 60 + 290 * np.concatenate(util_all)}
    devices = [DeviceInfo("node0", g, power_limit_w=350.0, pcie_max_gen=5, pcie_max_width=16)
               for g in range(n_gpu)]
    configs = [EngineConfig("node0", "log", "sglang", 0, pp_size=spec.pp, tp_size=spec.tp,
                            decode_log_interval=spec.decode_log_interval,
                            **spec.engine)]  # type: ignore[arg-type]
    rtts = [5_000_000, 200_000, 3_000_000]
    probes = []
    for i, rtt in enumerate(rtts):
        send = T0 + i * 1000
        probes.append(ClockProbe("node0", send, send + rtt // 2 + spec.gpu_offset_ns, send + rtt))
    topology = topology_to_meta(spec.pp, spec.tp, 1, placements, "test")
    return SynthRecords(topology, markers, reqs, events, gpu_columns, devices, configs, probes), truth


def build(path: Path, spec: SynthRun, seed: int = 0) -> dict[str, dict[int, float]]:
    """Write the store; return the true busy fraction per level label and stage."""
    rec, truth = synth_records(spec, seed)
    store = Store.create(path, topology=rec.topology)
    if rec.markers:
        store.append(rec.markers)
    store.append(rec.requests)
    store.append(rec.events)
    store.append_columns("gpu_samples", rec.gpu_columns)
    store.append(rec.devices)
    store.append(rec.configs)
    store.append(rec.probes)
    store.close()
    return truth


Truth = dict[str, dict[int, float]]  # the true busy fraction per level label and stage


def synth_tables(spec: SynthRun, seed: int = 0, name: str = "r") -> tuple[RunTables, Truth]:
    """The run as Store.read_run reads it (whole, no window), built in memory: no DuckDB file."""
    rec, truth = synth_records(spec, seed)
    meta = RunMeta(name=name, created_ns=T0, gputrace_version=__version__, schema_version=SCHEMA_VERSION,
                   topology=rec.topology)
    engine_of_lines = Counter(e.engine for e in rec.events).most_common(1)
    tables = RunTables(
        meta=meta, source=f"in-memory run {name}", clock_probes=probe_columns(rec.probes),
        gpu_samples=_gpu_sample_columns(rec.gpu_columns), scheduler_events=_event_columns(rec.events),
        requests=_request_columns(rec.requests), markers=tuple(rec.markers), devices=tuple(rec.devices),
        engine=EngineSettings.from_records(rec.configs, engine_of_lines[0][0] if engine_of_lines else None))
    return tables, truth


def requests_to_gauge(tables: RunTables, source: str = "gauge") -> RunTables:
    """The request records replaced by a once-a-second gauge of the requests in flight (what a
    Prometheus import gives), its rows named ``source``."""
    rq = tables.requests
    t = np.arange(np.nanmin(rq.start_ns) + 5e8, np.nanmax(rq.end_ns), 1e9)
    inflight = np.array([np.sum((rq.start_ns <= x) & (rq.end_ns > x)) for x in t], dtype=np.float64)
    gauge = LoadGaugeColumns(t.astype(np.int64), inflight, np.full(len(t), source, dtype=object))
    return dataclasses.replace(tables, requests=RequestColumns(), load_gauge=gauge)


def _floats(values: Sequence[float | int | None]) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64)


def _gpu_sample_columns(cols: dict[str, Any]) -> GpuSampleColumns:
    hosts = np.asarray(cols["host"], dtype=object)
    index = np.asarray(cols["gpu_index"], dtype=np.int64)
    keys = tuple(sorted({(str(h), int(g)) for h, g in zip(hosts, index, strict=True)}))
    k_of = {key: k for k, key in enumerate(keys)}
    k = np.array([k_of[(str(h), int(g))] for h, g in zip(hosts, index, strict=True)], dtype=np.int64)
    n = len(index)
    metrics = {m: np.asarray(cols[m], dtype=np.float64) if m in cols else np.full(n, np.nan)
               for m in GPU_METRICS}
    return GpuSampleColumns(keys, k, np.asarray(cols["ts_ns"], dtype=np.int64), np.zeros(n, dtype=bool),
                            **metrics)


def _event_columns(events: Sequence[SchedulerEvent]) -> SchedulerEventColumns:
    """Attention-TP rank 0's placed kinds, as the store selects them."""
    kept = [e for e in events if (e.tp_rank or 0) == 0 and e.kind in EVENT_KINDS]
    text = ("host", "source", "kind")
    numbers = [f.name for f in dataclasses.fields(SchedulerEventColumns)
               if not f.name.endswith(("_code", "_names"))]
    return SchedulerEventColumns.from_text(
        *([getattr(e, name) for e in kept] for name in text),
        **{name: _floats([getattr(e, name) for e in kept]) for name in numbers})


def _request_columns(reqs: Sequence[RequestRecord]) -> RequestColumns:
    return RequestColumns(
        host=np.asarray([r.host for r in reqs], dtype=object),
        **{c: _floats([getattr(r, c) for r in reqs])
           for c in ("start_ns", "first_token_ns", "end_ns", "prompt_tokens", "completion_tokens")},
        ok=np.asarray([r.ok for r in reqs], dtype=bool),
        phase=np.asarray([r.phase or "" for r in reqs], dtype=object),
        abandoned=np.asarray([is_abandoned(r.error) for r in reqs], dtype=bool))


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
