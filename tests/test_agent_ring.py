"""The agent's ring buffer: implicit sequence numbers, expiry by age and by size; rows as records."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, fields

import pytest

from gputrace.agent.sampling import CursorTooOld, SampleRing
from gputrace.agent.server import row_line
from gputrace.gpu.sampler import ROW_INDEX, SampleRow, sample_row
from gputrace.gpu.simulated import SimulatedSampler
from gputrace.model import GpuSample


def _batch(n: int, ts: int) -> list[SampleRow]:
    return [sample_row(GpuSample("h", i, ts)) for i in range(n)]


def test_sequence_numbers_and_paging() -> None:
    """Samples are numbered from 1 in arrival order; after(since) pages from since + 1."""
    ring = SampleRing(retention_ns=10**12)
    ring.extend(_batch(3, 1), 1)
    ring.extend(_batch(3, 2), 2)
    assert ring.newest_seq == 6 and ring.oldest_seq() == 1
    assert [(seq, s.ts_ns, s.gpu_index) for seq, s in ring.after(2, 3)] == [(3, 1, 2), (4, 2, 0), (5, 2, 1)]
    assert ring.after(6, 10) == [] and ring.after(60, 10) == []


def test_expiry_by_age_drops_whole_batches_and_reports_oldest() -> None:
    """Batches older than the retention leave together; a cursor before them gets CursorTooOld."""
    ring = SampleRing(retention_ns=100)
    for t in (0, 50, 120, 200):
        ring.extend(_batch(2, t), t)
    assert ring.oldest_seq() == 5 and len(ring) == 4  # t=0 and t=50 are older than 200 - 100
    with pytest.raises(CursorTooOld) as info:
        ring.after(3, 10)
    assert info.value.oldest_seq == 5
    assert [seq for seq, _ in ring.after(4, 10)] == [5, 6, 7, 8]


def test_expiry_by_size() -> None:
    """Past max_samples the oldest batches go, however young."""
    ring = SampleRing(retention_ns=10**12, max_samples=5)
    for t in range(4):
        ring.extend(_batch(2, t), t)
    assert len(ring) <= 5 and ring.newest_seq == 8
    assert [seq for seq, _ in ring.after(ring.oldest_seq() - 1, 10)][-1] == 8


def test_sim_rows_are_whole_records_and_lines_keep_the_format() -> None:
    """Every sim row holds every GpuSample field; its NDJSON line is the record's fields, then seq."""
    sampler = SimulatedSampler("h", 3, pattern="square:0.5:0.5")
    now = time.time_ns()
    rows = sampler.sample_rows(now) + sampler.sample_rows(now + 400_000_000)
    assert {len(row) for row in rows} == {len(fields(GpuSample))}
    assert any(row[ROW_INDEX["utilization_ratio"]] is not None for row in rows)  # driver records too
    for seq, row in enumerate(rows, 7):
        record = GpuSample(*row)
        assert sample_row(record) == row
        line = json.loads(row_line(seq, row))
        assert list(line) == [f.name for f in fields(GpuSample) if f.name != "seq"] + ["seq"]
        assert line == {**asdict(record), "seq": seq}


def test_latest_per_gpu_follows_the_batches_in_order() -> None:
    """Newest tick record per GPU, newest with (memory) utilization; a lost record counts for both."""
    ring = SampleRing(retention_ns=10**12)
    driver = sample_row(GpuSample("h", 0, 95, utilization_ratio=0.5, memory_utilization_ratio=0.25))
    tick0, tick1 = sample_row(GpuSample("h", 0, 100, power_w=1.0)), sample_row(GpuSample("h", 1, 100))
    ring.extend([driver, tick0, tick1], 100)
    later = sample_row(GpuSample("h", 0, 200, power_w=2.0))
    lost = sample_row(GpuSample("h", 1, 200, lost=True))
    ring.extend([later, lost], 200)
    latest, util, memory_util = ring.latest()
    assert latest == {0: later, 1: lost}
    assert util == {0: driver, 1: lost} and memory_util == {0: driver, 1: lost}
    assert ring.newest_seq == 5 and len(ring) == 5


def test_a_seq_is_found_by_bisection_with_the_same_rows_as_a_scan() -> None:
    """Batches of uneven sizes, expired by size thousands of times (the front of the batch list cut
    off and its rows freed): every cursor and limit pages exactly the rows a scan of everything
    added gives, across batch edges."""
    ring = SampleRing(retention_ns=10**15, max_samples=300)
    added: list[SampleRow] = []  # the row with seq n is added[n - 1]
    for t in range(1, 4001):
        batch = [sample_row(GpuSample("h", i, t)) for i in range(t % 7)]  # 0..6 rows, some empty
        ring.extend(batch, t)
        added += batch
        if t % 997 == 0 or t == 4000:
            oldest, newest = ring.oldest_seq(), ring.newest_seq
            assert newest == len(added) and 300 - 6 <= len(ring) <= 300
            for since in range(oldest - 1, newest + 2):
                for limit in (1, 5, 13, 400):
                    assert ring.rows_after(since, limit) == added[since:since + limit], (since, limit)
            with pytest.raises(CursorTooOld):
                ring.rows_after(oldest - 2, 10)


def test_busy_seconds_count_every_utilization_sample_over_its_period() -> None:
    """Each utilization sample adds its ratio times the time since the GPU's previous one: the first
    counts nothing, one not newer counts nothing, a gap counts at most MAX_BUSY_PERIOD_NS, a lost
    GPU's record nothing; records without utilization (ticks) leave it alone."""
    from gputrace.agent.sampling import MAX_BUSY_PERIOD_NS

    ring = SampleRing(retention_ns=10**13)
    ms = 1_000_000

    def util(gpu: int, ts: int, ratio: float | None, lost: bool = False) -> SampleRow:
        return sample_row(GpuSample("h", gpu, ts, utilization_ratio=ratio, lost=lost))

    ring.extend([util(0, 1000 * ms, 0.5), util(1, 1000 * ms, 1.0)], 1000 * ms)
    assert ring.busy_seconds() == {0: 0.0, 1: 0.0}
    ring.extend([util(0, 1200 * ms, 1.0), util(0, 1400 * ms, 0.25), util(1, 1200 * ms, None),
                 util(0, 1300 * ms, 1.0)], 1400 * ms)  # the last is older than the one before
    ring.extend([util(1, 1500 * ms, 0.0, lost=True), util(0, 9400 * ms, 1.0)], 9400 * ms)
    busy = ring.busy_seconds()
    assert busy[0] == pytest.approx(0.2 * 1.0 + 0.2 * 0.25 + MAX_BUSY_PERIOD_NS / 1e9)
    assert busy[1] == 0.0


def test_busy_seconds_rate_is_the_mean_utilization_of_a_simulated_gpu() -> None:
    """A sim GPU at 50 % duty: the counter's increase over 3 s of driver samples is half of it."""
    sampler = SimulatedSampler("h", 1, pattern="square:0.5:0.5")
    ring = SampleRing(retention_ns=10**13)
    t0 = time.time_ns()
    for k in range(31):
        now = t0 + k * 100_000_000
        ring.extend(sampler.sample_rows(now), now)
        if k == 0:
            start = ring.busy_seconds()[0]
    assert (ring.busy_seconds()[0] - start) / 3.0 == pytest.approx(0.5, abs=0.07)
