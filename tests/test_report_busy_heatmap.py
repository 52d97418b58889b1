"""The report's heatmap shows each stage's busy share by the signal the analysis took for it (the
busy-signal ranking), not raw NVML utilization: a stage spinning in NCCL reads 95 % in
utilization.gpu but is drawn at the schedule's 25 %."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from analysis_synth import Level, SynthRun, synth_tables

from gputrace.analysis.busy_cells import busy_over_time
from gputrace.analysis.phase_figures import BUSY_SIGNALS, cell_weights
from gputrace.analysis.result import Analysis, analyse_tables
from gputrace.report.figures import build_figure, heatmap_columns, time_limits

SM_STAGE = 3  # the one stage whose GPU gives SM activity (GPM)
SM_ACTIVE = 0.6


@pytest.fixture(scope="module")
def analysis() -> Analysis:
    """PP4: at C=4 one micro-batch of 4 is in flight (the schedule allows 25 %) while utilization
    reads 95 % (NCCL's spin); at C=16 four are, and utilization's 90 % agrees; stage 3's GPU has
    SM activity, which ranks above both."""
    spec = SynthRun([Level("C=4", 4, 4, [0.95] * 4, 4, 8), Level("C=16", 16, 16, [0.9] * 4, 4, 8)], pp=4,
                    engine={"max_running_requests": 64, "pp_max_micro_batch_size": 4})
    tables, _ = synth_tables(spec)
    gpu = tables.gpu_samples
    sm = np.where(gpu.k == SM_STAGE, SM_ACTIVE, np.nan)
    with_sm = dataclasses.replace(gpu, sm_active_ratio=sm)
    return analyse_tables(dataclasses.replace(tables, gpu_samples=with_sm))


def test_busy_over_time_averages_to_the_analysis_busy_figure_per_phase_and_stage(analysis: Analysis) -> None:
    """Over each phase's cells (the analysis' weights), each stage's row averages to its busy figure,
    whichever signal gave it: the schedule at C=4, utilization at C=16, SM activity on stage 3."""
    over_time = busy_over_time(analysis.run, analysis.series, analysis.metrics)
    signals = {(pm.label, st.pp_rank): st.busy_signal for pm in analysis.metrics for st in pm.stages}
    assert signals[("C=4", 0)] == BUSY_SIGNALS["schedule"]
    assert signals[("C=16", 0)] == BUSY_SIGNALS["utilization"]
    assert signals[("C=4", SM_STAGE)] == signals[("C=16", SM_STAGE)] == BUSY_SIGNALS["sm_active"]
    for pm in analysis.metrics:
        cells, w = cell_weights(analysis.run.grid_ns, analysis.run.period_ns, pm.start_ns, pm.end_ns)
        for st in pm.stages:
            row = over_time.busy[st.pp_rank, cells]
            held = ~np.isnan(row) & (w > 0)
            assert st.busy_fraction is not None
            assert np.sum(row[held] * w[held]) / np.sum(w[held]) == pytest.approx(st.busy_fraction, abs=1e-9)
    at_c4 = next(pm for pm in analysis.metrics if pm.label == "C=4")
    assert at_c4.stages[0].utilization_mean == pytest.approx(0.95, abs=0.01)
    assert at_c4.stages[0].busy_fraction == pytest.approx(0.25, abs=0.01)
    assert over_time.signals[0] == (BUSY_SIGNALS["schedule"], BUSY_SIGNALS["utilization"])
    assert over_time.signals[SM_STAGE] == (BUSY_SIGNALS["sm_active"],)


def test_heatmap_draws_the_busy_figures_and_names_their_signals(analysis: Analysis) -> None:
    """The image's cells are the busy rows in the heatmap's columns; each phase's columns average
    to the stage's busy figure (not utilization's 95 % at C=4); the title names each stage's signal."""
    fig = build_figure("busy_heatmap", analysis)
    ax = fig.axes[0]
    drawn = np.ma.filled(ax.images[0].get_array().astype(float), np.nan)
    over_time = busy_over_time(analysis.run, analysis.series, analysis.metrics)
    t_all = np.asarray(analysis.run.grid_ns - analysis.run.grid_ns[0], dtype=np.float64) / 1e9
    columns, t = heatmap_columns(over_time.busy, t_all)
    np.testing.assert_allclose(drawn, columns, equal_nan=True)
    assert ax.get_xlim() == pytest.approx(time_limits(analysis))
    t0 = analysis.run.grid_ns[0]
    for pm in analysis.metrics:
        # columns well inside the phase: the edges' columns mix two phases
        inside = (t > (pm.start_ns - t0) / 1e9 + 1.0) & (t < (pm.end_ns - t0) / 1e9 - 1.0)
        assert inside.sum() >= 5
        for st in pm.stages:
            assert np.nanmean(drawn[st.pp_rank, inside]) == pytest.approx(st.busy_fraction, abs=0.03), \
                (pm.label, st.pp_rank)
    title = ax.get_title()
    assert f"stages 0-2: {BUSY_SIGNALS['schedule']} then {BUSY_SIGNALS['utilization']}" in title
    assert f"stage {SM_STAGE}: {BUSY_SIGNALS['sm_active']}" in title
    assert "utilization" not in fig.axes[1].get_ylabel()  # the colour bar: busy share
