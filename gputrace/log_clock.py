"""Whether an engine log's stamps agree with when the collector received its lines: an engine
logging local time read as UTC (the default ``timezone``) put every line hours off, the bubble at
0 and the report healthy, and nothing said it. Pure numpy; the collector writes the result into
meta.json, the analysis into the report's notes.

A line is received after it is written, so (log stamp - receive time) is at most the log clock's
error, and is close to it for the lines received live (the follower's delay is a second or two).
The stamps running *ahead* of the receive times is therefore always an error of the log's clock;
running *behind* is also what a backlog read at start looks like (old lines received now), so it
is claimed only when lines kept arriving at the same offset for ``LIVE_SPAN_S``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TOLERANCE_S = 60.0  # more than a minute off: not a follower's delay, a clock's or a zone's error
LIVE_SPAN_S = 30.0  # lines at one offset received over this long arrived live, not as a backlog
_BAND_S = 5.0  # the lines at one offset: within the follower's delay and the stamps' 1 s resolution
# lines that must agree: the 5th largest difference is the estimate, so a few bad stamps do not count
_SUPPORT = 5
_ZONE_STEP_S = 900  # zones are whole quarter hours from UTC


@dataclass(frozen=True, slots=True)
class LogClockOffset:
    """A log whose stamps run ``offset_s`` ahead of (negative: behind) its lines' receive times."""

    source: str
    offset_s: float
    lines: int  # the lines received at that offset

    @property
    def zone_offset_s(self) -> int:
        """The offset rounded to the nearest zone step (15 min)."""
        return int(round(self.offset_s / _ZONE_STEP_S) * _ZONE_STEP_S)

    def suggested_timezone(self) -> str:
        """The ``timezone`` setting that fits when the current one is UTC (the default): an
        ``Etc/GMT`` zone for whole hours (POSIX signs: Etc/GMT-2 is UTC+2), else the offset."""
        hours, rest = divmod(abs(self.zone_offset_s), 3600)
        if rest == 0 and hours <= 12:
            return "UTC" if hours == 0 else f"Etc/GMT{'-' if self.zone_offset_s > 0 else '+'}{hours}"
        sign = "+" if self.zone_offset_s >= 0 else "-"
        return f"UTC{sign}{hours:02d}:{rest // 60:02d}"

    def to_dict(self) -> dict[str, object]:
        return {"source": self.source, "offset_s": round(self.offset_s, 1), "lines": self.lines,
                "suggested_timezone": self.suggested_timezone()}

    def note(self) -> str:
        way = "ahead of" if self.offset_s > 0 else "behind"
        return (f"log clock: {self.source}: its stamps run {abs(self.offset_s):.0f} s {way} the time its "
                f"lines were received ({self.lines} lines): is the engine logging local time? With "
                f"[hosts.log] timezone = \"UTC\" (the default), set timezone = "
                f"\"{self.suggested_timezone()}\" (or the engine host's zone name)")


def log_clock_offset(source: str, log_ts_ns: np.ndarray, recv_ts_ns: np.ndarray) -> LogClockOffset | None:
    """How far one log's stamps run from its lines' receive times (both in the engine host's
    clock; NaN where unknown), when more than TOLERANCE_S and shown by enough lines; else None."""
    log_ts = np.asarray(log_ts_ns, dtype=np.float64)
    recv = np.asarray(recv_ts_ns, dtype=np.float64)
    both = ~np.isnan(log_ts) & ~np.isnan(recv)
    if both.sum() < _SUPPORT:
        return None
    diff_s = (log_ts[both] - recv[both]) / 1e9
    estimate = float(np.partition(diff_s, len(diff_s) - _SUPPORT)[len(diff_s) - _SUPPORT])
    if abs(estimate) <= TOLERANCE_S:
        return None
    near = (diff_s >= estimate - _BAND_S) & (diff_s <= estimate + _BAND_S)
    received = recv[both][near]
    live = float(received.max() - received.min()) / 1e9 >= LIVE_SPAN_S
    if estimate < 0 and not live:
        return None  # a backlog read at once looks the same: not claimed
    return LogClockOffset(source, float(np.median(diff_s[near])), int(near.sum()))
