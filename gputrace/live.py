"""What the collector knows right now: the newest engine line per rank, recent GPU utilization,
the load in flight; exported as Prometheus families at scrape time and as JSON for `watch`.

The live bubble estimate per stage is the share of the last ``window_s`` in which the stage's GPUs
idled while the engine had requests running or waiting on that stage: each utilization sample is
set against whether the stage had work at the sample's time (the analysis' own ``busy_and_bubble``,
on the collector's clock: sample times are corrected by the host's latest clock probe).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gputrace import metric_names as mn
from gputrace.analysis.metrics import busy_and_bubble
from gputrace.exposition import Collector, Metric, family
from gputrace.model import ClockProbe, GpuSample, Marker, RequestRecord, SchedulerEvent
from gputrace.topology import Placement
from gputrace.vocabulary import LiveStatus

RankKey = tuple[str, int, int, int]  # host, pp_rank, tp_rank, dp_rank


@dataclass(slots=True)
class EngineRank:
    """The newest values logged by one engine rank."""

    running_req: int | None = None
    queue_req: int | None = None
    gen_throughput_tok_s: float | None = None
    token_usage: float | None = None
    seen_ns: int = 0


@dataclass(slots=True)
class GpuLive:
    """Recent samples of one GPU: (ns on the collector's clock, utilization, power, tx, rx)."""

    samples: deque[tuple[int, float | None, float | None, float | None, float | None]] = field(
        default_factory=lambda: deque(maxlen=4096))


class LiveState:
    """Mutable live view, updated by the collector's tasks on one event loop."""

    def __init__(self, run: str, placements: Iterable[Placement] = (), window_s: float = 10.0,
                 clock_ns: Callable[[], int] = time.time_ns):
        self.run = run
        self.window_s = window_s
        self.placements = list(placements)
        self.clock_ns = clock_ns
        self.engine: dict[RankKey, EngineRank] = {}
        self.gpus: dict[tuple[str, int], GpuLive] = {}
        # per stage, when it gained or lost work (running or queued requests on any of its ranks):
        # (ns on the collector's clock, has work), oldest first
        self.stage_work: dict[int, deque[tuple[int, bool]]] = {}
        self.clock_offset_ns: dict[str, int] = {}  # host clock - collector clock, from the probes
        self.inflight_probe: Callable[[], int] | None = None  # the in-process load generator's count
        self.target_concurrency: int | None = None
        self.phase: str | None = None
        self.counts: dict[str, int] = dict.fromkeys(mn.COLLECTOR_COUNTS, 0)

    # -- updates --------------------------------------------------------------------------------

    def on_event(self, ev: SchedulerEvent) -> None:
        pp = ev.pp_rank or 0
        key = (ev.host, pp, ev.tp_rank or 0, ev.dp_rank or 0)
        rank = self.engine.setdefault(key, EngineRank())
        if ev.running_req is not None:
            rank.running_req = ev.running_req
        if ev.queue_req is not None:
            rank.queue_req = ev.queue_req
        if ev.gen_throughput_tok_s is not None:
            rank.gen_throughput_tok_s = ev.gen_throughput_tok_s
        if ev.token_usage is not None:
            rank.token_usage = ev.token_usage
        rank.seen_ns = ev.recv_ts_ns if ev.recv_ts_ns is not None else self.clock_ns()
        self.counts["scheduler_events"] += 1
        has_work = any((r.running_req or 0) + (r.queue_req or 0) > 0
                       for (_h, p, _t, _d), r in self.engine.items() if p == pp)
        changes = self.stage_work.setdefault(pp, deque(maxlen=4096))
        if not changes or changes[-1][1] != has_work:
            changes.append((rank.seen_ns, has_work))

    def on_clock_probe(self, probe: ClockProbe) -> None:
        self.clock_offset_ns[probe.host] = probe.offset_ns

    def on_samples(self, samples: Iterable[GpuSample], clock_host: str | None = None) -> None:
        """``clock_host``: the configured host the samples came from (its probes' name), when the
        agent calls itself something else."""
        offsets = self.clock_offset_ns
        for s in samples:
            live = self.gpus.setdefault((s.host, s.gpu_index), GpuLive())
            offset = offsets.get(clock_host or s.host, 0)
            live.samples.append((s.ts_ns - offset, s.utilization_ratio, s.power_w,
                                 s.pcie_tx_bytes_per_s, s.pcie_rx_bytes_per_s))
            self.counts["gpu_samples"] += 1

    def on_marker(self, marker: Marker) -> None:
        self.counts["markers"] += 1
        if marker.kind == "phase":
            self.phase = marker.label
            self.target_concurrency = marker.target_concurrency
        elif marker.kind == "end":
            self.phase = None
            self.target_concurrency = None

    def on_request(self, record: RequestRecord) -> None:
        self.counts["requests"] += 1

    @property
    def inflight(self) -> int | None:
        """Requests in flight right now, when the load runs in this process."""
        return self.inflight_probe() if self.inflight_probe is not None else None

    # -- reads ----------------------------------------------------------------------------------

    def stages(self) -> list[dict[str, Any]]:
        """One row per pipeline stage: GPU means over the window, engine values, bubble estimate."""
        cutoff = self.clock_ns() - int(self.window_s * 1e9)
        by_stage: dict[int, list[Placement]] = {}
        for p in self.placements:
            by_stage.setdefault(p.pp_rank, []).append(p)
        for _host, pp, _tp, _dp in self.engine:
            by_stage.setdefault(pp, [])
        rows = []
        for pp in sorted(by_stage):
            util: list[float] = []
            util_ns: list[int] = []
            power: list[float] = []
            tx: list[float] = []
            rx: list[float] = []
            for p in by_stage[pp]:
                live = self.gpus.get((p.host, p.gpu_index))
                for ts, u, w, t, r in live.samples if live else ():
                    if ts < cutoff:
                        continue
                    if u is not None:
                        util.append(u)
                        util_ns.append(ts)
                    for bucket, v in ((power, w), (tx, t), (rx, r)):
                        if v is not None:
                            bucket.append(v)
            ranks = [r for (h, p, _t, _d), r in self.engine.items() if p == pp]
            running = _sum(r.running_req for r in ranks)
            queued = _sum(r.queue_req for r in ranks)
            util_mean = _mean(util)
            rows.append({
                "pp_rank": pp,
                "gpus": [f"{p.host}:{p.gpu_index}" for p in by_stage[pp]],
                "utilization_ratio": util_mean,
                "power_w": _mean(power),
                "pcie_tx_bytes_per_s": _mean(tx),
                "pcie_rx_bytes_per_s": _mean(rx),
                "running_req": running,
                "queue_req": queued,
                "gen_throughput_tok_s": _sum(r.gen_throughput_tok_s for r in ranks),
                "token_usage": max((r.token_usage for r in ranks if r.token_usage is not None),
                                   default=None),
                "bubble_ratio": self._bubble(pp, util_ns, util),
            })
        return rows

    def _bubble(self, pp: int, times_ns: list[int], utilization: list[float]) -> float | None:
        """The stage's bubble over its samples in the window (None without samples)."""
        if not utilization:
            return None
        changes = self.stage_work.get(pp, ())
        change_ns = np.array([t for t, _ in changes], dtype=np.int64)
        # work at a sample's time: the last change at or before it (none yet: no work)
        states = np.array([0.0, *(float(w) for _, w in changes)])
        work = states[np.searchsorted(change_ns, np.array(times_ns, dtype=np.int64), side="right")]
        _busy, bubble = busy_and_bubble(np.array([utilization]), work)
        return float(bubble[0])

    def status(self) -> LiveStatus:
        """What `watch` shows (the collector's /v1/status adds the store and the problems)."""
        return LiveStatus(self.run, self.phase, self.target_concurrency, self.inflight, dict(self.counts),
                          tuple(self.stages()))


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _sum(values: Iterable[float | int | None]) -> Any:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


class LiveCollector(Collector):
    """Prometheus families for the engine, the load and the stage bubble estimate, built per scrape."""

    def __init__(self, state: LiveState):
        self.state = state

    def collect(self) -> Iterable[Metric]:
        s = self.state
        for spec in mn.ENGINE_GAUGES:
            assert spec.field is not None, spec.name  # an EngineRank attribute
            fam = family(spec, spec.labels)
            for (host, pp, tp, dp), rank in sorted(s.engine.items()):
                value = getattr(rank, spec.field)
                if value is not None:
                    fam.add_metric([host, str(pp), str(tp), str(dp), s.run], float(value))
            yield fam
        inflight = family(mn.LOAD_INFLIGHT, mn.LOAD_INFLIGHT.labels)
        if s.inflight is not None:
            inflight.add_metric([s.run], float(s.inflight))
        yield inflight
        target = family(mn.LOAD_TARGET_CONCURRENCY, mn.LOAD_TARGET_CONCURRENCY.labels)
        if s.target_concurrency is not None:
            target.add_metric([s.run], float(s.target_concurrency))
        yield target
        bubble = family(mn.STAGE_BUBBLE, mn.STAGE_BUBBLE.labels)
        util = family(mn.STAGE_UTILIZATION, mn.STAGE_UTILIZATION.labels)
        for row in s.stages():
            if row["bubble_ratio"] is not None:
                bubble.add_metric([str(row["pp_rank"]), s.run], float(row["bubble_ratio"]))
            if row["utilization_ratio"] is not None:
                util.add_metric([str(row["pp_rank"]), s.run], float(row["utilization_ratio"]))
        yield bubble
        yield util
        for key, n in s.counts.items():
            spec = mn.COLLECTOR_COUNTERS[key]
            counter = family(spec, spec.labels)
            counter.add_metric([s.run], float(n))
            yield counter
