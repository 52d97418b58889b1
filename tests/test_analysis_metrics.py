"""Phases and per-stage metrics on runs built from records in memory (RunTables, no DuckDB file)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from analysis_synth import Level, SynthRun, synth_tables

from gputrace.analysis.phases import Phase, detect_phases, phases_from_markers, phases_from_request_labels
from gputrace.analysis.result import analyse_tables
from gputrace.model import Marker


def test_phases_from_markers_end_at_next_phase_or_end() -> None:
    """A phase marker lasts to the next phase/end marker; notes end nothing."""
    marks = [Marker("h", 0, "C=1", "phase", 1), Marker("h", 5, "note", "note"),
             Marker("h", 10, "C=8", "phase", 8), Marker("h", 20, "end", "end")]
    got = phases_from_markers(marks, 99)
    assert [(p.label, p.start_ns, p.end_ns, p.target_concurrency) for p in got] == \
        [("C=1", 0, 10, 1), ("C=8", 10, 20, 8)]
    assert phases_from_markers(marks[:3], 99)[-1].end_ns == 99


def test_phases_from_request_labels_cut_at_next_level() -> None:
    """Request labels give phases; a level's tail is cut where the next level starts."""
    got = phases_from_request_labels(np.array([0.0, 5, 10, 12]), np.array([8.0, 11, 15, 20]),
                                     np.array(["C=2", "C=2", "C=4", "C=4"], dtype=object))
    assert [(p.label, p.start_ns, p.end_ns, p.target_concurrency) for p in got] == \
        [("C=2", 0, 10, 2), ("C=4", 10, 20, 4)]


def test_detect_phases_from_load_steps() -> None:
    """Steady levels of in-flight requests become phases; idle and short blips are dropped."""
    period = 100_000_000
    load = np.concatenate([np.zeros(50), np.full(200, 4.0), np.full(20, 9.0), np.full(300, 32.0),
                           np.zeros(50)])
    load[300] = 0  # one noisy sample does not split a level
    grid = period * np.arange(1, len(load) + 1)
    got = detect_phases(grid, load, period, "test")
    assert [p.target_concurrency for p in got] == [4, 32]
    assert abs(got[0].start_ns - 5e9) <= 1e9 and abs(got[1].duration_s - 30) <= 1.5


def test_busy_and_bubble_fractions_match_truth(tmp_path: Path) -> None:
    """Busy equals the true mean utilization; bubble = work share minus busy, per stage."""
    levels = [Level("C=4", 4, 4, [0.2, 0.3, 0.25, 0.2], 1, 12),
              Level("C=16", 16, 16, [0.5, 0.55, 0.6, 0.5], 4, 12)]
    tables, truth = synth_tables(SynthRun(levels, pp=4))
    a = analyse_tables(tables)
    assert [p.label for p in a.phases] == ["C=4", "C=16"] and a.phases[0].source == "markers"
    for pm in a.metrics:
        for s in pm.stages:
            assert abs((s.busy_fraction or 0) - truth[pm.label][s.pp_rank]) < 0.005
            assert abs((s.bubble_fraction or 0) - (pm.work_share - truth[pm.label][s.pp_rank])) < 0.01
        assert pm.stages[0].microbatch_size_mean == levels[a.metrics.index(pm)].microbatch
        assert pm.stages[0].power_limit_share_mean is not None
    c16 = a.metrics[1]
    # 16 closed-loop lanes of 2 s requests x 40 tokens over 12 s.
    assert c16.client_throughput_tok_s is not None and abs(c16.client_throughput_tok_s - 16 * 6 * 40 / 12) < 1
    # Each stage logged 4 decode lines a second, each one step of its micro-batch of 4
    # (--decode-log-interval 1): the engine's tokens are counted from the lines, 4 x 4 a second,
    # whatever throughput the lines print (the old integration of that figure read real SGLang
    # logs 8-56 % high: lines are spread within their one-second stamps).
    assert c16.engine_gen_throughput_tok_s is not None
    assert abs(c16.engine_gen_throughput_tok_s - 4 * 4) < 0.5
    assert c16.throughput_tok_s == c16.engine_gen_throughput_tok_s
    assert c16.work_share > 0.99 and c16.inflight_mean is not None and c16.inflight_mean > 15.5
    assert c16.ttft_s_p50 is not None and abs(c16.ttft_s_p50 - 0.2) < 1e-6
    assert c16.itl_s_mean is not None and abs(c16.itl_s_mean - 1.8 / 39) < 1e-6
    assert c16.allowed_busy_fraction is not None and 0.8 < c16.allowed_busy_fraction <= 1.0


def test_phases_detected_without_markers(tmp_path: Path) -> None:
    """With no markers and no labels, levels are detected from the client's in-flight requests."""
    levels = [Level("", 2, 2, [0.2, 0.2], 1, 15), Level("", 12, 12, [0.6, 0.6], 6, 15)]
    tables, _ = synth_tables(SynthRun(levels, pp=2, markers=False))
    unlabelled = dataclasses.replace(tables.requests, phase=np.full(len(tables.requests), "", dtype=object))
    a = analyse_tables(dataclasses.replace(tables, requests=unlabelled))
    assert [p.target_concurrency for p in a.phases] == [2, 12]
    assert a.phases[0].source == "detected from client requests in flight"
    assert isinstance(a.phases[0], Phase)


def test_phases_detected_from_the_engines_gauges_name_them() -> None:
    """A Prometheus import without the client's gauge takes the load from the engine's running +
    waiting gauges: the phases detected in it, and the report's summary, name the engine, not the
    client; a client's gauge keeps its name ([busy] #27)."""
    from analysis_synth import requests_to_gauge

    from gputrace.model import ENGINE_LOAD_SOURCE

    levels = [Level("", 2, 2, [0.2, 0.2], 1, 15), Level("", 12, 12, [0.6, 0.6], 6, 15)]
    tables, _ = synth_tables(SynthRun(levels, pp=2, markers=False))
    engines = analyse_tables(requests_to_gauge(tables, ENGINE_LOAD_SOURCE))
    assert [p.target_concurrency for p in engines.phases] == [2, 12]
    assert all("the engine's running + waiting" in p.source for p in engines.phases)
    assert "client" not in str(engines.summary()["phase_source"])
    clients = analyse_tables(requests_to_gauge(tables))
    assert clients.phases[0].source == "detected from client requests in flight"


def test_busy_and_bubble_live_api() -> None:
    """The reusable estimate: per stage busy = mean utilization, bubble = mean max(0, work - util),
    NaN samples left out, weights respected."""
    from gputrace.analysis.phase_figures import busy_and_bubble

    util = np.array([[0.5, 0.5, 1.0, np.nan], [0.0, 0.2, 0.2, 0.2]])
    work = np.array([1.0, 1.0, 1.0, 0.0])
    busy, bubble = busy_and_bubble(util, work)
    assert np.allclose(busy, [2 / 3, 0.15]) and np.allclose(bubble, [1 / 3, (1 + 0.8 + 0.8) / 4])
    busy_w, _ = busy_and_bubble(util, work, weights=np.array([1.0, 1.0, 0.0, 1.0]))
    assert np.allclose(busy_w, [0.5, 0.4 / 3])


def test_a_stats_window_across_a_phase_edge_is_split_by_the_rates_either_side() -> None:
    """vLLM's 10 s windows: one straddling the edge between a 300 tok/s and a 700 tok/s phase (4 s
    in the first) gives the first 4 x 300 of its 4 x 300 + 6 x 700 tokens, not 40 %."""
    import numpy as np
    import pytest

    from gputrace.analysis.phase_figures import engine_tokens

    s = 1_000_000_000
    t = np.array([10, 20, 30, 40, 50, 60], dtype=np.int64) * s
    rate = np.array([300, 300, 300, (4 * 300 + 6 * 700) / 10, 700, 700], dtype=float)
    grid = np.arange(0, 61 * s, s // 10)
    work = np.ones(len(grid))
    edge = 34 * s
    first = engine_tokens(t, rate, np.ones(len(t), bool), 0, edge, grid, work)
    second = engine_tokens(t, rate, np.ones(len(t), bool), edge, 60 * s, grid, work)
    assert first == pytest.approx(34 * 300, rel=0.01)
    assert second == pytest.approx(26 * 700, rel=0.01)
    # without the load on a grid the time either side is taken as busy: the same split here
    assert engine_tokens(t, rate, np.ones(len(t), bool), 0, edge) == pytest.approx(first)
