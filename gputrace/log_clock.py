"""Whether an engine log's stamps agree with when the collector received its lines: an engine
logging local time read as UTC (the default ``timezone``) put every line hours off, the bubble at
0 and the report healthy, and nothing said it. Pure numpy; the collector writes the result into
meta.json, the analysis into the report's notes.

A line is received after it is written, so (log stamp - receive time) is at most the log clock's
error, and is close to it for the lines received live (the follower's delay is a second or two).
The stamps running *ahead* of the receive times is therefore always an error of the log's clock;
running *behind* is also what a backlog read at start looks like (old lines received now), so it
is claimed only when lines kept arriving at the same offset for ``LIVE_SPAN_S``.

An offset that is a zone's (a whole number of quarter hours, within the follower's delay) and that
the lines received from the first at it on keep (CONSISTENT_SHARE of them) is *correctable*: the
collector moves the log's stored stamps back by it and says so (meta.json, the report's notes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

TOLERANCE_S = 60.0  # more than a minute off: not a follower's delay, a clock's or a zone's error
LIVE_SPAN_S = 30.0  # lines at one offset received over this long arrived live, not as a backlog
_BAND_S = 5.0  # the lines at one offset: within the follower's delay and the stamps' 1 s resolution
# lines that must agree: the 5th largest difference is the estimate, so a few bad stamps do not count
_SUPPORT = 5
_ZONE_STEP_S = 900  # zones are whole quarter hours from UTC
# of the lines received from the first one at the offset on (a backlog read at start comes before
# it), the share that must sit at it for the stamps to be corrected: one zone, not a clock that jumps
CONSISTENT_SHARE = 0.9


@dataclass(frozen=True, slots=True)
class LogClockOffset:
    """A log whose stamps run ``offset_s`` ahead of (negative: behind) its lines' receive times."""

    source: str
    offset_s: float
    lines: int  # the lines received at that offset
    # a zone's offset (whole quarter hours, within the follower's delay) that the lines received
    # from the first at it on keep: the stamps may be moved back by zone_offset_s
    correctable: bool = False

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

    def to_dict(self, corrected: bool = False) -> dict[str, object]:
        """For meta.json: ``corrected_s`` the seconds every stored stamp was moved back by (null:
        left as logged)."""
        return {"source": self.source, "offset_s": round(self.offset_s, 1), "lines": self.lines,
                "suggested_timezone": self.suggested_timezone(),
                "corrected_s": self.zone_offset_s if corrected else None}

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
    found = LogClockOffset(source, float(np.median(diff_s[near])), int(near.sum()))
    since_first = int((recv[both] >= received.min()).sum())
    zone_fit = abs(found.offset_s - found.zone_offset_s) <= _BAND_S
    if zone_fit and found.lines >= CONSISTENT_SHARE * since_first:
        found = replace(found, correctable=True)
    return found


def corrected_note(entry: dict[str, object]) -> str | None:
    """The report's line for a log whose stamps the collector corrected (a ``collector.log_clock``
    entry of meta.json); None for one left as logged (the analysis names that one itself)."""
    corrected = entry.get("corrected_s")
    if not isinstance(corrected, int | float) or not corrected:
        return None
    found = LogClockOffset(str(entry.get("source")), float(corrected), 0)
    way = "ahead of" if corrected > 0 else "behind"
    return (f"log clock: {found.source}: its stamps ran {abs(corrected):,.0f} s {way} the time its lines "
            f"were received, a zone's offset ({found.suggested_timezone()}): corrected at capture, every "
            f"stamp moved back by {corrected:,.0f} s (meta.json collector.log_clock; set timezone = "
            f"\"{found.suggested_timezone()}\" to have them read right)")
