"""Align a run into one view: every stream in the collector's clock, GPU metrics and per-stage
engine state on one grid (the NVML sample period), requests and markers beside them.

``align`` is a pure function of the run's tables (``RunTables``); ``align_store`` reads them first.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass, field

import numpy as np

from gputrace.analysis.clocks_and_grid import (
    ClockModel,
    StageMapping,
    clock_model,
    count_in_flight,
    coverage_ratio,
    hold_last,
    make_grid,
    pcie_capacity_bytes_per_s,
    place_log_events,
    sample_period_ns,
    stage_mapping,
    window_index,
)
from gputrace.analysis.schedule import engine_totals, line_sizes
from gputrace.errors import AnalysisError
from gputrace.log_clock import log_clock_offset
from gputrace.model import ENGINE_LOAD_SOURCE, DeviceInfo, Marker
from gputrace.run_tables import (
    DEFAULT_MARGINS,
    EVENT_KINDS,
    GPU_METRICS,
    ClockProbeColumns,
    EngineSettings,
    GpuSampleColumns,
    GpuSamples,
    LoadGaugeColumns,
    ReadMargins,
    RequestColumns,
    RunSource,
    RunTables,
    SchedulerEventColumns,
    SchedulerEvents,
    Window,
)

__all__ = ["CLIENT_IN_FLIGHT", "ENGINE_IN_FLIGHT", "GPU_METRICS", "MAX_GRID_BYTES", "STAGE_GPU_SERIES",
           "AlignedRun", "StageEvents", "align", "align_store", "gpu_metrics_on_grid"]

# clocks_event_reasons bits that mean the GPU was slowed down (not idle or app-clock settings):
# SW power cap 0x4, HW slowdown 0x8, SW thermal 0x20, HW thermal 0x40, HW power brake 0x80.
THROTTLE_REASON_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80

STAGE_GPU_SERIES = ("utilization", "power_w", "power_share", "pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s",
                    "pcie_tx_share", "pcie_rx_share", "sm_clock_hz", "throttled", "sm_active")
"""The GPU series every figure and metric reads, per stage (the mean over its GPUs)."""

GPU_READ_ROWS = 1_000_000
"""GPU sample rows read and put on the grid at a time (about 75 MB of columns, three times that
while gridded): the run's samples are read a time range at a time and reduced to stages, so
memory follows stages x cells, not GPUs x hours (512 GPUs x 8 h at 10 Hz: 147 M rows)."""

# What the offered load counts, as phase and work sources name it.
CLIENT_IN_FLIGHT = "client requests in flight"
ENGINE_IN_FLIGHT = "the engine's running + waiting requests"


@dataclass
class StageEvents:
    """One stage's scheduler lines (attention-TP rank 0), placed in the collector clock."""

    t_ns: np.ndarray
    kind: np.ndarray  # "decode" | "prefill" | "stats"
    running_req: np.ndarray
    queue_req: np.ndarray
    token_usage: np.ndarray
    gen_throughput_tok_s: np.ndarray
    # prefill lines: the prefill batch's requests, a continued chunk included (SGLang's
    # len(can_run_list); phase_figures.first_tokens gives those whose prefill it ends)
    new_seq: np.ndarray
    new_token: np.ndarray  # prefill lines: prompt tokens it computes (cached ones not counted)
    cached_token: np.ndarray  # prefill lines: prompt tokens the prefix cache held (not computed)
    input_throughput_tok_s: np.ndarray  # prefill (SGLang) and stats (vLLM) lines: prompt tokens/s


@dataclass
class AlignedRun:
    """All streams of a run on one clock; stage arrays are (pp, n_cells)."""

    name: str
    period_ns: int
    grid_ns: np.ndarray
    mapping: StageMapping
    gpu_keys: list[tuple[str, int]]
    gpu_stage: np.ndarray
    # each of STAGE_GPU_SERIES, (pp, n_cells): the mean over the stage's GPUs (NaN: none held it);
    # the per-GPU arrays are never held at once (gpu_metrics_on_grid gives them for a small run)
    stage_gpu: dict[str, np.ndarray]
    power_limit_w: np.ndarray
    pcie_capacity_bytes_per_s: np.ndarray
    stage_events: list[StageEvents]
    stage_running: np.ndarray  # each stage's last #running-req: one micro-batch under SGLang's PP
    stage_queue: np.ndarray
    stage_token_usage: np.ndarray
    work_ratio: np.ndarray
    work_source: str
    inflight: np.ndarray | None
    requests: dict[str, np.ndarray]
    markers: list[Marker]  # in the reference clock, within the window
    engine: EngineSettings
    log_placement: str
    clocks: ClockModel
    notes: list[str] = field(default_factory=list)
    # per GPU, the spacing of one series' samples (power, the agent's tick): the grid's period is
    # finer where NVML's own utilization samples interleave with the ticks
    sample_period_ns_by_gpu: list[int | None] = field(default_factory=list)
    # the engine's running total on the grid, reconstructed from stage 0's lines (schedule.py);
    # NaN where no line is near
    engine_running: np.ndarray | None = None
    engine_running_sources: dict[str, int] = field(default_factory=dict)
    # what ``inflight`` counts: the client's requests, or (a Prometheus import without the client's
    # gauge) the engine's running + waiting ones, which leave out what its API server holds
    inflight_counts: str = CLIENT_IN_FLIGHT

    @property
    def pp_size(self) -> int:
        return self.mapping.pp_size

    def stage_gpu_rows(self, stage: int) -> np.ndarray:
        return np.flatnonzero(self.gpu_stage == stage)


MAX_GRID_BYTES = 2 << 30
"""What alignment and the analysis may hold at once, at most (held_bytes: the stage series per
grid cell, the engine's log lines, the requests, one read of GPU samples): a run whose streams
span far longer than a benchmark (a log appended to over weeks, files from
different days) is refused with what it holds, to be analysed a window at a time."""
DEFAULT_PERIOD_NS = 1_000_000_000  # the grid's period without GPU samples to take it from


def align_store(store: RunSource, window_ns: Window = (None, None),
                margins: ReadMargins = DEFAULT_MARGINS) -> AlignedRun:
    """The aligned view of a run store, or of the part of it within ``window_ns`` (collector
    clock; None: open); raises AnalysisError when there is nothing to analyse, or too much at once."""
    _check_window(window_ns)
    return align(store.read_run(window_ns, margins))


def align(tables: RunTables) -> AlignedRun:
    """The aligned view of a run's tables (read within ``tables.window_ns``)."""
    lo, hi = _check_window(tables.window_ns)
    notes: list[str] = []
    clocks = _clock_model(tables.clock_probes, notes)
    samples = tables.gpu_samples
    gpu_span = _gpu_span(samples, clocks)
    events = _place_events(tables.scheduler_events, clocks, notes)
    engine = tables.engine
    mapping = stage_mapping(tables.meta.topology, engine.pp_size, engine.tp_size,
                            samples.keys, events.log_pp, engine.kind)
    gpu_stage = np.array([s if (s := mapping.stage_of(h, g)) is not None else -1 for h, g in samples.keys],
                         dtype=np.int64)
    requests = _requests_in_reference(tables.requests, clocks)
    markers = _markers_within(sorted(
        (dataclasses.replace(m, ts_ns=int(clocks.to_reference(m.host, np.array([m.ts_ns]))[0]))
         for m in tables.markers), key=lambda m: m.ts_ns), lo, hi)
    first, whole = _first_read(samples)
    first_ts = _gpu_rows(first, clocks).ts_by_gpu
    period = sample_period_ns(first_ts) if any(len(t) > 1 for t in first_ts) else DEFAULT_PERIOD_NS
    del first_ts
    grid = _grid(tables, gpu_span, events, requests, period, mapping.pp_size)
    power_limit, pcie_cap = _device_limits(tables.devices, samples.keys)
    stage_gpu, series_periods = _gpu_on_grid(samples, first if whole else None, clocks,
                                             _StageOf(gpu_stage, mapping.pp_size, power_limit, pcie_cap),
                                             grid, period)
    del first
    stages = _stages_on_grid(tables.scheduler_events, events, mapping.pp_size, grid)
    engine_running, running_sources = reconstruct_engine_running(
        stages.events, grid, engine, mapping.pp_size, _stage_busy(stage_gpu, 0, grid, period))
    if not len(tables.scheduler_events):
        notes.append("no engine log: the micro-batch cap, underfilled pipeline, KV-cache and "
                     "log-sampling causes cannot be diagnosed")
    if not len(tables.gpu_samples):
        notes.append("no GPU samples: busy and bubble fractions are not available")
    work = _work(requests, tables.load_gauge, stages, len(tables.scheduler_events) > 0, grid, period, notes)
    return AlignedRun(
        name=tables.meta.name, period_ns=period, grid_ns=grid, mapping=mapping,
        gpu_keys=list(samples.keys), gpu_stage=gpu_stage, stage_gpu=stage_gpu, power_limit_w=power_limit,
        pcie_capacity_bytes_per_s=pcie_cap,
        stage_events=stages.events, stage_running=stages.running, stage_queue=stages.queue,
        stage_token_usage=stages.token_usage, work_ratio=work.ratio, work_source=work.source,
        inflight=work.inflight, requests=requests, markers=markers, engine=engine,
        log_placement=events.placement, clocks=clocks, notes=notes, sample_period_ns_by_gpu=series_periods,
        engine_running=engine_running, engine_running_sources=running_sources,
        inflight_counts=work.inflight_counts)


# -- the steps of align, in order -------------------------------------------------------------------

def _check_window(window_ns: Window) -> Window:
    lo, hi = window_ns
    if lo is not None and hi is not None and hi <= lo:
        raise AnalysisError("the window's end is not after its start")
    return window_ns


def _clock_model(probes: ClockProbeColumns, notes: list[str]) -> ClockModel:
    if not len(probes):
        notes.append("no clock probes: host clocks assumed equal")
        return ClockModel()
    return clock_model(probes.host, probes.local_send_ns, probes.remote_ns, probes.local_recv_ns)


@dataclass(frozen=True)
class _GpuRows:
    """The GPU samples grouped by GPU: rows ``order[bounds[i]:bounds[i + 1]]`` are GPU i's, in time
    order, and ``ts_by_gpu[i]`` their times in the collector's clock."""

    keys: tuple[tuple[str, int], ...]
    order: np.ndarray
    bounds: np.ndarray
    ts_by_gpu: list[np.ndarray]


def _gpu_rows(samples: GpuSampleColumns, clocks: ClockModel) -> _GpuRows:
    order = _group_order(samples.k, samples.ts_ns)
    k, ts = samples.k[order], samples.ts_ns[order]
    bounds = np.searchsorted(k, np.arange(len(samples.keys) + 1))
    ts_by_gpu = [clocks.to_reference(host, ts[bounds[i]:bounds[i + 1]])
                 for i, (host, _) in enumerate(samples.keys)]
    return _GpuRows(samples.keys, order, bounds, ts_by_gpu)


def _group_order(k: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """The permutation sorting rows by (k, ts). Sorting in the database costs seconds on millions
    of rows; here a stable radix sort on the small GPU id suffices when each GPU's samples were
    written in time order (as samplers write them), else a full lexsort."""
    if len(k) == 0:
        return np.zeros(0, dtype=np.int64)
    small = k.astype(np.int16) if k.max() < np.iinfo(np.int16).max else k
    order = np.argsort(small, kind="stable")
    ks, tss = k[order], ts[order]
    if np.all((np.diff(tss) >= 0) | (np.diff(ks) != 0)):
        return order
    return np.lexsort((ts, k))


@dataclass(frozen=True)
class _PlacedEvents:
    t_ns: np.ndarray  # each line's time in the collector's clock (NaN: not placed)
    pp_rank: np.ndarray
    placement: str  # how the lines were placed, for the report
    log_pp: int | None  # pipeline stages seen in the log


def _place_events(lines: SchedulerEvents, clocks: ClockModel, notes: list[str]) -> _PlacedEvents:
    """Each scheduler line in the collector's clock: its receive time where it has one (clamped
    into the logged second), else spread by order within its second."""
    ev = lines.placement()
    offsets = np.zeros(len(ev))
    for code, host in enumerate(ev.host_names):
        if host not in clocks.points:
            continue  # no probes: offset 0
        sel = ev.host_code == code
        host_t = np.where(np.isnan(ev.log_ts_ns[sel]), ev.recv_ts_ns[sel], ev.log_ts_ns[sel])
        offsets[sel] = clocks.offset_ns(host, np.nan_to_num(host_t).astype(np.int64))
    source_key = ev.host_code.astype(np.int64) * max(len(ev.source_names), 1) + ev.source_code
    notes.extend(_log_clock_notes(ev, source_key, offsets))
    t_ns, by_recv = place_log_events(ev.log_ts_ns, ev.ts_resolution_ns, ev.recv_ts_ns, source_key,
                                     ev.line_no, offsets)
    del offsets, source_key
    if not len(ev):
        placement = "no engine log"
    elif by_recv.all():
        placement = "receive time (clamped into the logged second)"
    elif not by_recv.any():
        placement = "spread by order within each logged second (no receive times)"
        notes.append("engine log lines have second resolution and no receive time: placed by their "
                     "order within the second")
    else:
        placement = f"receive time for {by_recv.mean():.0%} of lines, spread by order for the rest"
    pp_rank = np.nan_to_num(ev.pp_rank, nan=0).astype(np.int32)
    return _PlacedEvents(t_ns, pp_rank, placement, int(pp_rank.max()) + 1 if len(ev) else None)


def _log_clock_notes(ev: SchedulerEventColumns, source_key: np.ndarray, offsets: np.ndarray) -> list[str]:
    """A note per log whose stamps run more than a minute from its lines' receive times (taken
    into the engine host's clock), e.g. an engine logging local time read as UTC."""
    if not (~np.isnan(ev.recv_ts_ns)).any():
        return []
    notes = []
    n_sources = max(len(ev.source_names), 1)
    for key in np.unique(source_key).tolist():
        sel = source_key == key
        host, source = ev.host_names[key // n_sources], ev.source_names[key % n_sources]
        found = log_clock_offset(f"{host} {source}", ev.log_ts_ns[sel], ev.recv_ts_ns[sel] + offsets[sel])
        if found is not None:
            notes.append(found.note())
    return notes


def _to_reference(clocks: ClockModel, hosts: np.ndarray, t: np.ndarray) -> np.ndarray:
    out = np.asarray(t, dtype=np.float64).copy()
    for h in np.unique(hosts):
        sel = hosts == h
        ok = sel & ~np.isnan(out)
        out[ok] = out[ok] - clocks.offset_ns(str(h), out[ok].astype(np.int64))
    return out


def _requests_in_reference(rq: RequestColumns, clocks: ClockModel) -> dict[str, np.ndarray]:
    return {
        "start_ns": _to_reference(clocks, rq.host, rq.start_ns),
        "first_token_ns": _to_reference(clocks, rq.host, rq.first_token_ns),
        "end_ns": _to_reference(clocks, rq.host, rq.end_ns),
        "prompt_tokens": np.asarray(rq.prompt_tokens, dtype=np.float64),
        "completion_tokens": np.asarray(rq.completion_tokens, dtype=np.float64),
        "ok": np.asarray(rq.ok, dtype=bool),
        "phase": np.asarray(rq.phase, dtype=object),
        # the client stopped waiting (drain): neither completed nor failed, its end unknown
        "abandoned": np.asarray(rq.abandoned, dtype=bool),
    }


def _markers_within(markers: list[Marker], lo: int | None, hi: int | None) -> list[Marker]:
    """The markers inside the window; a phase still running at its start begins at the start."""
    inside = [m for m in markers if (lo is None or m.ts_ns >= lo) and (hi is None or m.ts_ns <= hi)]
    bounds_before = [m for m in markers if lo is not None and m.ts_ns < lo and m.kind in ("phase", "end")]
    if bounds_before and bounds_before[-1].kind == "phase":
        assert lo is not None
        inside.insert(0, dataclasses.replace(bounds_before[-1], ts_ns=lo))
    return inside


def _iso(t_ns: float | None) -> str:
    if t_ns is None:
        return "the open end"
    return dt.datetime.fromtimestamp(float(t_ns) / 1e9, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _spans(gpu_span: tuple[int, int] | None, events: _PlacedEvents, requests: dict[str, np.ndarray],
           period: int) -> list[tuple[str, float, float]]:
    """(stream, first, last) of each stream that holds data."""
    spans: list[tuple[str, float, float]] = []
    if gpu_span is not None:
        spans.append(("GPU samples", gpu_span[0] - period, gpu_span[1]))
    if len(events.t_ns) and not np.isnan(events.t_ns).all():
        spans.append(("engine log lines", np.nanmin(events.t_ns), np.nanmax(events.t_ns)))
    if len(requests["start_ns"]):
        spans.append(("requests", np.nanmin(requests["start_ns"]),
                      np.nanmax(np.fmax(requests["end_ns"], requests["start_ns"]))))
    return spans


def _grid(tables: RunTables, gpu_span: tuple[int, int] | None, events: _PlacedEvents,
          requests: dict[str, np.ndarray], period: int, pp_size: int) -> np.ndarray:
    """The grid spanning every stream within the window; AnalysisError for none, or too many cells."""
    lo, hi = tables.window_ns
    spans = _spans(gpu_span, events, requests, period)
    if not spans:
        where = "" if tables.window_ns == (None, None) else f" between {_iso(lo)} and {_iso(hi)}"
        untimed = ""
        if len(tables.scheduler_events):  # lines there, but none placed in time
            untimed = (f" ({len(tables.scheduler_events)} engine log lines have no date: a log printing "
                       "times without the date or year needs gputrace import --date YYYY-MM-DD)")
        raise AnalysisError(f"{tables.source}: no GPU samples, engine log lines or requests{where} to "
                            f"analyse{untimed}")
    start = int(min(first for _, first, _ in spans))
    end = int(max(last for _, _, last in spans))
    start, end = max(start, lo) if lo is not None else start, min(end, hi) if hi is not None else end
    if end <= start:
        raise AnalysisError(f"{tables.source}: no data between {_iso(lo)} and {_iso(hi)}")
    n_cells = -(-(end - start) // period)
    grid_bytes = held_bytes(n_cells, pp_size, len(tables.scheduler_events), len(tables.requests))
    if grid_bytes > MAX_GRID_BYTES:
        held = "; ".join(f"{name} {_iso(first)} to {_iso(last)}" for name, first, last in spans)
        raise AnalysisError(
            f"{tables.source}: the data spans {(end - start) / 86_400e9:.1f} days, {n_cells:,} "
            f"cells of {period / 1e9:g} s, about {grid_bytes / 2**30:.0f} GiB to align at once ({held}): "
            "analyse a window of it with gputrace report RUN --start T --end T (compare: "
            "--start-a/--end-a, --start-b/--end-b)")
    return make_grid(start, end, period)


def _gpu_span(samples: GpuSamples, clocks: ClockModel) -> tuple[int, int] | None:
    """The first and last GPU sample in the collector's clock (None: no samples)."""
    ext = samples.extents()
    held = np.flatnonzero(ext.count > 0)
    if not len(held):
        return None
    first = [int(clocks.to_reference(samples.keys[i][0], ext.first_ts_ns[i:i + 1])[0]) for i in held]
    last = [int(clocks.to_reference(samples.keys[i][0], ext.last_ts_ns[i:i + 1])[0]) for i in held]
    return min(first), max(last)


def _first_read(samples: GpuSamples) -> tuple[GpuSampleColumns, bool]:
    """The first GPU_READ_ROWS rows or so (by time), to take the sample period from; and whether
    they are all of them (then they are gridded as they are, not read again)."""
    if len(samples) <= GPU_READ_ROWS:
        return samples.between(None, None), True
    ext = samples.extents()
    held = ext.count > 0
    lo, hi = int(ext.first_ts_ns[held].min()), int(ext.last_ts_ns[held].max())
    return samples.between(lo, lo + int((hi - lo) * GPU_READ_ROWS / len(samples))), False


@dataclass(frozen=True)
class _StageOf:
    """What reduces GPUs to stages: each GPU's stage (-1: none) and its limits."""

    gpu_stage: np.ndarray
    pp: int
    power_limit_w: np.ndarray
    pcie_capacity_bytes_per_s: np.ndarray


def _gpu_on_grid(samples: GpuSamples, whole: GpuSampleColumns | None, clocks: ClockModel, stage_of: _StageOf,
                 grid: np.ndarray, period: int) -> tuple[dict[str, np.ndarray], list[int | None]]:
    """Each of STAGE_GPU_SERIES on the grid, (pp, n_cells); and each GPU's own sample period.

    The samples are read a range of cells at a time (``whole``: all of them, already read), each
    range's rows with the margin the clock offsets and NVML's window need, put on the grid per GPU
    and reduced to stages: the per-GPU arrays exist for one range only."""
    out = {name: np.full((stage_of.pp, len(grid)), np.nan) for name in STAGE_GPU_SERIES}
    n_gpu = len(samples.keys)
    if not len(samples) or not len(grid):
        return out, [None] * n_gpu
    periods: list[list[int]] = [[] for _ in range(n_gpu)]
    if whole is not None:
        _grid_range(whole, clocks, stage_of, grid, 0, len(grid), period, out, periods)
    else:
        offsets = [0.0, *(float(x) for _, host_offsets in clocks.points.values() for x in host_offsets)]
        slack = 1_000_000  # the offsets are rounded to the ns; a ms more costs nothing
        rows_per_cell = len(samples) / len(grid)
        step = max(min(int(GPU_READ_ROWS / max(rows_per_cell, 1e-9)), GPU_READ_ROWS // max(n_gpu, 1)), 1)
        for c0 in range(0, len(grid), step):
            c1 = min(c0 + step, len(grid))
            # a cell (t - P, t] takes the first sample at or after t within P (window_index):
            # the rows from grid[c0] to grid[c1 - 1] + P in the collector's clock
            chunk = samples.between(int(grid[c0]) + int(min(offsets)) - slack,
                                    int(grid[c1 - 1]) + period + int(max(offsets)) + slack)
            _grid_range(chunk, clocks, stage_of, grid, c0, c1, period, out, periods)
    return out, [int(np.median(p)) if p else None for p in periods]


def _grid_range(chunk: GpuSampleColumns, clocks: ClockModel, stage_of: _StageOf, grid: np.ndarray, c0: int,
                c1: int, period: int, out: dict[str, np.ndarray], periods: list[list[int]]) -> None:
    """Cells c0..c1 of every stage series from these rows; each GPU's sample period in them."""
    rows = _gpu_rows(chunk, clocks)
    order = rows.order
    lost = np.asarray(chunk.lost, dtype=bool)[order]
    values = {m: np.asarray(chunk.metric(m), dtype=np.float64)[order] for m in GPU_METRICS}
    gpu = {m: np.full((len(rows.keys), c1 - c0), np.nan) for m in GPU_METRICS}
    _fill_gpu_metrics(gpu, values, lost, rows.ts_by_gpu, rows.bounds, grid[c0:c1], period)
    for i, p in enumerate(_series_periods(rows.ts_by_gpu, rows.bounds, values["power_w"],
                                          values["utilization_ratio"])):
        if p is not None:
            periods[i].append(p)
    del values, lost
    for name, v in _stage_means(gpu, stage_of).items():
        out[name][:, c0:c1] = v


def _stage_means(gpu: dict[str, np.ndarray], stage_of: _StageOf) -> dict[str, np.ndarray]:
    """Each of STAGE_GPU_SERIES from per-GPU metrics: averaged over the GPUs of each stage."""
    reasons = gpu["clock_event_reasons"]
    throttled = np.where(np.isnan(reasons), np.nan,
                         (np.nan_to_num(reasons).astype(np.int64) & THROTTLE_REASON_MASK) != 0)
    plain = {"utilization": "utilization_ratio", "power_w": "power_w", "sm_clock_hz": "sm_clock_hz",
             "pcie_tx_bytes_per_s": "pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s": "pcie_rx_bytes_per_s",
             "sm_active": "sm_active_ratio"}
    shares = {"power_share": ("power_w", stage_of.power_limit_w),
              "pcie_tx_share": ("pcie_tx_bytes_per_s", stage_of.pcie_capacity_bytes_per_s),
              "pcie_rx_share": ("pcie_rx_bytes_per_s", stage_of.pcie_capacity_bytes_per_s)}

    def per_gpu(name: str) -> np.ndarray:  # one at a time: each is GPUs x cells
        if name in plain:
            return gpu[plain[name]]
        if name in shares:
            metric, limit = shares[name]
            return np.asarray(gpu[metric] / limit[:, None])
        return np.asarray(throttled, dtype=np.float64)

    return {name: _stage_mean(per_gpu(name), stage_of) for name in STAGE_GPU_SERIES}


def _stage_mean(values: np.ndarray, stage_of: _StageOf) -> np.ndarray:
    out = np.full((stage_of.pp, values.shape[1]), np.nan)
    for s in range(stage_of.pp):
        rows = np.flatnonzero(stage_of.gpu_stage == s)
        if len(rows) and not np.isnan(values[rows]).all():
            with np.errstate(all="ignore"):
                out[s] = np.nanmean(values[rows], axis=0) if len(rows) > 1 else values[rows[0]]
    return out


def gpu_metrics_on_grid(tables: RunTables, run: AlignedRun) -> dict[str, np.ndarray]:
    """Each GPU metric of every GPU on the run's grid, (n_gpu, n_cells), all at once: for a small
    run (tests, a look at one GPU); the analysis keeps only the stages' means."""
    samples = tables.gpu_samples.between(None, None)
    rows = _gpu_rows(samples, run.clocks)
    gpu = {m: np.full((len(rows.keys), len(run.grid_ns)), np.nan) for m in GPU_METRICS}
    if len(samples):
        values = {m: np.asarray(samples.metric(m), dtype=np.float64)[rows.order] for m in GPU_METRICS}
        _fill_gpu_metrics(gpu, values, np.asarray(samples.lost, dtype=bool)[rows.order], rows.ts_by_gpu,
                          rows.bounds, run.grid_ns, run.period_ns)
    return gpu


# What the analysis holds per grid cell: the stage series (STAGE_GPU_SERIES and the log's running,
# queue and token usage per stage) and the run-wide ones (grid, work, in flight, engine running,
# the busy window and its convolutions).
_RUN_SERIES_PER_CELL = 8
# What it holds per engine log line, at most: while placing them, the columns that place a line
# (40 bytes) and placement's temporaries; after, its time and stage (12 bytes) and its stage's copy
# (StageEvents: 8 columns of 8 bytes). Measured: 122 bytes a line of peak RSS (a report on 2.6 M
# lines peaked at 527 MB, on 0.65 M at 289 MB). Per request: its columns as read and in the
# collector's clock.
_BYTES_PER_EVENT = 8 * 16
_BYTES_PER_REQUEST = 8 * (9 + 8)
# the GPU samples in flight: one read's columns, reordered, and its per-GPU cells
_GPU_READ_BYTES = GPU_READ_ROWS * (8 * 2 + 1 + 8 * len(GPU_METRICS)) * 3


def held_bytes(n_cells: int, pp_size: int, n_events: int, n_requests: int) -> int:
    """About what the aligned run and its analysis hold at once: a grid of ``n_cells`` over
    ``pp_size`` stages, with these engine log lines and requests."""
    per_cell = (len(STAGE_GPU_SERIES) + 3) * max(pp_size, 1) + _RUN_SERIES_PER_CELL
    return (8 * n_cells * per_cell + _BYTES_PER_EVENT * n_events + _BYTES_PER_REQUEST * n_requests
            + _GPU_READ_BYTES)


def _device_limits(devices: tuple[DeviceInfo, ...], gpu_keys: tuple[tuple[str, int], ...]
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Per GPU, its power limit and PCIe link capacity (NaN: not known)."""
    by_key = {(d.host, d.gpu_index): d for d in devices}
    power_limit = np.array([(d.power_limit_w if (d := by_key.get(key)) else None) or np.nan
                            for key in gpu_keys], dtype=float)
    pcie_cap = np.array([(pcie_capacity_bytes_per_s(d.pcie_max_gen, d.pcie_max_width)
                          if (d := by_key.get(key)) else None) or np.nan for key in gpu_keys], dtype=float)
    return power_limit, pcie_cap


@dataclass(frozen=True)
class _StagesOnGrid:
    events: list[StageEvents]
    running: np.ndarray  # (pp, n_cells): the stage's running requests, summed over DP ranks
    queue: np.ndarray
    token_usage: np.ndarray  # the fullest DP rank's


_EVENT_VALUES = ("running_req", "queue_req", "token_usage", "gen_throughput_tok_s", "new_seq", "new_token",
                 "cached_token", "input_throughput_tok_s")


def _stages_on_grid(lines: SchedulerEvents, placed: _PlacedEvents, pp: int, grid: np.ndarray
                    ) -> _StagesOnGrid:
    """Each stage's lines in time order, and its last logged state held on the grid; read one
    stage at a time."""
    out = _StagesOnGrid([], np.full((pp, len(grid)), np.nan), np.full((pp, len(grid)), np.nan),
                        np.full((pp, len(grid)), np.nan))
    kinds = np.asarray(EVENT_KINDS, dtype=object)  # a line's kind: one of three shared strings
    for s in range(pp):
        at = np.flatnonzero(placed.pp_rank == s)  # the stage's lines, in the order read
        ev = lines.stage_rows(s) if len(at) else SchedulerEventColumns()
        if len(ev) != len(at):
            raise AnalysisError("the engine log lines changed while they were read: report again")
        t_ns = placed.t_ns[at]
        sel = np.flatnonzero(~np.isnan(t_ns))
        sel = sel[np.argsort(t_ns[sel], kind="stable")]
        stage = StageEvents(t_ns[sel], kinds[ev.kind_code[sel]],
                            *(np.asarray(getattr(ev, c)[sel], dtype=np.float64) for c in _EVENT_VALUES))
        out.events.append(stage)
        dp_rank = np.nan_to_num(ev.dp_rank[sel], nan=0).astype(np.int64)
        del ev
        _hold_stage_state(out, s, stage, dp_rank, grid)
    return out


def _hold_stage_state(out: _StagesOnGrid, stage: int, ev: StageEvents, dp_rank: np.ndarray,
                      grid: np.ndarray) -> None:
    run_sum = np.zeros(len(grid))
    q_sum = np.zeros(len(grid))
    seen = np.zeros(len(grid), dtype=bool)
    for d in np.unique(dp_rank):
        sd = np.flatnonzero(dp_rank == d)
        max_age = _max_age_ns(ev.t_ns[sd])
        r = hold_last(ev.t_ns[sd], ev.running_req[sd], grid, max_age)
        q = hold_last(ev.t_ns[sd], ev.queue_req[sd], grid, max_age)
        u = hold_last(ev.t_ns[sd], ev.token_usage[sd], grid, max_age)
        seen |= ~np.isnan(r)
        run_sum += np.nan_to_num(r)
        q_sum += np.nan_to_num(q)
        out.token_usage[stage] = np.fmax(out.token_usage[stage], u)
    out.running[stage] = np.where(seen, run_sum, 0.0)
    out.queue[stage] = np.where(seen, q_sum, 0.0)


def _max_age_ns(t_ns: np.ndarray) -> float:
    """How long a logged value holds: three of its typical gaps and a second."""
    gaps = np.diff(t_ns)
    return 3 * float(np.median(gaps)) + 1e9 if len(gaps) else 5e9


@dataclass(frozen=True)
class _Work:
    ratio: np.ndarray  # the share of each cell with work offered
    source: str
    inflight: np.ndarray | None
    inflight_counts: str = CLIENT_IN_FLIGHT


def _work(requests: dict[str, np.ndarray], gauge: LoadGaugeColumns, stages: _StagesOnGrid, has_log: bool,
          grid: np.ndarray, period: int, notes: list[str]) -> _Work:
    """When there was work, from the best source the run holds: its requests, the engine's log,
    a gauge of requests in flight; else every cell."""
    started = ~np.isnan(requests["start_ns"])
    gauge_counts = _gauge_counts(gauge)
    inflight = _gauge_inflight(gauge, gauge_counts, grid, notes) if not started.any() and len(gauge) else None
    if started.any():
        # A request with no end was still in flight when the run stopped.
        end = np.where(np.isnan(requests["end_ns"]), grid[-1], requests["end_ns"])[started]
        return _Work(coverage_ratio(requests["start_ns"][started], end, grid, period),
                     CLIENT_IN_FLIGHT, count_in_flight(requests["start_ns"][started], end, grid))
    if has_log:
        work = ((stages.running + stages.queue) > 0).any(axis=0).astype(np.float64)
        return _Work(work, "engine running + queued requests (log)", inflight, gauge_counts)
    if inflight is not None:
        return _Work((np.nan_to_num(inflight) > 0).astype(np.float64), f"{gauge_counts} (gauge)",
                     inflight, gauge_counts)
    notes.append("no requests and no engine log: bubble fraction counts all idle time")
    return _Work(np.ones(len(grid)), "unknown: every cell counted as having work", None)


def _gauge_counts(gauge: LoadGaugeColumns) -> str:
    """What a gauge of requests in flight counts: the client's, or the engine's own gauges that a
    Prometheus import read where the client's was missing (one source for the whole gauge)."""
    engines = len(gauge) > 0 and str(gauge.source[0]) == ENGINE_LOAD_SOURCE
    return ENGINE_IN_FLIGHT if engines else CLIENT_IN_FLIGHT


def _gauge_inflight(gauge: LoadGaugeColumns, counts: str, grid: np.ndarray, notes: list[str]) -> np.ndarray:
    """No request records, but a gauge of requests in flight (the client's, else the engine's;
    already in the collector's clock): it gives the offered load; the engine's state still gives
    the work."""
    gauge_t = np.asarray(gauge.ts_ns, dtype=np.int64)
    gaps = np.diff(gauge_t)
    inflight = hold_last(gauge_t, np.asarray(gauge.inflight_requests, dtype=np.float64), grid,
                         _max_age_ns(gauge_t))
    what = ("offered load from the engine's running + queued requests (no client gauge), "
            if counts == ENGINE_IN_FLIGHT else "client requests in flight from a gauge ")
    every_s = float(np.median(gaps)) / 1e9 if len(gaps) else 0
    notes.append(f"{what}sampled every {every_s:g} s (no request records)")
    return inflight

def _fill_gpu_metrics(gpu: dict[str, np.ndarray], values: dict[str, np.ndarray], lost: np.ndarray,
                      ts_by_gpu: list[np.ndarray], bounds: np.ndarray, grid: np.ndarray, period: int) -> None:
    """Each metric onto the grid from the rows that hold it. An agent's rows interleave (ticks with
    power, PCIe, clocks; NVML's own utilization samples between them): a cell looked up over all
    rows took whichever came first, and lost the other metric (a third of the utilization samples
    in the demo). A lost row still claims its cell, as a gap. Metrics held by the same rows share
    one lookup."""
    lookups: list[tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]] = []
    for m, v_all in values.items():
        held = ~np.isnan(v_all) | lost
        found = next((rows for mask, rows in lookups if np.array_equal(mask, held)), None)
        if found is None:
            found = []
            for i, ts in enumerate(ts_by_gpu):
                idx = np.flatnonzero(held[bounds[i]:bounds[i + 1]])
                cells, rows = window_index(ts[idx], grid, period)
                found.append((cells, idx[rows]))
            lookups.append((held, found))
        v_all = np.where(lost, np.nan, v_all)
        for i, (cells, rows) in enumerate(found):
            gpu[m][i, cells] = v_all[bounds[i]:bounds[i + 1]][rows]


def _series_periods(ts_by_gpu: list[np.ndarray], bounds: np.ndarray, power_w: np.ndarray,
                    utilization: np.ndarray) -> list[int | None]:
    """Per GPU, the median spacing of its power samples (else of its utilization samples): one
    series' own period, which all rows together (ticks and NVML's utilization samples) understate."""
    out: list[int | None] = []
    for i, ts in enumerate(ts_by_gpu):
        period = None
        for values in (power_w, utilization):
            held = ts[~np.isnan(values[bounds[i]:bounds[i + 1]])]
            spacing = np.diff(held)
            spacing = spacing[spacing > 0]
            if len(spacing):
                period = int(np.median(spacing))
                break
        out.append(period)
    return out


BUSY_WINDOW_NS = 2_000_000_000  # the compute share around a line, for counting micro-batches


def _stage_busy(stage_gpu: dict[str, np.ndarray], stage: int, grid: np.ndarray, period: int) -> np.ndarray:
    """A stage's compute share on the grid, averaged over BUSY_WINDOW_NS: SM activity where the
    GPUs have it, else utilization, but not under PP: there NCCL's spinning receive fills
    utilization.gpu while a rank waits, so one micro-batch at PP2 read as two, the engine's total
    as the request once per rank (a log-only C=1 run read load 2 and bubble 0.04 against 0.50);
    without it the count is the log's own (its shortest period, a lower bound)."""
    if stage >= len(stage_gpu["sm_active"]):
        return np.full(len(grid), np.nan)
    mean = stage_gpu["sm_active"][stage]
    if np.isnan(mean).all():
        if len(stage_gpu["utilization"]) > 1:
            return np.full(len(grid), np.nan)
        mean = stage_gpu["utilization"][stage]
    width = max(int(BUSY_WINDOW_NS // max(period, 1)), 1)
    ok = ~np.isnan(mean)
    num = np.convolve(np.where(ok, mean, 0.0), np.ones(width), mode="same")
    den = np.convolve(ok.astype(np.float64), np.ones(width), mode="same")
    with np.errstate(all="ignore"):
        return np.where(den > 0, num / den, np.nan)


def reconstruct_engine_running(stage_events: list[StageEvents], grid: np.ndarray, engine: EngineSettings,
                               pp: int, busy: np.ndarray) -> tuple[np.ndarray | None, dict[str, int]]:
    """The engine's running total on the grid: vLLM's stats lines give it as logged; SGLang's
    rank-0 lines are summed over one cycle of its micro-batches (schedule.engine_totals)."""
    if not stage_events or not len(stage_events[0].t_ns):
        return None, {}
    ev = stage_events[0]
    gaps = np.diff(ev.t_ns)
    max_age = 3 * float(np.median(gaps)) + 1e9 if len(gaps) else 5e9
    if not engine.engine_spec.steps_logged or pp < 2:
        return hold_last(ev.t_ns, ev.running_req.astype(np.float64), grid, max_age), {"logged": len(ev.t_ns)}
    sel = np.isin(ev.kind, ("decode", "prefill"))
    t = ev.t_ns[sel]
    sizes = line_sizes(ev.kind[sel], ev.running_req[sel], ev.new_seq[sel])
    at = np.clip(np.searchsorted(grid, t), 0, len(grid) - 1)
    totals = engine_totals(sizes, ev.queue_req[sel], busy[at], pp, engine.slots_at(pp),
                           engine.microbatch_cap_at(pp), engine.admission_limit)
    return hold_last(t, totals.running, grid, max_age), totals.counts()
