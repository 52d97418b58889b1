"""gputrace.log_clock: a log whose stamps run from its lines' receive times by more than a minute
is named, a backlog read at once is not mistaken for a clock behind."""

from __future__ import annotations

import numpy as np
import pytest

from gputrace.log_clock import log_clock_offset

T0 = 1_800_000_000 * 10**9


def _live(offset_s: float, seconds: float, delay_s: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """Lines written every 0.1 s, stamped ``offset_s`` off and truncated to the second, received
    ``delay_s`` after."""
    written = T0 + np.arange(0, seconds, 0.1) * 1e9
    stamps = np.floor((written + offset_s * 1e9) / 1e9) * 1e9
    return stamps, written + delay_s * 1e9


@pytest.mark.parametrize(("offset_s", "zone"), [(7200, "Etc/GMT-2"), (-18000, "Etc/GMT+5"),
                                                 (19800, "UTC+05:30")])
def test_a_live_log_off_by_hours_is_named_with_its_zone(offset_s: float, zone: str) -> None:
    """Lines arriving live for a minute, stamped hours off: the offset and the zone to set."""
    found = log_clock_offset("h log", *_live(offset_s, 60))
    assert found is not None and abs(found.offset_s - offset_s) < 2 and found.suggested_timezone() == zone


def test_a_backlog_read_at_once_is_not_a_clock_behind() -> None:
    """An hour of old lines all received within a second looks 'behind': not claimed."""
    stamps = T0 + np.arange(0, 3600, 1.0) * 1e9
    received = T0 + 7200e9 + np.linspace(0, 0.8, len(stamps)) * 1e9
    assert log_clock_offset("h log", stamps, received) is None


def test_a_log_within_a_minute_and_a_few_bad_stamps_are_not_named() -> None:
    """A follower's delay of 30 s, or four lines stamped a day ahead, is no clock error."""
    assert log_clock_offset("h log", *_live(0, 60, delay_s=30)) is None
    stamps, received = _live(0, 60)
    stamps[:4] += 86_400e9
    assert log_clock_offset("h log", stamps, received) is None
