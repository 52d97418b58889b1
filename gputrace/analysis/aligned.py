"""Align a run into one view: every stream in the collector's clock, GPU metrics and per-stage
engine state on one grid (the NVML sample period), requests and markers beside them.

``align`` is a pure function of the run's tables (``RunTables``); ``align_store`` reads them first.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gputrace.analysis.align import (
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
from gputrace.model import DeviceInfo
from gputrace.run_tables import (
    DEFAULT_MARGINS,
    GPU_METRICS,
    ClockProbeColumns,
    EngineSettings,
    GpuSampleColumns,
    LoadGaugeColumns,
    ReadMargins,
    RequestColumns,
    RunSource,
    RunTables,
    SchedulerEventColumns,
    Window,
)

__all__ = ["GPU_METRICS", "MAX_GRID_BYTES", "AlignedRun", "StageEvents", "align", "align_store"]


@dataclass
class StageEvents:
    """One stage's scheduler lines (attention-TP rank 0), placed in the collector clock."""

    t_ns: np.ndarray
    kind: np.ndarray  # "decode" | "prefill" | "stats"
    running_req: np.ndarray
    queue_req: np.ndarray
    token_usage: np.ndarray
    gen_throughput_tok_s: np.ndarray
    new_seq: np.ndarray  # prefill lines: requests whose first token this prefill makes
    new_token: np.ndarray  # prefill lines: prompt tokens it computes (cached ones not counted)


@dataclass
class AlignedRun:
    """All streams of a run on one clock; GPU arrays are (n_gpu, n_cells), stage arrays (pp, n_cells)."""

    name: str
    period_ns: int
    grid_ns: np.ndarray
    mapping: StageMapping
    gpu_keys: list[tuple[str, int]]
    gpu_stage: np.ndarray
    gpu: dict[str, np.ndarray]
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
    markers: list[dict[str, Any]]
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

    @property
    def pp_size(self) -> int:
        return self.mapping.pp_size

    def stage_gpu_rows(self, stage: int) -> np.ndarray:
        return np.flatnonzero(self.gpu_stage == stage)


MAX_GRID_BYTES = 2 << 30
"""The aligned arrays' size at most (a float per grid cell per GPU metric and per stage series): a
run whose streams span far longer than a benchmark (a log appended to over weeks, files from
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
    gpu_rows = _gpu_rows(tables.gpu_samples, clocks)
    events = _place_events(tables.scheduler_events, clocks, notes)
    engine = tables.engine
    mapping = stage_mapping(tables.meta.topology, engine.get("pp_size"), engine.get("tp_size"),
                            gpu_rows.keys, events.log_pp)
    gpu_stage = np.array([s if (s := mapping.stage_of(h, g)) is not None else -1 for h, g in gpu_rows.keys],
                         dtype=np.int64)
    requests = _requests_in_reference(tables.requests, clocks)
    markers = _markers_within(sorted(
        ({**dataclasses.asdict(m), "ts_ns": int(clocks.to_reference(m.host, np.array([m.ts_ns]))[0])}
         for m in tables.markers), key=lambda m: m["ts_ns"]), lo, hi)
    period = sample_period_ns(gpu_rows.ts_by_gpu) if any(len(t) > 1 for t in gpu_rows.ts_by_gpu) \
        else DEFAULT_PERIOD_NS
    grid = _grid(tables, gpu_rows, events, requests, period, mapping.pp_size)
    gpu, series_periods = _gpu_on_grid(tables.gpu_samples, gpu_rows, grid, period)
    power_limit, pcie_cap = _device_limits(tables.devices, gpu_rows.keys)
    stages = _stages_on_grid(tables.scheduler_events, events, mapping.pp_size, grid)
    engine_running, running_sources = reconstruct_engine_running(
        stages.events, grid, engine, mapping.pp_size, _stage_busy(gpu, gpu_stage, 0, grid, period))
    if not len(tables.scheduler_events):
        notes.append("no engine log: the micro-batch cap, underfilled pipeline, KV-cache and "
                     "log-sampling causes cannot be diagnosed")
    if not len(tables.gpu_samples):
        notes.append("no GPU samples: busy and bubble fractions are not available")
    work = _work(requests, tables.load_gauge, stages, len(tables.scheduler_events) > 0, grid, period, notes)
    return AlignedRun(
        name=tables.meta.name, period_ns=period, grid_ns=grid, mapping=mapping, gpu_keys=list(gpu_rows.keys),
        gpu_stage=gpu_stage, gpu=gpu, power_limit_w=power_limit, pcie_capacity_bytes_per_s=pcie_cap,
        stage_events=stages.events, stage_running=stages.running, stage_queue=stages.queue,
        stage_token_usage=stages.token_usage, work_ratio=work.ratio, work_source=work.source,
        inflight=work.inflight, requests=requests, markers=markers, engine=engine,
        log_placement=events.placement, clocks=clocks, notes=notes, sample_period_ns_by_gpu=series_periods,
        engine_running=engine_running, engine_running_sources=running_sources)


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


def _place_events(ev: SchedulerEventColumns, clocks: ClockModel, notes: list[str]) -> _PlacedEvents:
    """Each scheduler line in the collector's clock: its receive time where it has one (clamped
    into the logged second), else spread by order within its second."""
    offsets = np.zeros(len(ev))
    for h in np.unique(ev.host):
        sel = ev.host == h
        host_t = np.where(np.isnan(ev.log_ts_ns[sel]), ev.recv_ts_ns[sel], ev.log_ts_ns[sel])
        offsets[sel] = clocks.offset_ns(str(h), np.nan_to_num(host_t).astype(np.int64))
    source_key = (np.char.add(ev.host.astype(str), ev.source.astype(str)) if len(ev)
                  else np.zeros(0, dtype=str))
    t_ns, by_recv = place_log_events(ev.log_ts_ns, ev.ts_resolution_ns, ev.recv_ts_ns, source_key,
                                     ev.line_no, offsets)
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
    pp_rank = np.nan_to_num(ev.pp_rank, nan=0).astype(np.int64)
    return _PlacedEvents(t_ns, pp_rank, placement, int(pp_rank.max()) + 1 if len(ev) else None)


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


def _markers_within(markers: list[dict[str, Any]], lo: int | None, hi: int | None) -> list[dict[str, Any]]:
    """The markers inside the window; a phase still running at its start begins at the start."""
    inside = [m for m in markers if (lo is None or m["ts_ns"] >= lo) and (hi is None or m["ts_ns"] <= hi)]
    bounds_before = [m for m in markers if lo is not None and m["ts_ns"] < lo
                     and m.get("kind") in ("phase", "end")]
    if bounds_before and bounds_before[-1]["kind"] == "phase":
        assert lo is not None
        inside.insert(0, {**bounds_before[-1], "ts_ns": lo})
    return inside


def _iso(t_ns: float | None) -> str:
    if t_ns is None:
        return "the open end"
    return dt.datetime.fromtimestamp(float(t_ns) / 1e9, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _spans(gpu_rows: _GpuRows, events: _PlacedEvents, requests: dict[str, np.ndarray],
           period: int) -> list[tuple[str, float, float]]:
    """(stream, first, last) of each stream that holds data."""
    spans: list[tuple[str, float, float]] = []
    ts_by_gpu = gpu_rows.ts_by_gpu
    if any(len(t) for t in ts_by_gpu):
        spans.append(("GPU samples", min(t[0] for t in ts_by_gpu if len(t)) - period,
                      max(t[-1] for t in ts_by_gpu if len(t))))
    if len(events.t_ns) and not np.isnan(events.t_ns).all():
        spans.append(("engine log lines", np.nanmin(events.t_ns), np.nanmax(events.t_ns)))
    if len(requests["start_ns"]):
        spans.append(("requests", np.nanmin(requests["start_ns"]),
                      np.nanmax(np.fmax(requests["end_ns"], requests["start_ns"]))))
    return spans


def _grid(tables: RunTables, gpu_rows: _GpuRows, events: _PlacedEvents, requests: dict[str, np.ndarray],
          period: int, pp_size: int) -> np.ndarray:
    """The grid spanning every stream within the window; AnalysisError for none, or too many cells."""
    lo, hi = tables.window_ns
    spans = _spans(gpu_rows, events, requests, period)
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
    grid_bytes = 8 * n_cells * (len(GPU_METRICS) * max(len(gpu_rows.keys), 1) + 4 * max(pp_size, 1) + 8)
    if grid_bytes > MAX_GRID_BYTES:
        held = "; ".join(f"{name} {_iso(first)} to {_iso(last)}" for name, first, last in spans)
        raise AnalysisError(
            f"{tables.source}: the data spans {(end - start) / 86_400e9:.1f} days, {n_cells:,} "
            f"cells of {period / 1e9:g} s, about {grid_bytes / 2**30:.0f} GiB to align at once ({held}): "
            "analyse a window of it with gputrace report RUN --start T --end T (compare: "
            "--start-a/--end-a, --start-b/--end-b)")
    return make_grid(start, end, period)


def _gpu_on_grid(samples: GpuSampleColumns, gpu_rows: _GpuRows, grid: np.ndarray, period: int
                 ) -> tuple[dict[str, np.ndarray], list[int | None]]:
    """Each GPU metric on the grid, (n_gpu, n_cells); and each GPU's own sample period."""
    gpu = {m: np.full((len(gpu_rows.keys), len(grid)), np.nan) for m in GPU_METRICS}
    if not len(samples):
        return gpu, [None] * len(gpu_rows.keys)
    order = gpu_rows.order
    lost = np.asarray(samples.lost, dtype=bool)[order]
    values = {m: np.asarray(samples.metric(m), dtype=np.float64)[order] for m in GPU_METRICS}
    _fill_gpu_metrics(gpu, values, lost, gpu_rows.ts_by_gpu, gpu_rows.bounds, grid, period)
    return gpu, _series_periods(gpu_rows.ts_by_gpu, gpu_rows.bounds, values["power_w"],
                                values["utilization_ratio"])


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


_EVENT_VALUES = ("running_req", "queue_req", "token_usage", "gen_throughput_tok_s", "new_seq", "new_token")


def _stages_on_grid(ev: SchedulerEventColumns, placed: _PlacedEvents, pp: int, grid: np.ndarray
                    ) -> _StagesOnGrid:
    """Each stage's lines in time order, and its last logged state held on the grid."""
    out = _StagesOnGrid([], np.full((pp, len(grid)), np.nan), np.full((pp, len(grid)), np.nan),
                        np.full((pp, len(grid)), np.nan))
    dp_rank = np.nan_to_num(ev.dp_rank, nan=0).astype(np.int64)
    values = {c: np.asarray(getattr(ev, c), dtype=np.float64) for c in _EVENT_VALUES}
    t_ns = placed.t_ns
    for s in range(pp):
        sel = np.flatnonzero((placed.pp_rank == s) & ~np.isnan(t_ns))
        sel = sel[np.argsort(t_ns[sel], kind="stable")]
        out.events.append(StageEvents(t_ns[sel], ev.kind[sel], *(values[c][sel] for c in _EVENT_VALUES)))
        _hold_stage_state(out, s, t_ns, dp_rank, values, sel, grid)
    return out


def _hold_stage_state(out: _StagesOnGrid, stage: int, t_ns: np.ndarray, dp_rank: np.ndarray,
                      values: dict[str, np.ndarray], sel: np.ndarray, grid: np.ndarray) -> None:
    run_sum = np.zeros(len(grid))
    q_sum = np.zeros(len(grid))
    seen = np.zeros(len(grid), dtype=bool)
    for d in np.unique(dp_rank[sel]):
        sd = sel[dp_rank[sel] == d]
        max_age = _max_age_ns(t_ns[sd])
        r = hold_last(t_ns[sd], values["running_req"][sd], grid, max_age)
        q = hold_last(t_ns[sd], values["queue_req"][sd], grid, max_age)
        u = hold_last(t_ns[sd], values["token_usage"][sd], grid, max_age)
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


def _work(requests: dict[str, np.ndarray], gauge: LoadGaugeColumns, stages: _StagesOnGrid, has_log: bool,
          grid: np.ndarray, period: int, notes: list[str]) -> _Work:
    """When there was work, from the best source the run holds: its requests, the engine's log,
    a gauge of requests in flight; else every cell."""
    started = ~np.isnan(requests["start_ns"])
    inflight = _gauge_inflight(gauge, grid, notes) if not started.any() and len(gauge) else None
    if started.any():
        # A request with no end was still in flight when the run stopped.
        end = np.where(np.isnan(requests["end_ns"]), grid[-1], requests["end_ns"])[started]
        return _Work(coverage_ratio(requests["start_ns"][started], end, grid, period),
                     "client requests in flight", count_in_flight(requests["start_ns"][started], end, grid))
    if has_log:
        work = ((stages.running + stages.queue) > 0).any(axis=0).astype(np.float64)
        return _Work(work, "engine running + queued requests (log)", inflight)
    if inflight is not None:
        return _Work((np.nan_to_num(inflight) > 0).astype(np.float64), "client requests in flight (gauge)",
                     inflight)
    notes.append("no requests and no engine log: bubble fraction counts all idle time")
    return _Work(np.ones(len(grid)), "unknown: every cell counted as having work", None)


def _gauge_inflight(gauge: LoadGaugeColumns, grid: np.ndarray, notes: list[str]) -> np.ndarray:
    """No request records, but a gauge of the client's requests in flight (already in the
    collector's clock): it gives the offered load; the engine's state still gives the work."""
    gauge_t = np.asarray(gauge.ts_ns, dtype=np.int64)
    gaps = np.diff(gauge_t)
    inflight = hold_last(gauge_t, np.asarray(gauge.inflight_requests, dtype=np.float64), grid,
                         _max_age_ns(gauge_t))
    what = ("offered load from the engine's running + queued requests (no client gauge), "
            if "engine" in str(gauge.source[0]) else "client requests in flight from a gauge ")
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


def _stage_busy(gpu: dict[str, np.ndarray], gpu_stage: np.ndarray, stage: int, grid: np.ndarray,
                period: int) -> np.ndarray:
    """A stage's compute share on the grid, averaged over BUSY_WINDOW_NS: SM activity where the
    GPUs have it (NCCL's spinning receive fills utilization.gpu), else utilization."""
    rows = np.flatnonzero(gpu_stage == stage)
    if not len(rows):
        return np.full(len(grid), np.nan)
    series = gpu["sm_active_ratio"][rows]
    if np.isnan(series).all():
        series = gpu["utilization_ratio"][rows]
    with np.errstate(all="ignore"):
        mean = np.nanmean(series, axis=0) if len(rows) > 1 else series[0]
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
    if (engine.engine or "sglang") != "sglang" or pp < 2:
        return hold_last(ev.t_ns, ev.running_req.astype(np.float64), grid, max_age), {"logged": len(ev.t_ns)}
    sel = np.isin(ev.kind, ("decode", "prefill"))
    t = ev.t_ns[sel]
    sizes = line_sizes(ev.kind[sel], ev.running_req[sel], ev.new_seq[sel])
    at = np.clip(np.searchsorted(grid, t), 0, len(grid) - 1)
    totals = engine_totals(sizes, ev.queue_req[sel], busy[at], pp, engine.slots_at(pp),
                           engine.microbatch_cap_at(pp), engine.admission_limit)
    return hold_last(t, totals.running, grid, max_age), totals.counts()
