"""Per-level statistics of a load run: throughput, latency percentiles and the in-flight count the
client actually achieved, computed from RequestRecords and phase Markers alone (pure numpy)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gputrace.model import Marker, RequestRecord, is_abandoned

MIN_HOLD_NS = 1_000_000
"""A count must be held this long to set ``inflight_min``: between one request's end and the next
start of the same slot the count dips for microseconds, which says nothing about the client."""

LAG_WARN_MS = 100.0
"""Event-loop lag (p99) above which the client's own delay shows in its latencies."""

SHORT_TOLERANCE = 0.99
"""A level whose time-weighted mean in-flight count is below this fraction of C is "short"."""


@dataclass(frozen=True, slots=True)
class LevelStats:
    """What one load level achieved. Times in ns since the epoch, latencies in ms; None = no data."""

    label: str
    target_concurrency: int | None
    start_ns: int
    end_ns: int
    ok: int
    failed: int  # ended with an error (the abandoned are not failures: counted on their own)
    output_tokens: int
    aggregate_tok_s: float | None  # completion tokens generated inside the level's window per second
    request_tok_s_p50: float | None  # median of completion tokens / (end - start) per request
    ttft_ms: tuple[float, float, float] | None  # p50, p90, p99
    itl_ms: tuple[float, float, float] | None  # p50, p90, p99 of each request's mean inter-token gap
    inflight_mean: float | None  # time-weighted over the steady part of the level
    inflight_min: int | None  # the lowest count held for at least MIN_HOLD_NS in the steady part
    steady_start_ns: int | None = None  # when the count first reached the target in this level
    loop_lag_p99_ms: float | None = None  # the client's event-loop lag (None when not measured)
    abandoned: int = 0  # still running when the drain time after the last level ran out

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def short(self) -> bool:
        """The client kept fewer requests in flight than asked."""
        if self.target_concurrency is None or self.inflight_mean is None:
            return False
        return self.inflight_mean < SHORT_TOLERANCE * self.target_concurrency


def _percentiles(values: np.ndarray) -> tuple[float, float, float] | None:
    values = values[np.isfinite(values)]
    if values.size == 0:
        return None
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return float(p50), float(p90), float(p99)


def _f(values: Sequence[int | None]) -> np.ndarray:
    return np.array([np.nan if v is None else float(v) for v in values], dtype=np.float64)


def inflight_series(requests: Sequence[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    """The client's in-flight count as a step function: (times_ns, count after each time)."""
    starts = np.array([r.start_ns for r in requests], dtype=np.int64)
    ends = np.array([r.end_ns if r.end_ns is not None else r.start_ns for r in requests], dtype=np.int64)
    times = np.concatenate([starts, ends])
    deltas = np.concatenate([np.ones_like(starts), -np.ones_like(ends)])
    # At equal times apply the ends first, so a slot that ends and restarts at once never counts twice.
    order = np.lexsort((deltas, times))
    times, deltas = times[order], deltas[order]
    counts = np.cumsum(deltas)
    # Keep the last count of each distinct time.
    last = np.r_[times[1:] != times[:-1], True]
    return times[last], counts[last]


def inflight_in_window(
    times: np.ndarray, counts: np.ndarray, t0: int, t1: int
) -> tuple[float | None, int | None]:
    """Time-weighted mean and the lowest count held >= MIN_HOLD_NS, over [t0, t1)."""
    if t1 <= t0 or times.size == 0:
        return None, None
    idx0 = int(np.searchsorted(times, t0, side="right")) - 1
    seg_t = np.concatenate([[t0], times[(times > t0) & (times < t1)], [t1]])
    first = counts[idx0] if idx0 >= 0 else 0
    seg_c = np.concatenate([[first], counts[(times > t0) & (times < t1)]])
    dur = np.diff(seg_t)
    mean = float(np.sum(seg_c * dur) / (t1 - t0))
    held = seg_c[dur >= MIN_HOLD_NS]
    low = int(held.min()) if held.size else int(seg_c.min())
    return mean, low


def _tokens_in_window(
    first: np.ndarray, end: np.ndarray, tokens: np.ndarray, t0: int, t1: int
) -> float:
    """Completion tokens generated in [t0, t1), each request's spread evenly over [first, end]."""
    ok = np.isfinite(first) & np.isfinite(end) & np.isfinite(tokens)
    first, end, tokens = first[ok], end[ok], tokens[ok]
    span = np.maximum(end - first, 1.0)
    overlap = np.clip(np.minimum(end, t1) - np.maximum(first, t0), 0.0, None)
    # A request whose tokens all arrived at one instant counts where it ended.
    instant = (end - first) < 1.0
    frac = np.where(instant, ((end >= t0) & (end < t1)).astype(np.float64), overlap / span)
    return float(np.sum(tokens * frac))


def level_stats(
    requests: Sequence[RequestRecord],
    markers: Sequence[Marker],
    loop_lag: tuple[np.ndarray, np.ndarray] | None = None,
) -> list[LevelStats]:
    """One LevelStats per phase marker, the phase lasting until the next marker (or the last end)."""
    phase_markers = sorted(markers, key=lambda m: m.ts_ns)
    if not phase_markers:
        return []
    times, counts = inflight_series(requests)
    start = np.array([r.start_ns for r in requests], dtype=np.float64)
    first = _f([r.first_token_ns for r in requests])
    end = _f([r.end_ns for r in requests])
    tokens = _f([r.completion_tokens for r in requests])
    ok = np.array([r.ok for r in requests], dtype=bool)
    abandoned = np.array([is_abandoned(r.error) for r in requests], dtype=bool)
    phase = np.array([r.phase or "" for r in requests], dtype=object)
    # Without a first-token time (non-streaming) the tokens are spread from the request's start.
    gen_from = np.where(np.isfinite(first), first, start)
    last_end = int(np.nanmax(end)) if requests and np.isfinite(end).any() else phase_markers[-1].ts_ns
    out: list[LevelStats] = []
    for i, m in enumerate(phase_markers):
        if m.kind != "phase":
            continue
        t0 = m.ts_ns
        t1 = phase_markers[i + 1].ts_ns if i + 1 < len(phase_markers) else max(last_end, t0)
        mine = phase == m.label
        good = mine & ok
        ttft = (first[good] - start[good]) / 1e6
        n_tok = tokens[good]
        itl = (end[good] - first[good]) / np.where(n_tok > 1, n_tok - 1, np.nan) / 1e6
        req_rate = n_tok / np.maximum((end[good] - start[good]) / 1e9, 1e-9)
        steady_t0 = _steady_start(times, counts, t0, t1, m.target_concurrency)
        mean, low = inflight_in_window(times, counts, steady_t0, t1)
        lag_p99 = None
        if loop_lag is not None and loop_lag[0].size:
            sel = (loop_lag[0] >= t0) & (loop_lag[0] < t1)
            if sel.any():
                lag_p99 = float(np.percentile(loop_lag[1][sel], 99) * 1e3)
        duration_s = (t1 - t0) / 1e9
        out.append(
            LevelStats(
                label=m.label,
                target_concurrency=m.target_concurrency,
                start_ns=t0,
                end_ns=t1,
                ok=int(good.sum()),
                failed=int((mine & ~ok & ~abandoned).sum()),
                output_tokens=int(np.nansum(n_tok)),
                aggregate_tok_s=(
                    _tokens_in_window(gen_from, end, tokens, t0, t1) / duration_s if duration_s > 0 else None
                ),
                request_tok_s_p50=float(np.nanmedian(req_rate)) if np.isfinite(req_rate).any() else None,
                ttft_ms=_percentiles(ttft),
                itl_ms=_percentiles(itl),
                inflight_mean=mean,
                inflight_min=low,
                steady_start_ns=steady_t0,
                loop_lag_p99_ms=lag_p99,
                abandoned=int((mine & abandoned).sum()),
            )
        )
    return out


def _steady_start(times: np.ndarray, counts: np.ndarray, t0: int, t1: int, target: int | None) -> int:
    """The first time in [t0, t1) the count is at the target (going down, at or below it)."""
    if target is None or times.size == 0:
        return t0
    idx0 = int(np.searchsorted(times, t0, side="right")) - 1
    before = counts[idx0] if idx0 >= 0 else 0
    if before == target:
        return t0
    inside = (times >= t0) & (times < t1)
    hit = counts[inside] <= target if before > target else counts[inside] >= target
    if not hit.any():
        return t0
    return int(times[inside][np.argmax(hit)])
