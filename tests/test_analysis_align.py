"""Alignment: clock offsets, log-event placement, grids, coverage, stage mapping."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from analysis_synth import Level, SynthRun, build, synth_tables
from hypothesis import given, settings
from hypothesis import strategies as st

from gputrace.analyse import analyse_run
from gputrace.analysis import aligned_run as aligned
from gputrace.analysis.aligned_run import align, align_store
from gputrace.analysis.clocks_and_grid import (
    clock_model,
    count_in_flight,
    coverage_ratio,
    hold_last,
    make_grid,
    place_log_events,
    resample_window,
    sample_period_ns,
    stage_mapping,
)
from gputrace.analysis.result import analyse_tables
from gputrace.model import EngineConfig
from gputrace.run_tables import ClockProbeColumns, EngineSettings, GpuExtents, GpuSampleColumns, GpuSamples
from gputrace.store import Store
from gputrace.topology import single_node_placements, topology_to_meta


def test_clock_offset_uses_smallest_rtt_and_interpolates() -> None:
    """Per burst the smallest-RTT probe wins; offsets between bursts are interpolated."""
    host = np.array(["a"] * 4, dtype=object)
    send = np.array([0, 1_000, 100e9, 100e9 + 1_000], dtype=np.int64)
    rtt = np.array([9_000_000, 1_000_000, 1_000_000, 9_000_000])
    true_off = np.array([5e6, 10e6, 30e6, 99e6])  # the slow probes lie
    remote = send + rtt // 2 + true_off.astype(np.int64)
    m = clock_model(host, send, remote, send + rtt)
    assert m.offset_ns("a", np.array([0]))[0] == 10_000_000
    assert m.offset_ns("a", np.array([200e9]))[0] == 30_000_000
    mid = m.offset_ns("a", np.array([50e9 + 10e6]))[0]
    assert abs(mid - 20_000_000) < 100_000
    assert m.offset_ns("other", np.array([5]))[0] == 0


def test_receive_time_places_event_inside_its_second() -> None:
    """With a receive time the event lands there, clamped into the logged second (host clock)."""
    log = np.array([10e9, 10e9, 11e9])
    recv = np.array([10.3e9, 12.5e9, np.nan])  # the second arrived late: clamp to end of second
    placed, by_recv = place_log_events(log, np.full(3, 1e9), recv, np.array(["s"] * 3), np.arange(3.0),
                                       np.zeros(3))
    assert placed[0] == 10.3e9 and 10e9 < placed[1] < 11e9 and list(by_recv) == [True, True, False]
    assert placed[2] == 11.5e9  # alone in its second: the middle


def test_spread_by_order_within_second() -> None:
    """Without receive times, n lines of one second are spread evenly in line order per source."""
    log = np.array([5e9] * 4 + [5e9])
    src = np.array(["a"] * 4 + ["b"])
    placed, _ = place_log_events(log, np.full(5, 1e9), np.full(5, np.nan), src,
                                 np.array([3.0, 1.0, 2.0, 4.0, 1.0]), np.full(5, 2e9))
    # offset 2 s: host clock minus 2 s; order by line_no: 1,2,3,4 -> 1/8, 3/8, 5/8, 7/8 of the second
    assert list(placed[:4] - 3e9) == [0.625e9, 0.125e9, 0.375e9, 0.875e9]
    assert placed[4] == 3.5e9


def test_grid_resample_and_hold() -> None:
    """Window values go to the cell their sample closes; held values expire after max age."""
    grid = make_grid(0, 1_000, 100)
    assert list(grid[:3]) == [100, 200, 300] and grid[-1] == 1_000
    ts = np.array([100, 200, 400])
    v = resample_window(ts, np.array([1.0, 2.0, 3.0]), grid, 100)
    # the cell (200, 300] has no sample: a gap stays a gap
    assert list(v[:2]) == [1.0, 2.0] and np.isnan(v[2]) and v[3] == 3.0 and np.isnan(v[4])
    h = hold_last(np.array([150]), np.array([7.0]), grid, 200)
    assert np.isnan(h[0]) and h[1] == 7.0 and h[2] == 7.0 and np.isnan(h[3])
    assert sample_period_ns([np.arange(0, 10**9, 10**8), np.arange(5, 10**9, 10**8)]) == 10**8


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2_000), st.integers(0, 500)), min_size=1, max_size=20))
def test_coverage_matches_brute_force(intervals: list[tuple[int, int]]) -> None:
    """The union coverage per cell equals a unit-resolution count."""
    s = np.array([a for a, _ in intervals], dtype=float)
    e = s + np.array([d for _, d in intervals], dtype=float)
    grid = make_grid(0, 2_600, 100)
    got = coverage_ratio(s, e, grid, 100)
    covered = np.zeros(2_600, dtype=bool)
    for a, b in zip(s.astype(int), e.astype(int), strict=True):
        covered[a:b] = True
    want = covered.reshape(26, 100).mean(axis=1)
    assert np.allclose(got, want)
    assert count_in_flight(s, e, np.array([-1.0]))[0] == 0


def test_stage_mapping_sources() -> None:
    """meta.topology wins; else SGLang's formula on the engine's pp/tp, across nodes."""
    topo = topology_to_meta(2, 2, 1, single_node_placements("n", 2, 2), "explicit")
    m = stage_mapping(topo, None, None, [("n", i) for i in range(4)])
    assert m.source.startswith("meta.topology") and m.stage_of("n", 2) == 1
    keys = [(h, i) for h in ("a", "b") for i in range(4)]
    m = stage_mapping({}, 4, 2, keys)  # PP4 TP2 over two nodes: a holds stages 0-1, b 2-3
    assert m.source == "engine config + SGLang formula"
    assert [m.stage_of("a", i) for i in range(4)] == [0, 0, 1, 1]
    assert [m.stage_of("b", i) for i in range(4)] == [2, 2, 3, 3]
    assert stage_mapping({}, None, None, keys, log_pp_ranks=8).pp_size == 8


def test_clock_offset_moves_gpu_samples_into_phases(tmp_path: Path) -> None:
    """A GPU host 3 s ahead is corrected by its probes: busy per phase matches the truth, and
    ignoring the probes would blur the phase boundary."""
    levels = [Level("low", 1, 1, [0.1, 0.1], 1, 10), Level("high", 8, 8, [0.9, 0.9], 4, 10)]
    truth = build(tmp_path / "r", SynthRun(levels, pp=2, gpu_offset_ns=3_000_000_000))
    with Store.open(tmp_path / "r") as store:
        a = analyse_run(store, effects=False)
        for pm in a.metrics:
            for stage in pm.stages:
                assert abs((stage.busy_fraction or 0) - truth[pm.label][stage.pp_rank]) < 0.01
        store.sql("DELETE FROM clock_probes")
        blurred = analyse_run(store, effects=False)
    assert abs((blurred.metrics[1].stages[0].busy_fraction or 0) - truth["high"][0]) > 0.1


def test_align_store_reports_placement(tmp_path: Path) -> None:
    """Offline log lines (no receive time) are spread within their second and the run says so."""
    build(tmp_path / "r", SynthRun([Level("C=4", 4, 4, [0.5, 0.5], 2, 5)], pp=2, recv_times=False))
    with Store.open(tmp_path / "r", read_only=True) as store:
        run = align_store(store)
    assert run.log_placement.startswith("spread by order")
    assert any("order within the second" in n for n in run.notes)
    assert run.period_ns == 100_000_000 and run.mapping.pp_size == 2


def test_in_memory_tables_align_as_the_store_reads_them(tmp_path: Path) -> None:
    """The same records aligned from a DuckDB store (Store.read_run) and from RunTables built in
    memory give the same view: grid, GPU and stage arrays, work, markers, engine, notes."""
    spec = SynthRun([Level("C=1", 1, 1, [0.2, 0.1], 1, 4), Level("C=8", 8, 8, [0.9, 0.8], 4, 4, queue=2)],
                    pp=2, gpu_offset_ns=1_500_000_000)
    build(tmp_path / "r", spec)
    with Store.open(tmp_path / "r", read_only=True) as store:
        stored = align_store(store)
    memory = align(synth_tables(spec)[0])
    assert np.array_equal(stored.grid_ns, memory.grid_ns) and stored.gpu_keys == memory.gpu_keys
    for name, values in stored.stage_gpu.items():
        assert np.array_equal(values, memory.stage_gpu[name], equal_nan=True), name
    for name in ("stage_running", "stage_queue", "stage_token_usage", "work_ratio", "inflight",
                 "power_limit_w", "pcie_capacity_bytes_per_s", "engine_running"):
        assert np.array_equal(getattr(stored, name), getattr(memory, name), equal_nan=True), name
    assert stored.markers == memory.markers and stored.engine == memory.engine
    assert (stored.notes, stored.log_placement, stored.work_source) == \
        (memory.notes, memory.log_placement, memory.work_source)
    assert stored.engine.pp_size == 2 and stored.engine.pp_max_micro_batch_size is None


def test_clock_probes_correct_an_in_memory_run() -> None:
    """Aligned from RunTables alone: a GPU host 3 s ahead is corrected by its probes, and the
    same tables without probes blur the phase boundary (no DuckDB file anywhere)."""
    levels = [Level("low", 1, 1, [0.1, 0.1], 1, 10), Level("high", 8, 8, [0.9, 0.9], 4, 10)]
    tables, truth = synth_tables(SynthRun(levels, pp=2, gpu_offset_ns=3_000_000_000))
    corrected = analyse_tables(tables)
    for pm in corrected.metrics:
        for stage in pm.stages:
            assert abs((stage.busy_fraction or 0) - truth[pm.label][stage.pp_rank]) < 0.01
    blurred = analyse_tables(dataclasses.replace(tables, clock_probes=ClockProbeColumns()))
    assert "no clock probes: host clocks assumed equal" in blurred.notes
    assert abs((blurred.metrics[1].stages[0].busy_fraction or 0) - truth["high"][0]) > 0.1


def test_engine_settings_merge_config_lines() -> None:
    """Later configuration lines win, a missing value never overrides one, logged fields merge;
    with no line the engine is the one whose scheduler lines the run holds."""
    first = EngineConfig("n", "log", "sglang", 1, pp_size=4, max_running_requests=64,
                         fields_json='{"schedule_policy": "lpm", "page_size": 1}')
    later = EngineConfig("n", "log", "sglang", 7, pp_size=None, max_running_requests=32,
                         fields_json='{"page_size": 16}')
    merged = EngineSettings.from_records([later, first])
    assert (merged.pp_size, merged.max_running_requests, merged.line_no) == (4, 32, 7)
    assert merged.fields == {"schedule_policy": "lpm", "page_size": 16}
    assert merged.tp_size is None and "tp_size" not in merged.settings()
    unconfigured = EngineSettings.from_records([], engine_of_lines="vllm")
    assert unconfigured.settings() == {"engine": "vllm"} and unconfigured.fields is None


def test_gpu_samples_read_a_range_at_a_time_align_as_read_whole(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A run read from the store a few hundred rows at a time (clock offset and all) gives the
    same stage series, grid and sample periods as the run read whole: memory follows the read,
    not the run."""
    spec = SynthRun([Level("C=1", 1, 1, [0.2, 0.1], 1, 4), Level("C=8", 8, 8, [0.9, 0.8], 4, 4, queue=2)],
                    pp=2, gpu_offset_ns=1_500_000_000)
    build(tmp_path / "r", spec)
    with Store.open(tmp_path / "r", read_only=True) as store:
        whole = align_store(store)
        tables = store.read_run()
        reads = _CountedReads(tables.gpu_samples)
        assert len(reads) > 150
        monkeypatch.setattr(aligned, "GPU_READ_ROWS", 20)
        chunked = align(dataclasses.replace(tables, gpu_samples=reads))
    assert len(reads.ranges) > 5 and all(lo is not None and hi is not None for lo, hi in reads.ranges[1:])
    assert np.array_equal(whole.grid_ns, chunked.grid_ns) and whole.period_ns == chunked.period_ns
    assert not np.isnan(whole.stage_gpu["utilization"]).all()
    assert not np.isnan(whole.stage_gpu["power_w"]).all()
    for name, values in whole.stage_gpu.items():
        assert np.array_equal(values, chunked.stage_gpu[name], equal_nan=True), name
    assert whole.sample_period_ns_by_gpu == chunked.sample_period_ns_by_gpu
    assert np.array_equal(whole.engine_running, chunked.engine_running, equal_nan=True)


def test_held_bytes_counts_log_lines_and_requests() -> None:
    """The guard counts what the analysis holds: a 13.8 M-line log weighs as much as its lines,
    whatever the grid, and 512 GPUs cost nothing beyond their stages."""
    small = aligned.held_bytes(3600, 8, 0, 0)
    assert aligned.held_bytes(3600, 8, 13_800_000, 0) - small > 13_800_000 * 100
    assert aligned.held_bytes(288_000, 8, 0, 0) < aligned.MAX_GRID_BYTES // 4


class _CountedReads:
    """GPU samples that record each range read."""

    def __init__(self, samples: GpuSamples):
        self._samples = samples
        self.keys = samples.keys
        self.ranges: list[tuple[int | None, int | None]] = []

    def __len__(self) -> int:
        return len(self._samples)

    def extents(self) -> GpuExtents:
        return self._samples.extents()

    def between(self, lo_ns: int | None, hi_ns: int | None) -> GpuSampleColumns:
        self.ranges.append((lo_ns, hi_ns))
        return self._samples.between(lo_ns, hi_ns)
