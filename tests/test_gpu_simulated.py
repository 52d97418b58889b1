"""The simulated GPU backend: feed-file tailing (the simulator's contract) and the patterns."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import open_paths
from structlog.testing import capture_logs

from gputrace.errors import SourceError, UsageError
from gputrace.gpu.simulated import DRIVER_PERIOD_NS, FEED_LAG_NS, SimulatedSampler

HEADER = {"feed": "gputrace-sim-gpu", "version": 1, "host": "sim-node0", "gpus": 2,
          "gpu_name": "NVIDIA H100 PCIe", "power_limit_w": 350.0, "idle_power_w": 60.0,
          "pcie_gen": 5, "pcie_width": 16, "memory_total_bytes": 85899345920}
P = DRIVER_PERIOD_NS


def _write(path: Path, *rows: dict[str, Any], raw: str = "") -> None:
    with path.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows) + raw)


def _boundary_ahead(periods: int = 3) -> int:
    return (time.time_ns() // P + periods) * P


def test_feed_header_defines_the_devices(tmp_path: Path) -> None:
    """GPU count, name, limits and host come from the feed header."""
    feed = tmp_path / "gpu.feed"
    _write(feed, HEADER)
    sampler = SimulatedSampler(feed_path=str(feed))
    devices = sampler.devices()
    assert [d.gpu_index for d in devices] == [0, 1]
    assert {(d.host, d.name, d.power_limit_w, d.pcie_max_gen, d.memory_total_bytes) for d in devices} == {
        ("sim-node0", "NVIDIA H100 PCIe", 350.0, 5, 85899345920)}
    assert len({d.uuid for d in devices}) == 2
    sampler.close()


def test_feed_intervals_become_nvml_like_samples(tmp_path: Path) -> None:
    """Busy intervals give per-period utilization at period boundaries, power and PCIe by activity."""
    feed = tmp_path / "gpu.feed"
    _write(feed, HEADER)
    sampler = SimulatedSampler(feed_path=str(feed), feed_lag_ns=0)
    b = _boundary_ahead()
    # GPU 0 busy for the first half of the period ending at b, moving 1 MB each way; GPU 1 idle
    _write(feed, {"gpu": 0, "start_ns": b - P, "end_ns": b - P // 2, "tx_bytes": 1_000_000,
                  "rx_bytes": 500_000, "extra_key": "ignored"})
    batch = sampler.sample(b)
    at_b = {(s.gpu_index, s.utilization_ratio is not None): s for s in batch if s.ts_ns == b}
    assert at_b[(0, True)].utilization_ratio == 0.5
    assert at_b[(1, True)].utilization_ratio == 0.0
    assert at_b[(1, False)].power_w == 60.0 and at_b[(1, False)].pcie_tx_bytes_per_s == 0.0
    # a tick whose window covers the busy half: power at the limit, PCIe = bytes / window
    sampler2 = SimulatedSampler(feed_path=str(feed), feed_lag_ns=0)
    sampler2.sample(b - P)
    tick = next(s for s in sampler2.sample(b - P // 2) if s.gpu_index == 0 and s.ts_ns == b - P // 2)
    assert tick.power_w == 350.0
    assert tick.pcie_tx_bytes_per_s == pytest.approx(1_000_000 / (P // 2) * 1e9)
    assert tick.pcie_rx_bytes_per_s == pytest.approx(500_000 / (P // 2) * 1e9)
    assert tick.clock_event_reasons == 0 and tick.sm_clock_hz == sampler2.model.sm_clock_max_hz
    sampler.close()
    sampler2.close()


def test_feed_is_tailed_and_partial_lines_wait(tmp_path: Path) -> None:
    """Lines appended later are read; a line without its newline waits until it is complete."""
    feed = tmp_path / "gpu.feed"
    _write(feed, HEADER)
    sampler = SimulatedSampler(feed_path=str(feed), feed_lag_ns=0)
    b = _boundary_ahead()
    line = json.dumps({"gpu": 1, "start_ns": b - P, "end_ns": b, "tx_bytes": 0, "rx_bytes": 0})
    _write(feed, raw=line[:20])
    sampler.sample(b - P)
    assert sampler.feed is not None and not sampler.feed.intervals[1]
    _write(feed, raw=line[20:] + "\n")
    util = [s.utilization_ratio for s in sampler.sample(b) if s.gpu_index == 1 and s.ts_ns == b
            and s.utilization_ratio is not None]
    assert util == [1.0]
    sampler.close()


def test_an_interval_written_after_its_period_still_counts(tmp_path: Path) -> None:
    """The feed is sampled FEED_LAG_NS behind the clock: a kernel whose interval reaches the file
    after its period ended (a simulator behind the clock on shared cores, another node's lines over
    TCP, a node's clock stepped) still counts. Sampled at the clock, the period reads idle."""
    feed = tmp_path / "gpu.feed"
    _write(feed, HEADER)
    b = _boundary_ahead()
    lagged = SimulatedSampler(feed_path=str(feed))
    at_clock = SimulatedSampler(feed_path=str(feed), feed_lag_ns=0)
    assert lagged.lag_ns == FEED_LAG_NS > 2 * P
    at_clock.sample(b - P)
    lagged.sample(b - P + FEED_LAG_NS)
    early = [s.utilization_ratio for s in at_clock.sample(b) if s.gpu_index == 0 and s.ts_ns == b
             and s.utilization_ratio is not None]  # the clock reached b before the interval was written
    _write(feed, {"gpu": 0, "start_ns": b - P, "end_ns": b, "tx_bytes": 0, "rx_bytes": 0})  # late
    late = [s.utilization_ratio for s in lagged.sample(b + FEED_LAG_NS) if s.gpu_index == 0 and s.ts_ns == b
            and s.utilization_ratio is not None]
    assert early == [0.0] and late == [1.0]
    lagged.close()
    at_clock.close()


def test_bad_feed_lines_are_counted_not_fatal(tmp_path: Path) -> None:
    """Malformed lines are skipped with one log line each and counted; good lines still count."""
    feed = tmp_path / "gpu.feed"
    _write(feed, HEADER)
    sampler = SimulatedSampler(feed_path=str(feed), feed_lag_ns=0)
    b = _boundary_ahead()
    _write(feed, {"gpu": 7, "start_ns": b - P, "end_ns": b}, {"gpu": 0, "start_ns": "x", "end_ns": b},
           {"gpu": 0, "start_ns": b - P, "end_ns": b}, raw="not json\n")
    with capture_logs() as logs:
        batch = sampler.sample(b)
    assert sampler.feed is not None and sampler.feed.bad_lines == 3
    assert [e["line"] for e in logs if e["event"] == "bad feed line skipped"] == [2, 3, 5]
    assert next(s.utilization_ratio for s in batch if s.gpu_index == 0 and s.ts_ns == b) == 1.0
    sampler.close()


def test_feed_without_header_is_a_clear_error(tmp_path: Path) -> None:
    """A feed that never gets its header fails after the wait with the path in the message."""
    feed = tmp_path / "missing.feed"
    with pytest.raises(SourceError, match=r"missing\.feed: no feed header"):
        SimulatedSampler(feed_path=str(feed), feed_wait_s=0.1)
    feed.write_text('{"feed": "something-else", "version": 1}\n')
    with pytest.raises(SourceError, match="not a gputrace-sim-gpu version 1 feed"):
        SimulatedSampler(feed_path=str(feed), feed_wait_s=0.1)
    feed.write_text("not json\n")
    with pytest.raises(SourceError, match="feed header is not JSON") as refused:
        SimulatedSampler(feed_path=str(feed), feed_wait_s=0.1)
    # a refused feed's file is closed when refused, not whenever the collector frees the error
    assert refused.traceback and str(feed) not in open_paths()


@pytest.mark.parametrize(("name", "value", "message"), [
    ("power_limit_w", "lots", "'power_limit_w' is not a number: 'lots'"),
    ("pcie_gen", 4.5, "'pcie_gen' is not a whole number: 4.5"),
])
def test_a_feed_header_with_a_bad_gpu_constant_is_one_clear_error(
        tmp_path: Path, name: str, value: object, message: str) -> None:
    """A GPU constant in the header that is no number is refused where it enters, naming it."""
    feed = tmp_path / "bad.feed"
    _write(feed, {**HEADER, name: value})
    with pytest.raises(SourceError, match=f"bad\\.feed: feed header's {message}"):
        SimulatedSampler(feed_path=str(feed), feed_wait_s=0.1)


def test_constant_pattern_sets_utilization_and_power() -> None:
    """constant:0.25 gives utilization 0.25 per period and power a quarter of the way to the limit."""
    sampler = SimulatedSampler("h", 3, pattern="constant:0.25")
    b = _boundary_ahead()
    sampler.sample(b - P)
    batch = sampler.sample(b)
    m = sampler.model
    assert {s.utilization_ratio for s in batch if s.utilization_ratio is not None} == {0.25}
    ticks = [s for s in batch if s.ts_ns == b and s.power_w is not None]
    assert len(ticks) == 3
    expected_w = m.idle_power_w + 0.25 * (m.power_limit_w - m.idle_power_w)
    assert {t.power_w for t in ticks} == {round(expected_w, 3)}


def test_square_pattern_shifts_phase_per_gpu() -> None:
    """The square wave is half busy on average and the GPUs are out of phase, like pipeline stages."""
    sampler = SimulatedSampler("h", 2, pattern="square:1:0.5")
    start = _boundary_ahead()
    sampler.sample(start)  # the periods before start are not part of the two cycles measured
    utils: dict[int, list[float]] = {0: [], 1: []}
    for k in range(1, 13):  # two seconds of periods
        for s in sampler.sample(start + k * P):
            if s.utilization_ratio is not None:
                utils[s.gpu_index].append(s.utilization_ratio)
    assert sum(utils[0]) / len(utils[0]) == pytest.approx(0.5, abs=0.01)
    assert utils[0] != utils[1]


def test_bad_pattern_is_a_usage_error() -> None:
    """An unknown pattern is refused with the accepted forms named."""
    with pytest.raises(UsageError, match="square"):
        SimulatedSampler("h", 1, pattern="sawtooth")
