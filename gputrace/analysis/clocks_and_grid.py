"""Time alignment: clock offsets, log-event placement inside their second, a common sample grid,
and the GPU -> (pp_rank, tp_rank) mapping. Everything lands in the collector's clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from gputrace.engines import engine_words
from gputrace.topology import Placement, is_parallel_size, placements_from_meta

PROBE_BURST_GAP_NS = 5_000_000_000
"""Probes closer than this form one burst; the smallest round trip of a burst is kept."""

# Per-lane, per-direction PCIe bandwidth after encoding overhead (bytes/s), by generation.
_PCIE_LANE_BYTES_PER_S = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}


# -- clocks ---------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ClockModel:
    """Per-host offsets (remote - collector) at probe times; interpolated linearly between bursts."""

    points: Mapping[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def offset_ns(self, host: str, t_ns: np.ndarray) -> np.ndarray:
        """The offset of ``host`` at ``t_ns`` (its own clock is close enough to look it up)."""
        pts = self.points.get(host)
        if pts is None:
            return np.zeros(np.shape(t_ns), dtype=np.int64)
        times, offsets = pts
        if len(times) == 1:
            return np.full(np.shape(t_ns), offsets[0], dtype=np.int64)
        interp = np.interp(np.asarray(t_ns, dtype=np.float64), times, offsets)
        return np.asarray(np.rint(interp), dtype=np.int64)

    def to_reference(self, host: str, t_ns: np.ndarray) -> np.ndarray:
        """Host clock -> collector clock."""
        t = np.asarray(t_ns, dtype=np.int64)
        return np.asarray(t - self.offset_ns(host, t), dtype=np.int64)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per host: the offsets used (ms) and how many probe bursts they came from."""
        return {h: {"offset_ms_first": float(o[0]) / 1e6, "offset_ms_last": float(o[-1]) / 1e6,
                    "bursts": float(len(o))} for h, (_, o) in self.points.items()}


def clock_model(host: np.ndarray, local_send_ns: np.ndarray, remote_ns: np.ndarray,
                local_recv_ns: np.ndarray) -> ClockModel:
    """Offsets from ClockProbe columns: per host and burst the probe with the smallest RTT."""
    points: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    send = np.asarray(local_send_ns, dtype=np.int64)
    recv = np.asarray(local_recv_ns, dtype=np.int64)
    remote = np.asarray(remote_ns, dtype=np.int64)
    for h in np.unique(host):
        sel = np.flatnonzero(host == h)
        sel = sel[np.argsort(send[sel], kind="stable")]
        rtt = recv[sel] - send[sel]
        offset = remote[sel] - (send[sel] + recv[sel]) // 2
        burst = np.concatenate([[0], np.cumsum(np.diff(send[sel]) > PROBE_BURST_GAP_NS)])
        times, offs = [], []
        for b in range(int(burst[-1]) + 1):
            in_b = np.flatnonzero(burst == b)
            best = in_b[np.argmin(rtt[in_b])]
            times.append(float(send[sel][best] + recv[sel][best]) / 2 + float(offset[best]))
            offs.append(float(offset[best]))
        points[str(h)] = (np.array(times), np.array(offs))
    return ClockModel(points)


# -- log events ---------------------------------------------------------------------------------

def place_log_events(log_ts_ns: np.ndarray, resolution_ns: np.ndarray, recv_ts_ns: np.ndarray,
                     group: np.ndarray, line_no: np.ndarray, offset_ns: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Each event's time in the collector clock and whether the receive time placed it.

    Arrays are float (NaN = unknown) except ``group`` (the source, any dtype). With a receive
    time the event goes where it was received, clamped into its logged second; without one the
    events of one second of one source are spread evenly by line order.
    """
    n = len(log_ts_ns)
    log_ts = np.asarray(log_ts_ns, dtype=np.float64)
    res = np.array(resolution_ns, dtype=np.float64)  # a copy: NaN filled in place
    np.nan_to_num(res, copy=False, nan=1e9)
    recv = np.asarray(recv_ts_ns, dtype=np.float64)
    off = np.asarray(offset_ns, dtype=np.float64)
    placed = np.full(n, np.nan)
    has_recv = ~np.isnan(recv)
    # Each step on the rows it concerns, its temporaries freed before the next: a 13 M-line log's
    # placement held ten full-length temporaries at once.
    if has_recv.any():
        at = np.flatnonzero(has_recv)
        # recv is already in the collector clock; the logged second is in the engine host's clock.
        in_host = recv[at] + off[at]
        lo = log_ts[at]
        logged = ~np.isnan(lo)
        hi = lo[logged] + np.maximum(res[at][logged] - 1, 0)
        in_host[logged] = np.clip(in_host[logged], lo[logged], hi)
        del lo, hi, logged
        in_host -= off[at]
        placed[at] = in_host
        del at, in_host
    spread = ~has_recv & ~np.isnan(log_ts)
    if spread.any():
        idx = np.flatnonzero(spread)
        del spread
        _, g_codes = np.unique(np.asarray(group)[idx], return_inverse=True)
        order = np.lexsort((np.asarray(line_no, dtype=np.float64)[idx], log_ts[idx], g_codes))
        idx = idx[order]
        key_g = g_codes[order]
        del g_codes, order
        key_t = log_ts[idx]
        new = np.empty(len(idx), dtype=bool)
        new[0] = True
        new[1:] = (key_g[1:] != key_g[:-1]) | (key_t[1:] != key_t[:-1])
        del key_g
        starts = np.flatnonzero(new)
        del new
        counts = np.diff(np.append(starts, len(idx)))
        rank = np.arange(len(idx)) - np.repeat(starts, counts)
        v = rank + 0.5
        del rank
        v /= np.repeat(counts, counts)
        v *= res[idx]
        np.add(key_t, v, out=v)  # log_ts + (rank + 0.5) / size * res - off, as one expression gave it
        del key_t
        v -= off[idx]
        placed[idx] = v
    return placed, has_recv


# -- grids --------------------------------------------------------------------------------------

def sample_period_ns(ts_by_gpu: Sequence[np.ndarray]) -> int:
    """The NVML sample period: the median spacing of each GPU's samples, then the median of those."""
    spacings = [float(np.median(np.diff(np.sort(ts)))) for ts in ts_by_gpu if len(ts) > 1]
    spacings = [s for s in spacings if s > 0]
    if not spacings:
        return 1_000_000_000
    return max(round(float(np.median(spacings))), 1_000_000)


def make_grid(start_ns: int, end_ns: int, period_ns: int) -> np.ndarray:
    """Cell ends t (each cell is (t - period, t]) covering [start, end]."""
    n = max(int(np.ceil((end_ns - start_ns) / period_ns)), 1)
    return start_ns + period_ns * np.arange(1, n + 1, dtype=np.int64)


def resample_window(ts_ns: np.ndarray, values: np.ndarray, grid_ns: np.ndarray, period_ns: int
                    ) -> np.ndarray:
    """NVML-style window values (sample at t covers (t - P, t]) onto grid cells: each cell takes
    the first sample at or after its end, if that sample is within one period of it."""
    out = np.full(len(grid_ns), np.nan)
    cells, rows = window_index(ts_ns, grid_ns, period_ns)
    out[cells] = values[rows]
    return out


def window_index(ts_ns: np.ndarray, grid_ns: np.ndarray, period_ns: int) -> tuple[np.ndarray, np.ndarray]:
    """(cells, rows): grid cell ``cells[n]`` takes sample ``rows[n]`` (see resample_window); one
    lookup serves every metric of a GPU."""
    if len(ts_ns) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    i = np.searchsorted(ts_ns, grid_ns, side="left")
    j = np.minimum(i, len(ts_ns) - 1)
    ok = (i < len(ts_ns)) & ((ts_ns[j] - grid_ns) < period_ns)
    cells = np.flatnonzero(ok)
    return cells, j[cells]


def hold_last(ts_ns: np.ndarray, values: np.ndarray, grid_ns: np.ndarray, max_age_ns: float
              ) -> np.ndarray:
    """Last value at or before each grid point (NaN when older than ``max_age_ns``)."""
    out = np.full(len(grid_ns), np.nan)
    if len(ts_ns) == 0:
        return out
    i = np.searchsorted(ts_ns, grid_ns, side="right") - 1
    ok = i >= 0
    j = np.maximum(i, 0)
    ok &= (grid_ns - ts_ns[j]) <= max_age_ns
    out[ok] = values[j[ok]]
    return out


def coverage_ratio(start_ns: np.ndarray, end_ns: np.ndarray, grid_ns: np.ndarray, period_ns: int
                   ) -> np.ndarray:
    """Share of each grid cell covered by the union of [start, end) intervals."""
    if len(start_ns) == 0:
        return np.zeros(len(grid_ns))
    order = np.argsort(start_ns, kind="stable")
    s = np.asarray(start_ns, dtype=np.float64)[order]
    e = np.maximum(np.asarray(end_ns, dtype=np.float64)[order], s)
    run_end = np.maximum.accumulate(e)
    new = np.concatenate([[True], s[1:] > run_end[:-1]])
    first = np.flatnonzero(new)
    m_start = s[first]
    m_end = np.maximum.reduceat(e, first)
    covered_before = np.concatenate([[0.0], np.cumsum(m_end - m_start)])

    def covered_until(t: np.ndarray) -> np.ndarray:
        k = np.searchsorted(m_start, t, side="right")  # intervals starting at or before t
        partial = np.where(k > 0, np.clip(t - m_start[np.maximum(k - 1, 0)], 0,
                                          (m_end - m_start)[np.maximum(k - 1, 0)]), 0.0)
        return covered_before[np.maximum(k - 1, 0)] * (k > 0) + partial

    g = grid_ns.astype(np.float64)
    ratio = (covered_until(g) - covered_until(g - period_ns)) / period_ns
    return np.asarray(np.clip(ratio, 0.0, 1.0), dtype=np.float64)


def count_in_flight(start_ns: np.ndarray, end_ns: np.ndarray, t_ns: np.ndarray) -> np.ndarray:
    """Requests started at or before t and not yet ended, at each t."""
    s = np.sort(np.asarray(start_ns, dtype=np.float64))
    e = np.sort(np.asarray(end_ns, dtype=np.float64))
    t = np.asarray(t_ns, dtype=np.float64)
    counts = np.searchsorted(s, t, side="right") - np.searchsorted(e, t, side="right")
    return np.asarray(counts, dtype=np.float64)


# -- stages -------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StageMapping:
    """Which GPU serves which stage, and where that came from."""

    pp_size: int
    tp_size: int
    placements: tuple[Placement, ...]
    source: str

    def stage_of(self, host: str, gpu_index: int) -> int | None:
        for p in self.placements:
            if p.host == host and p.gpu_index == gpu_index:
                return p.pp_rank
        return None


def stage_mapping(topology: Mapping[str, object], engine_pp_size: int | None,
                  engine_tp_size: int | None, gpu_keys: Sequence[tuple[str, int]],
                  log_pp_ranks: int | None = None, engine: str | None = None) -> StageMapping:
    """From meta.topology, else the engine's placement rule on its pp/tp sizes (hosts as
    nodes in name order), else one stage per rank the log shows (or one stage for all GPUs).
    ``topology`` is meta.json's as read (its sizes checked where the store opened it)."""
    placements = placements_from_meta(topology) if topology else []
    if placements:
        meta_pp, meta_tp = topology.get("pp_size"), topology.get("tp_size")
        pp = meta_pp if is_parallel_size(meta_pp) else max(p.pp_rank for p in placements) + 1
        tp = meta_tp if is_parallel_size(meta_tp) else max(p.tp_rank for p in placements) + 1
        return StageMapping(pp, tp, tuple(placements), f"meta.topology ({topology.get('source', '?')})")
    hosts = sorted({h for h, _ in gpu_keys})
    n_gpu = max(len(gpu_keys), 1)
    # sizes outside 1..MAX_PARALLEL_SIZE (a store written before they were bounded) are not taken
    if is_parallel_size(engine_pp_size):
        pp, source = engine_pp_size, f"engine config + {engine_words(engine).placement_rule}"
        tp = engine_tp_size if is_parallel_size(engine_tp_size) else 1
    elif is_parallel_size(log_pp_ranks):
        pp, tp, source = log_pp_ranks, max(n_gpu // log_pp_ranks, 1), \
            f"log ranks + {engine_words(engine).placement_rule}"
    else:
        pp, tp, source = 1, n_gpu, "assumed: one stage"
    nnodes = max(len(hosts), 1)
    out = [p for node_rank, host in enumerate(hosts)
           for p in engine_words(engine).placements(host, pp_size=pp, tp_size=tp, nnodes=nnodes,
                                                    node_rank=node_rank)]
    return StageMapping(pp, tp, tuple(out), source)


def pcie_capacity_bytes_per_s(gen: float | None, width: float | None) -> float | None:
    """One direction of a PCIe link, after encoding overhead."""
    if gen is None or width is None or not np.isfinite(gen) or not np.isfinite(width):
        return None
    lane = _PCIE_LANE_BYTES_PER_S.get(int(gen))
    return lane * float(width) if lane else None
