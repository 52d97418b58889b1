"""gputrace.log_clock: a log whose stamps run from its lines' receive times by more than a minute
is named, a backlog read at once is not mistaken for a clock behind; one off by a zone's offset,
every line alike, is correctable (the collector's correction: tests/test_collect.py); an engine log
in local time imported with `gputrace import --timezone` is stored in true time."""

from __future__ import annotations

from pathlib import Path

import local_time_log
import numpy as np
import pytest
from helpers import gputrace_process

from gputrace.log_clock import log_clock_offset
from gputrace.store import Store

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
    assert found.correctable and found.zone_offset_s == offset_s


def test_an_offset_that_is_no_zone_or_not_kept_is_named_not_corrected() -> None:
    """A clock 7,000 s off (no whole quarter hours), or stamps 2 h ahead for half the run and then
    right (a clock set mid-run): named, not corrected."""
    found = log_clock_offset("h log", *_live(7000, 60))
    assert found is not None and abs(found.offset_s - 7000) < 2 and not found.correctable
    stamps, received = _live(7200, 60)
    stamps[len(stamps) // 2:] -= 7200e9
    found = log_clock_offset("h log", stamps, received)
    assert found is not None and abs(found.offset_s - 7200) < 2 and not found.correctable


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


def test_a_local_time_log_imported_with_its_timezone_is_stored_in_true_time(tmp_path: Path) -> None:
    """An engine logging in UTC+2 (Python logging with TZ=Etc/GMT-2, as SGLang logs), imported with
    `gputrace import --timezone Etc/GMT-2`: every stored stamp is its line's true second; with the
    default (UTC) each is 7,200 s ahead, as the engine printed it."""
    log = tmp_path / "sglang.log"
    true_s = local_time_log.true_times_s(local_time_log.start(log, 40, 0.01, "Etc/GMT-2"))
    stored = {}
    for zone in ("Etc/GMT-2", "UTC"):
        run = tmp_path / zone.replace("/", "-")
        proc = gputrace_process("import", "--run", str(run), "--timezone", zone, "--sglang-log", str(log))
        assert proc.returncode == 0, proc.stderr
        with Store.open(run, read_only=True) as store:
            rows = store.sql("SELECT log_ts_ns FROM scheduler_events ORDER BY line_no")
        stored[zone] = [t for (t,) in rows]
    assert stored["Etc/GMT-2"] == [int(t) * 10**9 for t in true_s]
    assert stored["UTC"] == [(int(t) + 7200) * 10**9 for t in true_s]
