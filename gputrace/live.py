"""What the collector knows right now: the newest engine line per rank, recent GPU utilization,
the load in flight; exported as Prometheus families at scrape time and as JSON for `watch`.

The live bubble estimate per stage is the share of the last ``window_s`` in which the stage's GPUs
idled while the engine had requests running or waiting on that stage: each busy sample (SM activity
where the GPU has it, else NVML utilization, as the report picks) is set against whether the stage
had work at the sample's time (the analysis' own ``busy_and_bubble``, on the collector's clock:
sample times are corrected by the host's latest clock probe).

Where SGLang exports its own forward timers (scraped from its /metrics), a stage's busy share
comes from them as the report ranks them: the device timer above SM activity, the loop's run_batch
below it and above utilization.gpu (``engine_metrics.engine_busy``, over the same window).

What a stage's log line says is one micro-batch; the engine's running total and the micro-batches
in flight come from the first stage's recent lines, read as the report reads them
(``schedule.engine_totals``): a stage showing "running 8" at a load of 32 is one of 4 micro-batches.

The finding shown now is the report's diagnosis (``diagnose.diagnose_phase``, the same rules and
``Thresholds``) over the last ``window_s`` read as one phase (``window_phase``): the live view
has no rules of its own.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from gputrace import metric_names as mn
from gputrace.analysis.diagnose import Finding, Thresholds, diagnose_phase
from gputrace.analysis.engine_metrics import LOOP_SERIES, EngineBusy, MetricSeries, engine_busy
from gputrace.analysis.phase_figures import BUSY_SIGNALS, PhaseMetrics, StageMetrics, busy_and_bubble
from gputrace.analysis.result import DEFAULT_THRESHOLDS  # the report's thresholds, the same object
from gputrace.analysis.schedule import engine_totals, line_sizes
from gputrace.engines import engine_words, sglang, vllm
from gputrace.exposition import Collector, Metric, family
from gputrace.json_types import JsonObject
from gputrace.model import (
    ClockProbe,
    EngineConfig,
    EngineMetricSample,
    GpuSample,
    Marker,
    RequestRecord,
    SchedulerEvent,
)
from gputrace.run_tables import EngineSettings
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
    microbatch_size: int | None = None  # the micro-batch of the newest prefill or decode line


# The first stage's lines kept for the engine's totals: enough for engine_totals' trailing window
# (2 x the slots) at the deepest schedule SGLang allows here (PP16 + 4 async slots).
RANK0_LINES = 64
# what the live view reads of each vLLM engine core's /metrics scrape: its rank gauges and its
# generated-tokens counter (whether it generated since the previous scrape)
VLLM_TOKENS = "vllm:generation_tokens_total"
VLLM_SCRAPED = frozenset({*vllm.RANK_GAUGES, VLLM_TOKENS})
STALE_AFTER_S = 3.0  # no new line or sample for this long: the view says its data is old
LIVE_SETTINGS = ("max_running_requests", "pp_max_micro_batch_size", "pp_async_batch_depth")
# The first stage's busy share over this last stretch tells how many equal micro-batches are in
# flight (the stage window's 10 s lagged a new level by seconds).
ENGINE_BUSY_WINDOW_S = 2.0
WORK_GRID_NS = 100_000_000  # where the engine's timers give a stage's busy share: its work share's grid


@dataclass(frozen=True, slots=True)
class EngineNow:
    """The engine as a whole right now: one figure each, not a copy per stage."""

    running: float | None  # requests the engine runs (all its micro-batches)
    queued: float | None  # requests waiting for admission
    microbatches_in_flight: float | None  # None: the engine logs no micro-batches (vLLM, PP 1)
    slots: int | None  # micro-batches the schedule can hold (pp_size + async depth)
    k: int | None  # the micro-batch cap (--pp-max-micro-batch-size or its default)
    pool: int | None  # the request pool (--max-running-requests, --max-num-seqs)
    source: str  # how `running` was read: "logged" (vLLM), or engine_totals' source for SGLang
    engine_kind: str | None = None  # "sglang", "vllm": which flag sets the pool


@dataclass(frozen=True, slots=True)
class LiveStage:
    """One pipeline stage over the window: its GPUs' means, its ranks' newest engine values
    (summed over data-parallel ranks), and the busy and bubble estimate with the signal it is from
    (None: no sample and no timer in the window)."""

    pp_rank: int
    gpus: tuple[str, ...] = ()  # "host:index"
    utilization_ratio: float | None = None
    power_w: float | None = None
    pcie_tx_bytes_per_s: float | None = None
    pcie_rx_bytes_per_s: float | None = None
    running_req: int | None = None
    queue_req: int | None = None
    gen_throughput_tok_s: float | None = None
    token_usage: float | None = None
    microbatch_size: int | None = None
    busy_ratio: float | None = None
    bubble_ratio: float | None = None
    busy_signal: str | None = None  # BUSY_SIGNALS' words

    def to_json(self) -> JsonObject:
        """The row of /v1/status' ``stages``, as `watch` reads it."""
        return {**asdict(self), "gpus": list(self.gpus)}


@dataclass(slots=True)
class GpuLive:
    """Recent samples of one GPU: (ns on the collector's clock, utilization, power, tx, rx)."""

    samples: deque[tuple[int, float | None, float | None, float | None, float | None, float | None]] = field(
        default_factory=lambda: deque(maxlen=4096))  # ..., SM activity last


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
        self.settings: dict[str, int] = {}  # the engine's logged settings (LIVE_SETTINGS), as seen
        self.pp_size = max((p.pp_rank for p in self.placements), default=-1) + 1 or None
        # the first stage's newest lines per (host, dp_rank): (kind, #running-req, #new-seq, #queue-req)
        self.rank0_lines: dict[tuple[str, int], deque[tuple[str, float, float, float]]] = {}
        self.engine_kind: str | None = None
        self.newest_ns: int | None = None  # when the newest line or sample arrived (collector clock)
        self.phase_starts: dict[str, int] = {}  # phase label -> its marker's ns (collector clock)
        # completed requests: (end ns, TTFT s, mean ITL s), newest last
        self.latencies: deque[tuple[int, float | None, float | None]] = deque(maxlen=4096)
        # the engine's own timer counters (LOOP_SERIES, tp_rank 0) per (name, labels JSON): their
        # labels and (scrape ns, seconds)
        self.engine_timers: dict[tuple[str, str], tuple[dict[str, str], deque[tuple[int, float]]]] = {}
        # per vLLM engine core its generated-tokens counter at the newest scrape
        self.vllm_tokens_seen: dict[RankKey, float] = {}
        self.configs: list[EngineConfig] = []  # every configuration line, merged as the report merges them
        # per stage its recent lines: (ns on the collector's clock, micro-batch size, #queue-req,
        # token usage), NaN where the line has none; the window's figures for the diagnosis
        self.stage_lines: dict[int, deque[tuple[int, float, float, float]]] = {}

    # -- updates --------------------------------------------------------------------------------

    def on_event(self, ev: SchedulerEvent) -> None:
        pp = ev.pp_rank or 0
        key = (ev.host, pp, ev.tp_rank or 0, ev.dp_rank or 0)
        rank = self.engine.setdefault(key, EngineRank())
        generating = (ev.gen_throughput_tok_s or 0.0) > 0.0
        if self._vllm_turnover(ev.engine, ev.running_req, ev.queue_req, generating):
            _forget_idle(rank)
        else:
            if ev.running_req is not None:
                rank.running_req = ev.running_req
            if ev.queue_req is not None:
                rank.queue_req = ev.queue_req
        if ev.gen_throughput_tok_s is not None:
            rank.gen_throughput_tok_s = ev.gen_throughput_tok_s
        if ev.token_usage is not None:
            rank.token_usage = ev.token_usage
        rank.seen_ns = ev.recv_ts_ns if ev.recv_ts_ns is not None else self.clock_ns()
        self._arrived(rank.seen_ns)
        self.counts["scheduler_events"] += 1
        self.engine_kind = ev.engine
        size = None
        if ev.kind in ("prefill", "decode"):
            size = (ev.running_req or 0) + ((ev.new_seq or 0) if ev.kind == "prefill" else 0)
            rank.microbatch_size = size
            if pp == 0 and (ev.tp_rank or 0) == 0:
                self.rank0_lines.setdefault((ev.host, ev.dp_rank or 0), deque(maxlen=RANK0_LINES)).append(
                    (ev.kind, float(ev.running_req or 0), float(ev.new_seq or 0), float(ev.queue_req or 0)))
        self.stage_lines.setdefault(pp, deque(maxlen=4096)).append(
            (rank.seen_ns, _nan(size), _nan(ev.queue_req), _nan(ev.token_usage)))
        has_work = any((r.running_req or 0) + (r.queue_req or 0) > 0
                       for (_h, p, _t, _d), r in self.engine.items() if p == pp)
        changes = self.stage_work.setdefault(pp, deque(maxlen=4096))
        if not changes or changes[-1][1] != has_work:
            changes.append((rank.seen_ns, has_work))

    def _vllm_turnover(self, engine: str, running: int | None, waiting: int | None, generating: bool) -> bool:
        """vLLM's stats line at PP=2 reads "Running: 0 reqs, Waiting: 0 reqs" when it falls on a
        batch turnover (seen on the real engine at C=1 and C=4, its generation throughput 96 tok/s
        over the same interval), and so do its /metrics gauges: not a reading of an idle engine
        while requests are in flight (the load's own count where this process runs it, else whether
        the engine generated tokens since its previous reading). The rank keeps its last reading."""
        if engine_words(engine).steps_logged or running != 0 or (waiting or 0) != 0:
            return False
        inflight = self.inflight
        if inflight is not None:
            return inflight > 0
        return generating

    def on_config(self, config: EngineConfig) -> None:
        """SGLang logs its settings over several lines (server_args, then each rank's limits):
        each adds what it states."""
        self.configs.append(config)
        for name in LIVE_SETTINGS:
            value = getattr(config, name)
            if value is not None:
                self.settings[name] = int(value)
        if config.pp_size:
            self.pp_size = config.pp_size

    def _arrived(self, ns: int) -> None:
        if self.newest_ns is None or ns > self.newest_ns:
            self.newest_ns = ns

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
                                 s.pcie_tx_bytes_per_s, s.pcie_rx_bytes_per_s, s.sm_active_ratio))
            self.counts["gpu_samples"] += 1
            self._arrived(self.clock_ns())

    def on_engine_metrics(self, samples: Iterable[EngineMetricSample]) -> None:
        """A scrape of the engine's /metrics (times on the collector's clock): its timer counters
        kept for the stages' busy figures, vLLM's running and waiting gauges for its rank."""
        readings: dict[RankKey, dict[str, float]] = {}
        for s in samples:
            if s.name in VLLM_SCRAPED and s.value is not None:
                dp = json.loads(s.labels_json).get("engine", "0")
                readings.setdefault((s.host, 0, 0, int(dp) if dp.isdigit() else 0), {})[s.name] = s.value
            if s.name not in LOOP_SERIES or s.value is None:
                continue
            key = (s.name, s.labels_json)
            if key not in self.engine_timers:
                labels = json.loads(s.labels_json)
                if labels.get("tp_rank", "0") not in ("0", ""):  # every TP rank times the same forward
                    continue
                self.engine_timers[key] = (labels, deque(maxlen=256))
            self.engine_timers[key][1].append((s.ts_ns, s.value))
        for rank_key, gauges in readings.items():
            self._vllm_scraped(rank_key, gauges)

    def _vllm_scraped(self, key: RankKey, gauges: dict[str, float]) -> None:
        """vLLM logs its running and waiting counts once per 10 s stats line, and at PP=2 about half
        of those lines fall on a batch turnover (0 and 0, which the rank does not take): in one CI
        run of the engine tier every line of the 75 s sweep did, and the live view had no running
        or queued count at all (the dashboard's panels empty). Its /metrics holds the same counts
        at every scrape (1 s by default), read under the same turnover rule; the generated-tokens
        counter's growth since the previous scrape says whether the engine was generating."""
        tokens, before = gauges.get(VLLM_TOKENS), self.vllm_tokens_seen.get(key)
        if tokens is not None:
            self.vllm_tokens_seen[key] = tokens
        generating = tokens is not None and before is not None and tokens > before
        read = {attr: round(gauges[name]) for name, attr in vllm.RANK_GAUGES.items() if name in gauges}
        if not read:
            return
        rank = self.engine.setdefault(key, EngineRank())
        if self._vllm_turnover(vllm.KIND, read.get("running_req"), read.get("queue_req"), generating):
            _forget_idle(rank)
            return
        for field_name, value in read.items():
            setattr(rank, field_name, value)

    def _timer_busy(self, start_ns: int, end_ns: int) -> tuple[dict[int, EngineBusy], int]:
        """Per pp_rank the engine timers' busy share over their scrapes in [start, end)
        (engine_busy's rule), and the first of those scrapes (where the share starts)."""
        series = [MetricSeries(name, labels, np.array([t for t, _ in points], dtype=np.int64),
                               np.array([v for _, v in points], dtype=np.float64))
                  for (name, _), (labels, points) in self.engine_timers.items()]
        first = min((int(t) for s in series for t in s.ts_ns if start_ns <= t < end_ns), default=start_ns)
        return (engine_busy(series, start_ns, end_ns) if series else {}), first

    def on_marker(self, marker: Marker) -> None:
        self.counts["markers"] += 1
        if marker.kind == "phase":
            self.phase_starts[marker.label] = marker.ts_ns
            self.phase = marker.label
            self.target_concurrency = marker.target_concurrency
        elif marker.kind == "end":
            self.phase = None
            self.target_concurrency = None

    def on_request(self, record: RequestRecord) -> None:
        self.counts["requests"] += 1
        if record.ok and record.end_ns is not None:
            ttft = (record.first_token_ns - record.start_ns) / 1e9 if record.first_token_ns else None
            itl = None
            if record.first_token_ns and record.completion_tokens and record.completion_tokens > 1:
                itl = (record.end_ns - record.first_token_ns) / 1e9 / (record.completion_tokens - 1)
            self.latencies.append((record.end_ns, ttft, itl))

    def latency_quantiles(self) -> dict[str, dict[str, float]]:
        """TTFT and ITL (p50, p90) of the requests completed in the window."""
        cutoff = self.clock_ns() - int(self.window_s * 1e9)
        out: dict[str, dict[str, float]] = {}
        for name, column in (("ttft", 1), ("itl", 2)):
            values = [row[column] for row in self.latencies if row[0] >= cutoff and row[column] is not None]
            if values:
                out[name] = {q: float(np.quantile(np.array(values), float(q))) for q in ("0.5", "0.9")}
        return out

    @property
    def inflight(self) -> int | None:
        """Requests in flight right now, when the load runs in this process."""
        return self.inflight_probe() if self.inflight_probe is not None else None

    # -- reads ----------------------------------------------------------------------------------

    def stages(self) -> list[LiveStage]:
        """One row per pipeline stage: GPU means over the window, engine values, bubble estimate."""
        cutoff = self.clock_ns() - int(self.window_s * 1e9)
        by_stage: dict[int, list[Placement]] = {}
        for p in self.placements:
            by_stage.setdefault(p.pp_rank, []).append(p)
        for _host, pp, _tp, _dp in self.engine:
            by_stage.setdefault(pp, [])
        now_ns = self.clock_ns()
        timers, timers_from_ns = self._timer_busy(cutoff, now_ns + 1)
        rows = []
        for pp in sorted(by_stage):
            util: list[float] = []
            util_ns: list[int] = []
            sm: list[float] = []
            sm_ns: list[int] = []
            power: list[float] = []
            tx: list[float] = []
            rx: list[float] = []
            for p in by_stage[pp]:
                live = self.gpus.get((p.host, p.gpu_index))
                for ts, u, w, t, r, a in live.samples if live else ():
                    if ts < cutoff:
                        continue
                    if u is not None:
                        util.append(u)
                        util_ns.append(ts)
                    if a is not None:
                        sm.append(a)
                        sm_ns.append(ts)
                    for bucket, v in ((power, w), (tx, t), (rx, r)):
                        if v is not None:
                            bucket.append(v)
            ranks = [r for (h, p, _t, _d), r in self.engine.items() if p == pp]
            running = _sum(r.running_req for r in ranks)
            queued = _sum(r.queue_req for r in ranks)
            util_mean = _mean(util)
            # SM activity where the GPUs give it: utilization counts a stage spinning in NCCL as busy
            signal, busy_ns, busy = ("sm_active", sm_ns, sm) if sm else ("utilization", util_ns, util)
            busy_ratio, bubble_ratio = self._busy_bubble(pp, busy_ns, busy)
            timer = timers.get(pp)
            if timer is not None and (timer.signal == "device timer" or not sm):
                # the engine's own forward timer, ranked as the report ranks it
                signal = "device_timer" if timer.signal == "device timer" else "loop_timers"
                busy_ratio = timer.busy_fraction
                bubble_ratio = max(self._work_share(pp, timers_from_ns, now_ns) - busy_ratio, 0.0)
            rows.append(LiveStage(
                pp_rank=pp,
                gpus=tuple(f"{p.host}:{p.gpu_index}" for p in by_stage[pp]),
                utilization_ratio=util_mean,
                power_w=_mean(power),
                pcie_tx_bytes_per_s=_mean(tx),
                pcie_rx_bytes_per_s=_mean(rx),
                running_req=running,
                queue_req=queued,
                gen_throughput_tok_s=_sum(r.gen_throughput_tok_s for r in ranks),
                token_usage=max((r.token_usage for r in ranks if r.token_usage is not None), default=None),
                microbatch_size=max((r.microbatch_size for r in ranks if r.microbatch_size is not None),
                                    default=None),
                busy_ratio=busy_ratio,
                bubble_ratio=bubble_ratio,
                busy_signal=BUSY_SIGNALS[signal] if busy_ratio is not None else None,
            ))
        return rows

    def _busy_bubble(self, pp: int, times_ns: list[int],
                     busy: list[float]) -> tuple[float | None, float | None]:
        """The stage's busy share and bubble over its samples in the window (None without samples)."""
        if not busy:
            return None, None
        work = self._work_at(pp, np.array(times_ns, dtype=np.int64))
        busy_share, bubble = busy_and_bubble(np.array([busy]), work)
        return float(busy_share[0]), float(bubble[0])

    def _work_at(self, pp: int, times_ns: np.ndarray) -> np.ndarray:
        """Whether the stage had work (1.0) at each time: the last change at or before it (none
        yet: no work). A stage whose ranks log no lines of their own (vLLM's stats line is the
        engine's, logged once) has the engine's work: every request passes every stage."""
        changes = self.stage_work.get(pp) or next(
            (self.stage_work[p] for p in sorted(self.stage_work) if self.stage_work[p]), ())
        change_ns = np.array([t for t, _ in changes], dtype=np.int64)
        states = np.array([0.0, *(float(w) for _, w in changes)])
        return states[np.searchsorted(change_ns, times_ns, side="right")]

    def _work_share(self, pp: int, start_ns: int, end_ns: int) -> float:
        """The share of [start, end) in which the stage had work (on a 0.1 s grid)."""
        grid = np.arange(start_ns, end_ns, WORK_GRID_NS, dtype=np.int64)
        return float(self._work_at(pp, grid).mean()) if len(grid) else 0.0

    def _recent_busy(self, pp: int, window_s: float) -> float | None:
        """The stage's busy share over the last ``window_s`` (SM activity where given)."""
        cutoff = self.clock_ns() - int(window_s * 1e9)
        util: list[float] = []
        sm: list[float] = []
        for p in self.placements:
            live = self.gpus.get((p.host, p.gpu_index)) if p.pp_rank == pp else None
            for ts, u, _w, _t, _r, a in reversed(live.samples) if live else ():
                if ts < cutoff:
                    break
                if u is not None:
                    util.append(u)
                if a is not None:
                    sm.append(a)
        return _mean(sm or util)

    def engine_now(self, first_stage_busy: float | None = None) -> EngineNow:
        """The engine's running total, queue and micro-batches in flight, from the first stage's
        recent lines (summed over data-parallel ranks); ``first_stage_busy`` (its busy share now)
        tells the count when every micro-batch has the same size, as the report's reading does."""
        cfg = self.settings
        pp = self.pp_size or 1
        slots = sglang.slot_count(pp, cfg.get("pp_async_batch_depth"))
        pool = cfg.get("max_running_requests")
        k = cfg.get("pp_max_micro_batch_size") or (sglang.default_microbatch_cap(pool, pp) if pool else None)
        firsts = [r for (_h, p, t, _d), r in self.engine.items() if p == 0 and t == 0]
        queued = _sum(r.queue_req for r in firsts)
        slotted = self.engine_kind is not None and engine_words(self.engine_kind).microbatch_slots
        if not slotted or pp < 2 or not self.rank0_lines:
            # vLLM's stats line gives the engine's total as logged; so does a single stage (one
            # micro-batch, when it runs any)
            running = _sum(r.running_req for r in firsts)
            single = None if not slotted or running is None else float(running > 0)
            return EngineNow(running, queued, single, slots, k, pool, "logged" if firsts else "none",
                             self.engine_kind)
        running = 0.0
        in_flight = 0.0
        sources = []
        for lines in self.rank0_lines.values():
            kind, running_req, new_seq, queue = (np.array(column) for column in zip(*lines, strict=True))
            sizes = line_sizes(kind, running_req.astype(np.float64), new_seq.astype(np.float64))
            busy = np.full(len(sizes), np.nan if first_stage_busy is None else first_stage_busy)
            totals = engine_totals(sizes, queue.astype(np.float64), busy, pp, slots, k, pool)
            # the median over the last cycle of lines: a request that ends leaves one line's
            # micro-batch short until the scheduler fills it again
            recent = slice(-min(slots, len(sizes)), None)
            running += float(np.median(totals.running[recent]))
            in_flight = max(in_flight, float(np.median(totals.microbatches[recent])))
            sources.append(str(totals.source[-1]))
        inflight = self.inflight
        if inflight is not None and inflight > 0:
            # the engine runs no more than the load has in flight: where every line holds the
            # same request, the period is ambiguous and a stage read busy counts it once per stage
            # (the real SGLang PP2 at C=1 beside GPUs read fully busy: 2 running, 2 micro-batches)
            running = min(running, float(inflight))
        # each micro-batch holds at least one request
        in_flight = min(in_flight, running)
        return EngineNow(running, queued, in_flight, slots, k, pool, "/".join(sorted(set(sources))),
                         self.engine_kind)

    def engine_settings(self) -> EngineSettings:
        """The engine's configuration lines merged as the report merges them (``from_records``)."""
        return EngineSettings.from_records(self.configs, engine_of_lines=self.engine_kind)

    def finding(self, engine: EngineNow | None = None, stages: list[LiveStage] | None = None,
                th: Thresholds = DEFAULT_THRESHOLDS) -> str:
        """The report's diagnosis of the last ``window_s`` in one line (see ``current_finding``)."""
        if engine is None:
            engine = self.engine_now(self._recent_busy(0, ENGINE_BUSY_WINDOW_S))
        stages = self.stages() if stages is None else stages
        cutoff = self.clock_ns() - int(self.window_s * 1e9)
        lines = {pp: [row for row in rows if row[0] >= cutoff] for pp, rows in self.stage_lines.items()}
        return current_finding(engine, stages, self.pp_size, self.engine_settings(), lines,
                               self.target_concurrency, self.inflight, self.phase, self.window_s, th)

    def status(self) -> LiveStatus:
        """What `watch` shows (the collector's /v1/status adds the store and the problems)."""
        stages = self.stages()
        engine = self.engine_now(self._recent_busy(0, ENGINE_BUSY_WINDOW_S))
        return LiveStatus(self.run, self.phase, self.target_concurrency, self.inflight, dict(self.counts),
                          tuple(st.to_json() for st in stages), pp_size=self.pp_size, engine=asdict(engine),
                          finding=self.finding(engine, stages),
                          now_ns=self.clock_ns(), newest_data_ns=self.newest_ns)


StageLines = dict[int, list[tuple[int, float, float, float]]]  # LiveState.stage_lines in the window


def finding_cause(finding: str) -> str:
    """The cause a live finding names: the words before its first colon (the report's cause names,
    or 'idle', 'no finding now'), the whole line where it has none ('no engine lines yet')."""
    return finding.split(":", 1)[0]


def current_finding(engine: EngineNow, stages: list[LiveStage], pp_size: int | None,
                    settings: EngineSettings, lines: StageLines, target: int | None = None,
                    inflight: int | None = None, phase: str | None = None, window_s: float = 10.0,
                    th: Thresholds = DEFAULT_THRESHOLDS) -> str:
    """What the live figures say now, in one line: the report's first finding (its order: confidence
    times impact) of the window read as one phase, "cause: summary"; or why there is none."""
    pp = pp_size or len(stages)
    running, queued, mbs = engine.running, engine.queued or 0, engine.microbatches_in_flight
    if running is None:
        return "no engine lines yet"
    if running < 0.5 and queued < 0.5:
        return "idle: the engine runs no request"
    pm = window_phase(engine, stages, pp, lines, target, inflight, phase, window_s)
    found = sorted(diagnose_phase(pm, settings, pp, th), key=_rank)
    if found:
        return f"{found[0].cause}: {found[0].summary}"
    fill = f"{mbs:.0f} micro-batches fill the {pp} stages" if mbs is not None else "the stages are busy"
    return f"no finding now: {fill}"


def _rank(finding: Finding) -> float:
    return -(finding.confidence * finding.impact)  # diagnose's order: most important first


def window_phase(engine: EngineNow, stages: list[LiveStage], pp_size: int, lines: StageLines,
                 target: int | None, inflight: int | None, phase: str | None,
                 window_s: float) -> PhaseMetrics:
    """The last ``window_s`` as the report's phase figures: the load is the in-process load's
    requests in flight where it runs here, else the engine's running + waiting (the report's
    fallback, ENGINE_IN_FLIGHT); each stage's busy and bubble are the live estimate's, its
    micro-batch sizes, queue and token usage its lines' in the window."""
    load = float(inflight) if inflight is not None else (engine.running or 0.0) + (engine.queued or 0.0)
    mbs = engine.microbatches_in_flight
    rows = {row.pp_rank: row for row in stages}
    return PhaseMetrics(
        label=phase or "now", start_ns=0, end_ns=int(window_s * 1e9), duration_s=window_s,
        source="live window", target_concurrency=target, inflight_mean=load, work_share=1.0,
        requests_completed=0, requests_failed=0, throughput_tok_s=None, client_throughput_tok_s=None,
        engine_gen_throughput_tok_s=None, unfinished_requests=0, ttft_s_p50=None, ttft_s_p90=None,
        itl_s_mean=None, itl_s_p90=None, microbatches_in_flight=mbs,
        allowed_busy_fraction=None if mbs is None or pp_size < 1 else min(1.0, mbs / pp_size),
        stages=[_window_stage(rows.get(pp, LiveStage(pp)), lines.get(pp, [])) for pp in range(pp_size)])


def _window_stage(row: LiveStage, lines: list[tuple[int, float, float, float]]) -> StageMetrics:
    table = np.array([row[1:] for row in lines], dtype=np.float64).reshape(-1, 3)
    sizes, queue, usage = table[:, 0], table[:, 1], table[:, 2]
    return StageMetrics(
        pp_rank=row.pp_rank, busy_fraction=row.busy_ratio, bubble_fraction=row.bubble_ratio,
        utilization_mean=row.utilization_ratio, utilization_p50=None, utilization_p90=None,
        utilization_p99=None, microbatch_size_mean=_stat(np.mean, sizes),
        microbatch_size_max=_stat(np.max, sizes), microbatch_size_p10=_stat(_p10, sizes),
        queue_req_mean=_stat(np.mean, queue), queue_req_max=_stat(np.max, queue),
        token_usage_mean=_stat(np.mean, usage), token_usage_max=_stat(np.max, usage),
        power_w_mean=row.power_w, power_limit_share_mean=None, power_limit_share_p95=None,
        pcie_tx_bytes_per_s_mean=row.pcie_tx_bytes_per_s,
        pcie_rx_bytes_per_s_mean=row.pcie_rx_bytes_per_s, pcie_link_share_p95=None,
        pcie_link_share_mean=None, pcie_transfer_per_busy=None, sm_clock_hz_mean=None,
        throttled_fraction=None, log_lines=len(lines),
        distinct_microbatch_sizes=len(set(sizes[~np.isnan(sizes)].tolist())))


def _stat(fn: Callable[[np.ndarray], Any], values: np.ndarray) -> float | None:
    """``fn`` over the values present; None where there are none."""
    present = values[~np.isnan(values)]
    return float(fn(present)) if len(present) else None


def _p10(values: np.ndarray) -> float:
    return float(np.percentile(values, 10))


def _nan(value: float | int | None) -> float:
    return float("nan") if value is None else float(value)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _sum(values: Iterable[float | int | None]) -> Any:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _forget_idle(rank: EngineRank) -> None:
    """At a vLLM turnover reading the rank keeps its last reading, unless that was the idle
    engine's 0 and 0: with requests in flight it no longer holds, and the rank reads nothing
    until a true reading comes (a CI run's dashboard read 0 running for the whole C=1 level, the
    /metrics gauges at 0 and 0 between turnovers since the engine idled before the load)."""
    if rank.running_req == 0 and not rank.queue_req:
        rank.running_req = rank.queue_req = None


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
        busy = family(mn.STAGE_BUSY, mn.STAGE_BUSY.labels)
        stages = s.stages()
        for row in stages:
            if row.busy_ratio is not None:
                busy.add_metric([str(row.pp_rank), str(row.busy_signal), s.run], float(row.busy_ratio))
            if row.bubble_ratio is not None:
                bubble.add_metric([str(row.pp_rank), s.run], float(row.bubble_ratio))
            if row.utilization_ratio is not None:
                util.add_metric([str(row.pp_rank), s.run], float(row.utilization_ratio))
        yield bubble
        yield util
        yield busy
        yield from self._engine_and_load(s)
        yield self._finding(s, stages)
        for key, n in s.counts.items():
            spec = mn.COLLECTOR_COUNTERS[key]
            counter = family(spec, spec.labels)
            counter.add_metric([s.run], float(n))
            yield counter

    @staticmethod
    def _finding(s: LiveState, stages: list[LiveStage]) -> Metric:
        """The live finding as an info series, for the dashboard's one-line panel (an instant query
        shows the current line: a line no longer exported goes stale at the next scrape)."""
        text = s.finding(stages=stages)
        fam = family(mn.LIVE_FINDING, mn.LIVE_FINDING.labels)
        fam.add_metric([finding_cause(text), text, s.run], 1.0)
        return fam

    @staticmethod
    def _engine_and_load(s: LiveState) -> Iterable[Metric]:
        """The engine as a whole, the phases' starts and the requests' latencies."""
        engine = s.engine_now(s._recent_busy(0, ENGINE_BUSY_WINDOW_S))
        for spec, value in ((mn.ENGINE_TOTAL_RUNNING, engine.running), (mn.ENGINE_POOL, engine.pool),
                            (mn.ENGINE_MICROBATCHES, engine.microbatches_in_flight),
                            (mn.ENGINE_STAGES, s.pp_size)):
            fam = family(spec, spec.labels)
            if value is not None:
                fam.add_metric([s.run], float(value))
            yield fam
        starts = family(mn.LOAD_PHASE_START, mn.LOAD_PHASE_START.labels)
        for label, ts_ns in s.phase_starts.items():
            starts.add_metric([label, s.run], ts_ns / 1e9)
        yield starts
        latencies = s.latency_quantiles()
        for spec, name in ((mn.LOAD_TTFT, "ttft"), (mn.LOAD_ITL, "itl")):
            fam = family(spec, spec.labels)
            for quantile, value in latencies.get(name, {}).items():
                fam.add_metric([quantile, s.run], value)
            yield fam
