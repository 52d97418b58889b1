"""The report's figures and tables as a reader sees them ([ux]): one time axis for the figures over
time, K and pool on running-vs-load, PCIe on a scale that shows it, lines without the breaks of
interleaved agent rows, the sample period of the agent (not of its rows), a per-stage table
holding only per-stage values."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from analysis_synth import T0, Level, SynthRun, build
from helpers import analyse, cli
from matplotlib.lines import Line2D

from gputrace.analyse import analyse_run
from gputrace.analysis.aligned_run import gpu_metrics_on_grid
from gputrace.analysis.result import Analysis
from gputrace.report.document import STAGE_COLUMNS, phase_stage_table, shown_columns, stage_columns
from gputrace.report.figures import (
    DPI,
    FIGURES,
    TIME_FIGURES,
    build_figure,
    gap_broken,
    time_limits,
)
from gputrace.store import Store

UTIL_PERIOD_NS = 1_000_000_000 // 6  # NVML's own utilization samples on most GPUs
GAP_S = (3.0, 5.0)  # a stretch the agent's ticks did not reach (seconds after T0)


def _agent_like(path: Path) -> Path:
    """The capped synthetic run as a live agent writes it: ticks every 100 ms with power and PCIe
    (no utilization), NVML's utilization samples every 1/6 s between them, and a 2 s gap in the
    ticks."""
    build(path, SynthRun([Level("C=1", 1, 1, [0.125] * 4, 1, 6),
                          Level("C=32", 32, 32, [0.9] * 4, 4, 6, queue=16)], pp=4,
                         engine={"max_running_requests": 64, "pp_max_micro_batch_size": 4}))
    with Store.open(path) as store:
        store.sql("UPDATE gpu_samples SET utilization_ratio = NULL, pcie_tx_bytes_per_s = "
                  "4e6 + 1e6 * gpu_index, pcie_rx_bytes_per_s = 1e6")
        store.sql(f"DELETE FROM gpu_samples WHERE ts_ns > {T0 + int(GAP_S[0] * 1e9)} "
                  f"AND ts_ns < {T0 + int(GAP_S[1] * 1e9)}")
        ts = T0 + 7_000_000 + UTIL_PERIOD_NS * np.arange(1, 12 * 6)
        for gpu in range(4):
            store.append_columns("gpu_samples", {"host": "node0", "gpu_index": np.full(len(ts), gpu),
                                                 "ts_ns": ts, "utilization_ratio": np.full(len(ts), 0.4)})
    return path


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _agent_like(tmp_path_factory.mktemp("agent-like") / "run")


@pytest.fixture(scope="module")
def analysis(agent_run: Path) -> Analysis:
    return analyse(agent_run)


def _png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", png[16:24])
    return int(w), int(h)


def _series_lines(fig_axes: object) -> list[Line2D]:
    """The data lines of a time figure (not the phase boundaries, which have two points)."""
    return [ln for ln in fig_axes.lines if len(ln.get_xdata()) > 2]  # type: ignore[attr-defined]


def test_time_figures_share_one_x_range_and_axes_position(analysis: Analysis) -> None:
    """Heatmap, power and PCIe: the same x limits and the same axes left/right in pixels, so they
    line up one above the other; every figure at least 1,200 px wide."""
    boxes, limits = [], []
    for name in TIME_FIGURES:
        fig = build_figure(name, analysis)
        ax = fig.axes[0]
        width_px = fig.get_figwidth() * DPI
        box = ax.get_position()
        boxes.append((round(box.x0 * width_px, 3), round(box.x1 * width_px, 3)))
        limits.append(ax.get_xlim())
    assert len(set(boxes)) == 1, boxes
    assert all(np.allclose(lim, time_limits(analysis)) for lim in limits), limits
    for name, (_, render) in FIGURES.items():
        w, _ = _png_size(render(analysis))
        assert w >= 1200, (name, w)


def test_running_vs_load_has_k_and_pool_lines_and_distinct_stage_markers(analysis: Analysis) -> None:
    """K (--pp-max-micro-batch-size 4 here) and the pool (64) as horizontal lines named with their
    values; each stage's markers differ in shape and size, so coinciding stages stay visible."""
    ax = build_figure("running_vs_load", analysis).axes[0]
    by_label = {ln.get_label(): ln for ln in ax.lines}
    k_line = next(ln for label, ln in by_label.items() if label.startswith("K = 4"))
    pool_line = next(ln for label, ln in by_label.items() if label.startswith("pool = 64"))
    assert list(k_line.get_ydata()) == [4, 4] and list(pool_line.get_ydata()) == [64, 64]
    stages = [by_label[f"stage {s}"] for s in range(4)]
    assert len({(ln.get_marker(), ln.get_markersize()) for ln in stages}) == 4
    # the engine's total beside the stages' micro-batches: above a stage's size once several run
    total = by_label["engine running (all micro-batches)"]
    sizes = [float(np.nanmax(ln.get_ydata())) for ln in stages]
    assert float(np.nanmax(total.get_ydata())) > max(sizes), (list(total.get_ydata()), sizes)


def test_pcie_is_plotted_in_bytes_per_second_on_a_scale_that_shows_it(analysis: Analysis) -> None:
    """The PCIe axis tops out within a factor 2 of the data (4-7 MB/s here), in MB/s, and the
    legend names the stages and the directions."""
    ax = build_figure("pcie", analysis).axes[0]
    peak = max(float(np.nanmax(ln.get_ydata())) for ln in _series_lines(ax))
    assert 6.5 <= peak <= 7.5 and ax.get_ylim()[1] <= 2 * peak
    assert "MB/s" in ax.get_ylabel()
    names = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"stage 0", "stage 3"} <= set(names) and any("TX" in n for n in names) \
        and any("RX" in n for n in names)


def test_lines_drop_empty_cells_and_break_only_at_real_gaps(analysis: Analysis) -> None:
    """Power per stage: the cells between ticks (utilization rows interleave) do not break the
    line; the 2 s without ticks does, once."""
    ax = build_figure("power", analysis).axes[0]
    for line in _series_lines(ax):
        x = np.asarray(line.get_xdata(), dtype=float)
        assert np.isnan(x).sum() == 1
        gap_at = int(np.flatnonzero(np.isnan(x))[0])
        assert x[gap_at - 1] < GAP_S[0] + 0.5 and x[gap_at + 1] > GAP_S[1] - 0.5


def test_power_share_is_drawn_on_the_whole_scale(analysis: Analysis) -> None:
    """Power as a share of the limit is drawn from 0 to 1 whatever the run's peak, so two reports'
    figures read alike (auto-scaled, one read 0-1 and the next 0-0.4)."""
    ax = build_figure("power", analysis).axes[0]
    assert ax.get_ylabel() == "power / limit"
    assert ax.get_ylim() == (0.0, 1.0)


def test_gap_broken_keeps_short_holes_and_marks_long_ones() -> None:
    """Every other cell empty: one unbroken line; a hole longer than the limit: one NaN."""
    t = np.arange(40) * 0.06
    v = np.where(np.arange(40) % 2 == 0, 1.0, np.nan)
    v[20:30] = np.nan
    tx, vx = gap_broken(t, v, 0.4)
    assert np.isnan(vx).sum() == 1 and np.isnan(tx).sum() == 1 and (~np.isnan(vx)).sum() == 15


def test_sample_period_is_the_agents_not_of_its_interleaved_rows(analysis: Analysis, agent_run: Path,
                                                                tmp_path: Path) -> None:
    """Ticks every 100 ms and utilization rows every 1/6 s: the summary says 100 ms (the rows
    together are spaced 30-70 ms), and the report's summary line says so."""
    s = analysis.summary()
    assert abs(s["sample_period_ms"] - 100) < 1 and s["grid_period_ms"] < 90
    res = cli(["report", str(agent_run), "--out", str(tmp_path), "--format", "md"])
    assert res.exit_code == 0, res.output
    assert "sample period 100 ms (aligned on a" in (tmp_path / "report.md").read_text()


def test_interleaved_utilization_samples_all_reach_the_grid(analysis: Analysis, agent_run: Path) -> None:
    """Every utilization sample lands in a cell; looked up over all rows, a cell took the tick
    that came first in it and dropped the utilization sample."""
    with Store.open(agent_run, read_only=True) as store:
        (n_util,) = store.sql("SELECT count(*) FROM gpu_samples WHERE gpu_index = 0 AND "
                              "utilization_ratio IS NOT NULL")[0]
        (n_ticks,) = store.sql("SELECT count(*) FROM gpu_samples WHERE gpu_index = 0 AND "
                               "power_w IS NOT NULL")[0]
        gpu = gpu_metrics_on_grid(store.read_run(), analysis.run)
    gpu0 = analysis.run.gpu_keys.index(("node0", 0))
    assert int((~np.isnan(gpu["utilization_ratio"][gpu0])).sum()) == n_util
    assert int((~np.isnan(gpu["power_w"][gpu0])).sum()) == n_ticks


def test_phase_by_stage_table_holds_only_per_stage_values(agent_run: Path, tmp_path: Path) -> None:
    """The per-stage table in report.md and report.html has no per-phase column (load,
    throughput, allowed busy: in the phases table), names each phase once and says a busy signal
    common to every stage once; findings.json's table keeps every value per stage."""
    res = cli(["report", str(agent_run), "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    md = (tmp_path / "report.md").read_text()
    stage = md[md.index("<summary>Phase by stage</summary>"):md.index("<summary>Stage mapping</summary>")]
    header = stage.splitlines()[2]
    doc = json.loads((tmp_path / "findings.json").read_text())
    signals = {row["busy_signal"] for row in doc["table"]}
    if len(signals) == 1:  # one signal for every stage: said once under the table, not per row
        assert header.startswith("| phase | stage | busy | bubble | #running mean | #running max |")
        assert f"Busy and bubble from {signals.pop()} on every stage." in stage
    else:  # [busy]: the signal is chosen per stage and phase, so each row names its own
        assert header.startswith(
            "| phase | stage | busy | bubble | busy from | #running mean | #running max |")
    for per_phase in ("offered", "tok/s", "allowed busy", "C |"):
        assert per_phase not in header, per_phase
    assert stage.count("| C=32 |") == 1 and stage.count("| C=1 |") == 1
    phases = md[md.index("## Per phase"):md.index("## Findings")]
    assert "allowed busy" in phases.splitlines()[2]
    html = (tmp_path / "report.html").read_text()
    stage_html = html[html.index("<summary>Phase by stage</summary>"):
                      html.index("<summary>Stage mapping</summary>")]
    assert "<th>offered</th>" not in stage_html and "<th>tok/s</th>" not in stage_html
    assert stage_html.count("<td>C=32</td>") == 1
    assert {"offered_load", "throughput_tok_s", "allowed_busy_fraction", "utilization_p50",
            "token_usage_max", "pcie_tx_bytes_per_s_mean", "busy_signal"} <= set(doc["table"][0])


def test_stage_columns_without_any_value_are_left_out_and_named() -> None:
    """A run without GPU samples: power, PCIe and throttling columns go, and are named."""
    rows = [{"phase": "C=1", "pp_rank": s, "microbatch_size_mean": 1.0, "queue_req_mean": 0.0}
            for s in range(2)]
    shown, missing = shown_columns(STAGE_COLUMNS, rows)
    assert [k for k, _ in shown] == ["phase", "pp_rank", "microbatch_size_mean", "queue_req_mean"]
    assert {"busy", "power W", "PCIe/link p95", "throttled"} <= set(missing)


def test_busy_from_is_a_column_only_where_stages_differ_and_absent_without_busy() -> None:
    """Stages whose busy came from different signals keep the column; one signal on every stage is
    said once; stages without a busy figure claim no signal (a run without GPU samples said
    'utilization.gpu (NVML)' on every row)."""
    def rows(*signals: str | None) -> list[dict[str, object]]:
        return [{"phase": "C=1", "pp_rank": s, "busy_fraction": None if sig is None else 0.5,
                 "busy_signal": sig} for s, sig in enumerate(signals)]
    shown, _, said = stage_columns(rows("SM activity (GPM)", "utilization.gpu (NVML)"))
    assert ("busy_signal", "busy from") in shown and said is None
    shown, _, said = stage_columns(rows("SM activity (GPM)", "SM activity (GPM)"))
    assert ("busy_signal", "busy from") not in shown and said == "SM activity (GPM)"
    shown, missing, said = stage_columns(rows(None, None))
    assert said is None and "busy from" in missing


def test_a_stage_without_a_busy_figure_names_no_busy_signal(tmp_path: Path) -> None:
    """findings.json's table: busy_signal is null where busy_fraction is (no GPU samples)."""
    run = tmp_path / "run"
    build(run, SynthRun([Level("C=4", 4, 4, [0.5] * 2, 2, 4)], pp=2))
    with Store.open(run) as store:
        store.sql("DELETE FROM gpu_samples")
        table = phase_stage_table(analyse_run(store, effects=False))
    assert table and all(row["busy_fraction"] is None and row["busy_signal"] is None for row in table)
