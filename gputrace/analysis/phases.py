"""Load phases: spans of steady load, from markers, the requests' phase labels, or detected from
the load itself (client in-flight requests, or the engine's running + queued requests).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gputrace.model import Marker


@dataclass(frozen=True, slots=True)
class Phase:
    """One load level: [start_ns, end_ns) in the collector clock."""

    label: str
    start_ns: int
    end_ns: int
    target_concurrency: int | None
    source: str  # "markers" | "request labels" | "detected from ..."

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def phases_from_markers(markers: Sequence[Marker], data_end_ns: int) -> list[Phase]:
    """A "phase" marker starts a phase that lasts until the next phase or "end" marker (or the
    end of the data); other marker kinds are notes and end nothing."""
    bounds = [m for m in markers if m.kind in ("phase", "end")]
    out = []
    for i, m in enumerate(bounds):
        if m.kind != "phase":
            continue
        end = bounds[i + 1].ts_ns if i + 1 < len(bounds) else data_end_ns
        if end > m.ts_ns:
            out.append(Phase(str(m.label), int(m.ts_ns), int(end), m.target_concurrency, "markers"))
    return out


def phases_from_request_labels(start_ns: np.ndarray, end_ns: np.ndarray, label: np.ndarray
                               ) -> list[Phase]:
    """Each label spans its first request's start to its last request's end; a label of the form
    C=N gives the target concurrency."""
    out = []
    for lab in [x for x in dict.fromkeys(label.tolist()) if x]:
        sel = label == lab
        s = float(np.nanmin(start_ns[sel]))
        e = float(np.nanmax(np.fmax(end_ns[sel], start_ns[sel])))
        out.append(Phase(str(lab), int(s), int(e), _target_from_label(str(lab)), "request labels"))
    out.sort(key=lambda p: p.start_ns)
    # Consecutive levels overlap by the previous level's tail; cut at the next level's start.
    return [Phase(p.label, p.start_ns, min(p.end_ns, out[i + 1].start_ns) if i + 1 < len(out)
                  else p.end_ns, p.target_concurrency, p.source) for i, p in enumerate(out)]


def _target_from_label(label: str) -> int | None:
    head, _, tail = label.partition("=")
    return int(tail) if head.strip().upper() in ("C", "CONCURRENCY") and tail.strip().isdigit() else None


def detect_phases(grid_ns: np.ndarray, load: np.ndarray, period_ns: int, what: str,
                  min_duration_s: float = 5.0, rel_tol: float = 0.25) -> list[Phase]:
    """Segments of steady, non-zero load. The load is taken per second (median), a new segment
    starts where the level leaves the running segment's median by more than ``rel_tol`` (and at
    least one request), and segments shorter than ``min_duration_s`` are dropped."""
    per_s = max(round(1e9 / period_ns), 1)
    n_s = len(load) // per_s
    if n_s == 0:
        return []
    level = np.nanmedian(np.nan_to_num(load[: n_s * per_s]).reshape(n_s, per_s), axis=1)
    t_s = grid_ns[: n_s * per_s].reshape(n_s, per_s)
    segs: list[tuple[int, int, float]] = []
    start = 0
    for i in range(1, n_s + 1):  # one step per second of run: cheap
        cur = float(np.median(level[start:i]))
        if i == n_s or abs(level[i] - cur) > max(1.0, rel_tol * cur):
            segs.append((start, i, cur))
            start = i
    # Short blips are dropped; kept neighbours within the tolerance of each other, with only a
    # short gap (up to two blips) between them, are one level (a ramp or a dip split it).
    kept = [(a, b, lv) for a, b, lv in segs if lv >= 0.5 and (b - a) >= min_duration_s]
    merged: list[tuple[int, int, float]] = []
    for a, b, lv in kept:
        if merged and a - merged[-1][1] <= 2 * min_duration_s and \
                abs(merged[-1][2] - lv) <= max(1.0, rel_tol * max(merged[-1][2], lv)):
            pa = merged[-1][0]
            merged[-1] = (pa, b, float(np.median(level[pa:b])))
        else:
            merged.append((a, b, lv))
    out = []
    for a, b, lv in merged:
        c = round(lv)
        out.append(Phase(f"load={c}", int(t_s[a, 0] - period_ns), int(t_s[b - 1, -1]), c,
                         f"detected from {what}"))
    return out


def steady_window(phase: Phase, trim_s: float) -> tuple[int, int]:
    """The phase without its first ``trim_s`` seconds (the ramp while a level fills up), never
    more than a quarter of the phase."""
    trim = int(min(trim_s * 1e9, (phase.end_ns - phase.start_ns) / 4))
    return phase.start_ns + trim, phase.end_ns
