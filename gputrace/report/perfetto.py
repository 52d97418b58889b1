"""Chrome/Perfetto trace JSON: counter tracks per stage (utilization, running requests, power) and
phase slices; opens in ui.perfetto.dev and chrome://tracing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from gputrace.analysis.result import Analysis
from gputrace.json_types import JsonObject, JsonValue

MAX_POINTS_PER_TRACK = 20_000
"""Long runs are averaged down to this many points per counter track to keep the file small."""


def _downsample(t_us: np.ndarray, v: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    step = max(int(np.ceil(len(v) / max_points)), 1)
    if step == 1:
        return t_us, v
    m = len(v) // step
    with np.errstate(all="ignore"):
        vv = v[: m * step].reshape(m, step)
        ok = ~np.isnan(vv)
        mean = np.where(ok.any(axis=1), np.nansum(vv, axis=1) / np.maximum(ok.sum(axis=1), 1), np.nan)
    return t_us[: m * step: step], mean


def _counter(events: list[JsonValue], pid: int, name: str, t_us: np.ndarray, v: np.ndarray,
             max_points: int) -> None:
    t, vals = _downsample(t_us, v, max_points)
    keep = ~np.isnan(vals)
    # Drop repeats: a counter holds its value until the next event.
    if keep.any():
        idx = np.flatnonzero(keep)
        same = np.concatenate([[False], vals[idx][1:] == vals[idx][:-1]])
        idx = idx[~same]
        events.extend({"name": name, "ph": "C", "ts": float(t[i]), "pid": pid,
                       "args": {name: round(float(vals[i]), 4)}} for i in idx)


def build_trace(a: Analysis, max_points: int = MAX_POINTS_PER_TRACK) -> JsonObject:
    """The trace document."""
    r = a.run
    t0 = int(r.grid_ns[0] - r.period_ns)
    # Counters take the cell's start: the NVML value describes the period that follows it.
    t_us = (r.grid_ns - r.period_ns - t0).astype(np.float64) / 1e3
    # the trace's events: JSON as Perfetto reads it (the Trace Event Format), written whole
    events: list[JsonValue] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"run {r.name}: phases"}},
        {"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}},
    ]
    for ph in a.phases:
        events.append({"name": ph.label, "ph": "X", "pid": 0, "tid": 0, "cat": "phase",
                       "ts": (ph.start_ns - t0) / 1e3, "dur": (ph.end_ns - ph.start_ns) / 1e3,
                       "args": {"target_concurrency": ph.target_concurrency, "source": ph.source}})
    for s in range(r.pp_size):
        pid = s + 1
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"stage {s}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        _counter(events, pid, "utilization", t_us, a.series.utilization[s], max_points)
        _counter(events, pid, "running requests", t_us, r.stage_running[s], max_points)
        _counter(events, pid, "power_w", t_us, a.series.power_w[s], max_points)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"run": r.name, "start_ns": t0, "pp_size": r.pp_size}}


def write_trace(a: Analysis, path: str | Path, max_points: int = MAX_POINTS_PER_TRACK) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(build_trace(a, max_points), separators=(",", ":")))
    return out
