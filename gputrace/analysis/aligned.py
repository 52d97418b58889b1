"""Read a run store into one aligned view: every stream in the collector's clock, GPU metrics and
per-stage engine state on one grid (the NVML sample period), requests and markers beside them.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

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
from gputrace.model import ABANDONED_PREFIX
from gputrace.store import Store

GPU_METRICS = ("utilization_ratio", "power_w", "pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s",
               "sm_clock_hz", "clock_event_reasons", "sm_active_ratio")


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
    engine: dict[str, Any]
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


def _num(tbl: pa.Table, name: str) -> np.ndarray:
    col = tbl.column(name)
    return np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float64) if col.null_count \
        else np.asarray(col.to_numpy(zero_copy_only=False))


def _to_ref(clocks: ClockModel, hosts: np.ndarray, t: np.ndarray) -> np.ndarray:
    out = np.asarray(t, dtype=np.float64).copy()
    for h in np.unique(hosts):
        sel = hosts == h
        ok = sel & ~np.isnan(out)
        out[ok] = out[ok] - clocks.offset_ns(str(h), out[ok].astype(np.int64))
    return out


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


def _engine_config(store: Store) -> dict[str, Any]:
    rows = store.sql_arrow("SELECT * FROM engine_configs ORDER BY line_no").to_pylist()
    merged: dict[str, Any] = {}
    for row in rows:  # later lines win; None never overrides a value
        for k, v in row.items():
            if v is not None and k != "fields_json":
                merged[k] = v
        with contextlib.suppress(ValueError):
            merged.setdefault("fields", {}).update(json.loads(row.get("fields_json") or "{}"))
    if "engine" not in merged:  # no configuration line: the engine whose lines the run holds
        kinds = store.sql("SELECT engine, count(*) FROM scheduler_events GROUP BY 1 ORDER BY 2 DESC LIMIT 1")
        if kinds:
            merged["engine"] = kinds[0][0]
    return merged


MAX_GRID_BYTES = 2 << 30
"""The aligned arrays' size at most (a float per grid cell per GPU metric and per stage series): a
run whose streams span far longer than a benchmark (a log appended to over weeks, files from
different days) is refused with what it holds, to be analysed a window at a time."""
_MARGIN_NS = 2_000_000_000  # beyond a window's edges: host clocks and NVML windows reach over them
_EVENT_MARGIN_NS = 60_000_000_000  # log lines before the window give the state it starts in


def _within(column: str, lo: int | None, hi: int | None, margin_ns: int) -> str:
    """SQL: the column within [lo - margin, hi + margin] (TRUE when the window is open)."""
    parts = ([f"{column} >= {int(lo) - margin_ns}"] if lo is not None else []) + \
        ([f"{column} <= {int(hi) + margin_ns}"] if hi is not None else [])
    return " AND ".join(parts) or "TRUE"


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


def align_store(store: Store, window_ns: tuple[int | None, int | None] = (None, None)) -> AlignedRun:
    """The aligned view of a run store, or of the part of it within ``window_ns`` (collector
    clock; None: open); raises AnalysisError when there is nothing to analyse, or too much at once."""
    notes: list[str] = []
    lo, hi = window_ns
    if lo is not None and hi is not None and hi <= lo:
        raise AnalysisError("the window's end is not after its start")
    gpu_where = _within("ts_ns", lo, hi, _MARGIN_NS)
    # DuckDB draws its own progress bar on stdout for long queries; the report has its own.
    store.sql("SET enable_progress_bar = false")
    probes = store.sql_arrow("SELECT host, local_send_ns, remote_ns, local_recv_ns FROM clock_probes")
    clocks = clock_model(np.asarray(probes.column("host").to_pylist(), dtype=object),
                         _num(probes, "local_send_ns"), _num(probes, "remote_ns"),
                         _num(probes, "local_recv_ns")) if probes.num_rows else ClockModel()
    if not probes.num_rows:
        notes.append("no clock probes: host clocks assumed equal")
    engine = _engine_config(store)

    # GPU samples: a dense GPU id computed in SQL so no strings cross per row.
    keys_tbl = store.sql_arrow(f"SELECT DISTINCT host, gpu_index FROM gpu_samples WHERE {gpu_where} "
                               "ORDER BY host, gpu_index")
    gpu_keys = [(str(h), int(g)) for h, g in zip(keys_tbl.column("host").to_pylist(),
                                                 keys_tbl.column("gpu_index").to_pylist(), strict=True)]
    cols = ", ".join(f"s.{m}" for m in GPU_METRICS)
    samples = store.sql_arrow(
        f"SELECT k.k, s.ts_ns, s.lost, {cols} FROM gpu_samples s JOIN "
        "(SELECT host, gpu_index, row_number() OVER (ORDER BY host, gpu_index) - 1 AS k "
        f" FROM (SELECT DISTINCT host, gpu_index FROM gpu_samples WHERE {gpu_where})) k "
        f"USING (host, gpu_index) WHERE {_within('s.ts_ns', lo, hi, _MARGIN_NS)}")
    k_raw = _num(samples, "k").astype(np.int64) if samples.num_rows else np.zeros(0, np.int64)
    ts_raw = _num(samples, "ts_ns").astype(np.int64) if samples.num_rows else np.zeros(0, np.int64)
    order = _group_order(k_raw, ts_raw)
    k, ts_raw = k_raw[order], ts_raw[order]
    bounds = np.searchsorted(k, np.arange(len(gpu_keys) + 1))
    ts_by_gpu = []
    for i, (host, _) in enumerate(gpu_keys):
        ts_by_gpu.append(clocks.to_reference(host, ts_raw[bounds[i]:bounds[i + 1]]))

    # Engine events, attention-TP rank 0 of each stage.
    ev = store.sql_arrow(
        "SELECT host, source, kind, line_no, log_ts_ns, ts_resolution_ns, recv_ts_ns, dp_rank, "
        "pp_rank, running_req, queue_req, token_usage, gen_throughput_tok_s, new_seq FROM scheduler_events "
        "WHERE coalesce(tp_rank, 0) = 0 AND kind IN ('decode', 'prefill', 'stats') AND "
        # the lines before the window still give the state it starts in
        + _within("coalesce(log_ts_ns, recv_ts_ns)", lo, hi, _EVENT_MARGIN_NS))
    ev_host = np.asarray(ev.column("host").to_pylist(), dtype=object)
    ev_log = _num(ev, "log_ts_ns").astype(np.float64)
    ev_recv = _num(ev, "recv_ts_ns").astype(np.float64)
    ev_off = np.zeros(ev.num_rows)
    for h in np.unique(ev_host):
        sel = ev_host == h
        ref_t = np.where(np.isnan(ev_log[sel]), ev_recv[sel], ev_log[sel])
        ev_off[sel] = clocks.offset_ns(str(h), np.nan_to_num(ref_t).astype(np.int64))
    source_key = np.char.add(ev_host.astype(str), np.asarray(ev.column("source").to_pylist(), dtype=str)) \
        if ev.num_rows else np.zeros(0, dtype=str)
    ev_t, by_recv = place_log_events(ev_log, _num(ev, "ts_resolution_ns").astype(np.float64), ev_recv,
                                     source_key, _num(ev, "line_no").astype(np.float64), ev_off)
    if ev.num_rows == 0:
        log_placement = "no engine log"
    elif by_recv.all():
        log_placement = "receive time (clamped into the logged second)"
    elif not by_recv.any():
        log_placement = "spread by order within each logged second (no receive times)"
        notes.append("engine log lines have second resolution and no receive time: placed by their "
                     "order within the second")
    else:
        log_placement = f"receive time for {by_recv.mean():.0%} of lines, spread by order for the rest"
    ev_pp = np.nan_to_num(_num(ev, "pp_rank").astype(np.float64), nan=0).astype(np.int64)
    log_pp = int(ev_pp.max()) + 1 if ev.num_rows else None

    mapping = stage_mapping(store.meta.topology, engine.get("pp_size"), engine.get("tp_size"),
                            gpu_keys, log_pp)
    gpu_stage = np.array([s if (s := mapping.stage_of(h, g)) is not None else -1 for h, g in gpu_keys],
                         dtype=np.int64)

    # Requests and markers in the collector clock.
    rq = store.sql_arrow("SELECT host, start_ns, first_token_ns, end_ns, prompt_tokens, "
                         "completion_tokens, ok, phase, starts_with(coalesce(error, ''), ?) AS abandoned "
                         "FROM requests WHERE "
                         + _within("coalesce(end_ns, start_ns)", lo, None, _MARGIN_NS) + " AND "
                         + _within("start_ns", None, hi, _MARGIN_NS), [ABANDONED_PREFIX])
    rq_host = np.asarray(rq.column("host").to_pylist(), dtype=object)
    requests = {
        "start_ns": _to_ref(clocks, rq_host, _num(rq, "start_ns")),
        "first_token_ns": _to_ref(clocks, rq_host, _num(rq, "first_token_ns")),
        "end_ns": _to_ref(clocks, rq_host, _num(rq, "end_ns")),
        "prompt_tokens": _num(rq, "prompt_tokens").astype(np.float64),
        "completion_tokens": _num(rq, "completion_tokens").astype(np.float64),
        "ok": np.asarray(rq.column("ok").to_pylist(), dtype=bool),
        "phase": np.asarray([p or "" for p in rq.column("phase").to_pylist()], dtype=object),
        # the client stopped waiting (drain): neither completed nor failed, its end unknown
        "abandoned": np.asarray(rq.column("abandoned").to_pylist(), dtype=bool),
    }
    markers = _markers_within(sorted(
        ({**m, "ts_ns": int(clocks.to_reference(m["host"], np.array([m["ts_ns"]]))[0])}
         for m in store.sql_arrow("SELECT * FROM markers").to_pylist()), key=lambda m: m["ts_ns"]), lo, hi)

    # The grid spans every stream (within the window).
    period = sample_period_ns(ts_by_gpu) if any(len(t) > 1 for t in ts_by_gpu) else 1_000_000_000
    spans: list[tuple[str, float, float]] = []  # (stream, first, last)
    if any(len(t) for t in ts_by_gpu):
        spans.append(("GPU samples", min(t[0] for t in ts_by_gpu if len(t)) - period,
                      max(t[-1] for t in ts_by_gpu if len(t))))
    if ev.num_rows and not np.isnan(ev_t).all():
        spans.append(("engine log lines", np.nanmin(ev_t), np.nanmax(ev_t)))
    if rq.num_rows:
        spans.append(("requests", np.nanmin(requests["start_ns"]),
                      np.nanmax(np.fmax(requests["end_ns"], requests["start_ns"]))))
    if not spans:
        where = "" if window_ns == (None, None) else f" between {_iso(lo)} and {_iso(hi)}"
        untimed = ""
        if ev.num_rows:  # lines there, but none placed in time
            untimed = (f" ({ev.num_rows} engine log lines have no date: a log printing times without "
                       "the date or year needs gputrace import --date YYYY-MM-DD)")
        raise AnalysisError(f"{store.path}: no GPU samples, engine log lines or requests{where} to "
                            f"analyse{untimed}")
    grid_start = int(min(first for _, first, _ in spans))
    grid_end = int(max(last for _, _, last in spans))
    grid_start, grid_end = max(grid_start, lo) if lo is not None else grid_start, \
        min(grid_end, hi) if hi is not None else grid_end
    if grid_end <= grid_start:
        raise AnalysisError(f"{store.path}: no data between {_iso(lo)} and {_iso(hi)}")
    n_cells = -(-(grid_end - grid_start) // period)
    grid_bytes = 8 * n_cells * (len(GPU_METRICS) * max(len(gpu_keys), 1) + 4 * max(mapping.pp_size, 1) + 8)
    if grid_bytes > MAX_GRID_BYTES:
        held = "; ".join(f"{name} {_iso(first)} to {_iso(last)}" for name, first, last in spans)
        raise AnalysisError(
            f"{store.path}: the data spans {(grid_end - grid_start) / 86_400e9:.1f} days, {n_cells:,} "
            f"cells of {period / 1e9:g} s, about {grid_bytes / 2**30:.0f} GiB to align at once ({held}): "
            "analyse a window of it with gputrace report RUN --start T --end T (compare: "
            "--start-a/--end-a, --start-b/--end-b)")
    grid = make_grid(grid_start, grid_end, period)

    gpu = {m: np.full((len(gpu_keys), len(grid)), np.nan) for m in GPU_METRICS}
    series_periods: list[int | None] = [None] * len(gpu_keys)
    if samples.num_rows:
        lost_all = np.asarray(samples.column("lost").to_numpy(zero_copy_only=False), dtype=bool)[order]
        values = {m: _num(samples, m).astype(np.float64)[order] for m in GPU_METRICS}
        _fill_gpu_metrics(gpu, values, lost_all, ts_by_gpu, bounds, grid, period)
        series_periods = _series_periods(ts_by_gpu, bounds, values["power_w"], values["utilization_ratio"])

    dev = {(d["host"], d["gpu_index"]): d for d in store.sql_arrow("SELECT * FROM devices").to_pylist()}
    power_limit = np.array([dev.get(key, {}).get("power_limit_w") or np.nan for key in gpu_keys], dtype=float)
    pcie_cap = np.array([pcie_capacity_bytes_per_s(dev.get(key, {}).get("pcie_max_gen"),
                                                   dev.get(key, {}).get("pcie_max_width")) or np.nan
                         for key in gpu_keys], dtype=float)

    pp = mapping.pp_size
    stage_events: list[StageEvents] = []
    stage_running = np.full((pp, len(grid)), np.nan)
    stage_queue = np.full((pp, len(grid)), np.nan)
    stage_usage = np.full((pp, len(grid)), np.nan)
    ev_dp = np.nan_to_num(_num(ev, "dp_rank").astype(np.float64), nan=0).astype(np.int64)
    kinds = np.asarray(ev.column("kind").to_pylist(), dtype=object)
    cols_ev = {c: _num(ev, c).astype(np.float64) for c in
               ("running_req", "queue_req", "token_usage", "gen_throughput_tok_s", "new_seq")}
    for s in range(pp):
        sel = np.flatnonzero((ev_pp == s) & ~np.isnan(ev_t))
        sel = sel[np.argsort(ev_t[sel], kind="stable")]
        stage_events.append(StageEvents(ev_t[sel], kinds[sel], *(cols_ev[c][sel] for c in cols_ev)))
        run_sum = np.zeros(len(grid))
        q_sum = np.zeros(len(grid))
        seen = np.zeros(len(grid), dtype=bool)
        for d in np.unique(ev_dp[sel]):
            sd = sel[ev_dp[sel] == d]
            gaps = np.diff(ev_t[sd])
            max_age = 3 * float(np.median(gaps)) + 1e9 if len(gaps) else 5e9
            r = hold_last(ev_t[sd], cols_ev["running_req"][sd], grid, max_age)
            q = hold_last(ev_t[sd], cols_ev["queue_req"][sd], grid, max_age)
            u = hold_last(ev_t[sd], cols_ev["token_usage"][sd], grid, max_age)
            seen |= ~np.isnan(r)
            run_sum += np.nan_to_num(r)
            q_sum += np.nan_to_num(q)
            stage_usage[s] = np.fmax(stage_usage[s], u)
        stage_running[s] = np.where(seen, run_sum, 0.0)
        stage_queue[s] = np.where(seen, q_sum, 0.0)

    engine_running, running_sources = reconstruct_engine_running(
        stage_events, grid, engine, pp, _stage_busy(gpu, gpu_stage, 0, grid, period))

    if not ev.num_rows:
        notes.append("no engine log: the micro-batch cap, underfilled pipeline, KV-cache and "
                     "log-sampling causes cannot be diagnosed")
    if not samples.num_rows:
        notes.append("no GPU samples: busy and bubble fractions are not available")
    inflight = None
    started = ~np.isnan(requests["start_ns"])
    gauge = store.sql_arrow("SELECT ts_ns, inflight_requests, source FROM load_samples "
                            "WHERE inflight_requests IS NOT NULL AND "
                            f"{_within('ts_ns', lo, hi, _EVENT_MARGIN_NS)} ORDER BY ts_ns")
    if not started.any() and gauge.num_rows:
        # no request records, but a gauge of the client's requests in flight (already in the
        # collector's clock): it gives the offered load; the engine's state still gives the work
        gauge_t = _num(gauge, "ts_ns").astype(np.int64)
        gaps = np.diff(gauge_t)
        max_age = 3 * float(np.median(gaps)) + 1e9 if len(gaps) else 5e9
        inflight = hold_last(gauge_t, _num(gauge, "inflight_requests").astype(np.float64), grid, max_age)
        what = ("offered load from the engine's running + queued requests (no client gauge), "
                if "engine" in str(gauge.column("source")[0]) else "client requests in flight from a gauge ")
        notes.append(f"{what}sampled every "
                     f"{float(np.median(gaps)) / 1e9 if len(gaps) else 0:g} s (no request records)")
    if started.any():
        # A request with no end was still in flight when the run stopped.
        end = np.where(np.isnan(requests["end_ns"]), grid[-1], requests["end_ns"])[started]
        work = coverage_ratio(requests["start_ns"][started], end, grid, period)
        inflight = count_in_flight(requests["start_ns"][started], end, grid)
        work_source = "client requests in flight"
    elif ev.num_rows:
        work = ((stage_running + stage_queue) > 0).any(axis=0).astype(np.float64)
        work_source = "engine running + queued requests (log)"
    elif inflight is not None:
        work = (np.nan_to_num(inflight) > 0).astype(np.float64)
        work_source = "client requests in flight (gauge)"
    else:
        work = np.ones(len(grid))
        work_source = "unknown: every cell counted as having work"
        notes.append("no requests and no engine log: bubble fraction counts all idle time")

    return AlignedRun(
        name=store.meta.name, period_ns=period, grid_ns=grid, mapping=mapping, gpu_keys=gpu_keys,
        gpu_stage=gpu_stage, gpu=gpu, power_limit_w=power_limit, pcie_capacity_bytes_per_s=pcie_cap,
        stage_events=stage_events, stage_running=stage_running, stage_queue=stage_queue,
        stage_token_usage=stage_usage, work_ratio=work, work_source=work_source, inflight=inflight,
        requests=requests, markers=markers, engine=engine, log_placement=log_placement,
        clocks=clocks, notes=notes, sample_period_ns_by_gpu=series_periods,
        engine_running=engine_running, engine_running_sources=running_sources)


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


def reconstruct_engine_running(stage_events: list[StageEvents], grid: np.ndarray, engine: dict[str, Any],
                               pp: int, busy: np.ndarray) -> tuple[np.ndarray | None, dict[str, int]]:
    """The engine's running total on the grid: vLLM's stats lines give it as logged; SGLang's
    rank-0 lines are summed over one cycle of its micro-batches (schedule.engine_totals)."""
    if not stage_events or not len(stage_events[0].t_ns):
        return None, {}
    ev = stage_events[0]
    gaps = np.diff(ev.t_ns)
    max_age = 3 * float(np.median(gaps)) + 1e9 if len(gaps) else 5e9
    if str(engine.get("engine") or "sglang") != "sglang" or pp < 2:
        return hold_last(ev.t_ns, ev.running_req.astype(np.float64), grid, max_age), {"logged": len(ev.t_ns)}
    sel = np.isin(ev.kind, ("decode", "prefill"))
    t = ev.t_ns[sel]
    sizes = line_sizes(ev.kind[sel], ev.running_req[sel], ev.new_seq[sel])
    at = np.clip(np.searchsorted(grid, t), 0, len(grid) - 1)
    slots = pp + int(engine.get("pp_async_batch_depth") or 0)
    k = engine.get("pp_max_micro_batch_size") or (
        max(int(engine["max_running_requests"]) // pp, 1) if engine.get("max_running_requests") else None)
    pool = int(engine["max_running_requests"]) if engine.get("max_running_requests") else None
    totals = engine_totals(sizes, ev.queue_req[sel], busy[at], pp, slots, int(k) if k else None, pool)
    return hold_last(t, totals.running, grid, max_age), totals.counts()
