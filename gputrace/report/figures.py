"""The report's figures (matplotlib, Agg): busy heatmap (by the analysis' signal), running
requests vs offered load, bubble fraction per stage and phase, power, PCIe. The three figures over
time share one time axis: the same x range and the same axes position in figures of the same
width, so they line up when shown one above the other."""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # Agg is chosen above, before pyplot loads
import numpy as np
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.transforms import blended_transform_factory

from gputrace.analysis.busy_cells import busy_over_time
from gputrace.analysis.diagnose import default_microbatch_cap
from gputrace.analysis.result import Analysis
from gputrace.report.throughput_chart import phase_throughput

MAX_COLUMNS = 1200
"""Time series are averaged down to at most this many columns: a figure has no more pixels."""

HEATMAP_COLUMNS = 300
"""The heatmap's columns at most: each one a readable block, not a pixel-wide stripe."""

WIDTH_IN, DPI = 13.0, 100
"""Every figure 1,300 px wide: legible at the report's width without zooming."""

# the time figures' axes, in inches from the figure's edges: the same in each so their x axes line
# up; the right margin holds the heatmap's colour bar and the line plots' legends
LEFT_IN, RIGHT_IN, BOTTOM_IN, TOP_IN = 1.0, 2.3, 0.65, 0.6

GAP_PERIODS = 4
"""A line is broken only where its samples stop for longer than this many sample periods (and
1.5 of its columns): shorter holes are cells between samples, not a gap in the capture."""

STYLE: dict[Any, Any] = {"font.size": 11, "axes.titlesize": 13, "axes.labelsize": 11, "legend.fontsize": 9,
         "xtick.labelsize": 10, "ytick.labelsize": 10}

MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*")
LINESTYLES = ("-", "--", "-.", ":")


def _downsample(values: np.ndarray, t_s: np.ndarray, max_columns: int = MAX_COLUMNS,
                min_step: int = 1) -> tuple[np.ndarray, np.ndarray]:
    n = values.shape[-1]
    step = max(int(np.ceil(n / max_columns)), min_step, 1)
    if step == 1 or n == 0:
        return values, t_s
    pad = -n % step  # the last column takes the cells left over, so the figure reaches the end
    if pad:
        cell_s = float(t_s[-1] - t_s[-2]) if n > 1 else 0.0
        values = np.concatenate([values, np.full((*values.shape[:-1], pad), np.nan)], axis=-1)
        t_s = np.concatenate([t_s, t_s[-1] + cell_s * np.arange(1, pad + 1)])
    m = (n + pad) // step
    v = values.reshape(*values.shape[:-1], m, step)
    with warnings.catch_warnings():  # an all-NaN column stays NaN: no sample there
        warnings.simplefilter("ignore", RuntimeWarning)
        out = np.nanmean(v, axis=-1)
    return np.asarray(out), t_s.reshape(m, step).mean(axis=1)


def figure_png(fig: Figure) -> bytes:
    """The figure as PNG bytes, at its own size (no tight crop: that would move the axes)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    plt.close(fig)
    return buf.getvalue()


@contextmanager
def report_style() -> Iterator[None]:
    """The report's fonts, for every figure it draws (and the dashboard's panels)."""
    with plt.rc_context(STYLE):
        yield


def _time_axis(a: Analysis) -> np.ndarray:
    return np.asarray(a.run.grid_ns - a.run.grid_ns[0], dtype=np.float64) / 1e9


def time_limits(a: Analysis) -> tuple[float, float]:
    """The x range of every figure over time: the grid's first cell's start to its last cell's end."""
    t = _time_axis(a)
    return -a.run.period_ns / 1e9, float(t[-1]) if len(t) else 1.0


def _time_figure(height_in: float, top_in: float = TOP_IN) -> tuple[Figure, Axes]:
    """A figure with the time figures' axes position across (``top_in``: room for its title)."""
    fig = plt.figure(figsize=(WIDTH_IN, height_in))
    ax = fig.add_axes((LEFT_IN / WIDTH_IN, BOTTOM_IN / height_in,
                       1 - (LEFT_IN + RIGHT_IN) / WIDTH_IN, 1 - (BOTTOM_IN + top_in) / height_in))
    return fig, ax


def _phase_lines(ax: Axes, a: Analysis) -> None:
    """A dashed line at each phase's start, its label just above the axes."""
    t0 = a.run.grid_ns[0]
    above = blended_transform_factory(ax.transData, ax.transAxes)
    for ph in a.phases:
        x = (ph.start_ns - t0) / 1e9
        ax.axvline(x, color="black", lw=0.8, ls="--")
        ax.text(x, 1.01, f" {ph.label}", transform=above, va="bottom", ha="left", fontsize=9,
                clip_on=False)


def _no_data(ax: Axes, text: str) -> None:
    """Say why the axes are empty, with no value scale (it would be made up)."""
    ax.set_yticks([])
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=12,
            bbox={"facecolor": "white", "edgecolor": "#999", "boxstyle": "round,pad=0.4"}, zorder=5)


def _finish_time_axes(ax: Axes, a: Analysis, title: str) -> None:
    ax.set_xlim(*time_limits(a))
    ax.set_xlabel("time since start (s)")
    _phase_lines(ax, a)
    ax.set_title(title, pad=18)


def _stage_colors(pp: int) -> list[tuple[float, float, float, float]]:
    cmap = plt.get_cmap("tab10" if pp <= 10 else "tab20")
    return [cmap(s % cmap.N) for s in range(pp)]


def _legend_beside(ax: Axes, handles: list[Line2D] | None = None, rows: int = 14) -> None:
    """The legend in the right margin, so it hides no data."""
    n = len(handles) if handles is not None else len(ax.get_legend_handles_labels()[0])
    kw = {"handles": handles} if handles is not None else {}
    ax.legend(**kw, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0,
              ncol=max(1, -(-n // rows)), frameon=False)


def sample_columns(values: np.ndarray, t_s: np.ndarray, max_columns: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows x columns, column times): at most ``max_columns`` columns, each the mean of at least two
    of the samples' periods. Those (NVML's utilization: 1/6 s on most GPUs; the agent's ticks) can
    be longer than the grid's cells, which leaves cells without a sample; a column of such cells
    alone would show nothing, and single samples alternate with the steps each window caught."""
    filled = np.flatnonzero(~np.isnan(values).all(axis=0)) if values.size else np.zeros(0, dtype=np.int64)
    gap = int(np.median(np.diff(filled))) if len(filled) > 1 else 1
    return _downsample(values, t_s, max_columns, min_step=2 * gap)


def heatmap_columns(values: np.ndarray, t_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The heatmap's columns (see sample_columns): at most HEATMAP_COLUMNS."""
    return sample_columns(values, t_s, HEATMAP_COLUMNS)


def gap_broken(t_s: np.ndarray, values: np.ndarray, max_gap_s: float) -> tuple[np.ndarray, np.ndarray]:
    """One series as a line: its cells without a sample dropped (left in, they break the line at
    every other cell where samples interleave), a NaN put back only where the samples stop for
    longer than ``max_gap_s``, so real gaps still show."""
    held = np.isfinite(values)
    t, v = t_s[held], values[held]
    breaks = np.flatnonzero(np.diff(t) > max_gap_s) + 1
    return np.insert(t, breaks, np.nan), np.insert(v, breaks, np.nan)


def _stage_ranges(stages: list[int]) -> str:
    """[0, 1, 2, 5] -> 'stages 0-2, 5'."""
    parts: list[str] = []
    for s in stages:
        if parts and s == int(parts[-1].split("-")[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{s}"
        else:
            parts.append(str(s))
    return ("stage " if len(stages) == 1 else "stages ") + ", ".join(parts)


def busy_sources(signals: tuple[tuple[str, ...], ...]) -> str:
    """Which signal each stage's cells came from, stages with the same grouped: 'SM activity (GPM)'
    when every stage has the one, else 'stages 0-6: ...; stage 7: ...'."""
    groups: dict[str, list[int]] = {}
    for s, used in enumerate(signals):
        groups.setdefault(" then ".join(used) or "no figure", []).append(s)
    if len(groups) == 1:
        return next(iter(groups))
    return "; ".join(f"{_stage_ranges(stages)}: {text}" for text, stages in groups.items())


def busy_heatmap(a: Analysis) -> Figure:
    """Per-stage busy share over time by the signal the analysis took per phase and stage (SM
    activity, an engine timer, the schedule, or utilization where the schedule agrees), with phase
    boundaries; the signals named in the title."""
    pp = max(a.run.pp_size, 1)
    fig, ax = _time_figure(0.32 * pp + BOTTOM_IN + TOP_IN + 1.3, top_in=TOP_IN + 0.3)
    over_time = busy_over_time(a.run, a.series, a.metrics)
    busy, t = heatmap_columns(over_time.busy, _time_axis(a))
    cmap = plt.get_cmap("viridis").with_extremes(bad="lightgray")  # no figure: gray, not idle
    im: ScalarMappable
    if len(t) and not np.isnan(busy).all():
        half = (float(t[1] - t[0]) if len(t) > 1 else a.run.period_ns / 1e9) / 2
        extent = (float(t[0]) - half, float(t[-1]) + half, pp - 0.5, -0.5)
        im = ax.imshow(np.ma.masked_invalid(busy), aspect="auto", cmap=cmap, vmin=0, vmax=1,
                       extent=extent, interpolation="nearest")
    else:
        ax.set_ylim(pp - 0.5, -0.5)
        im = ScalarMappable(norm=Normalize(0, 1), cmap=cmap)
    pos = ax.get_position()
    cax = fig.add_axes((pos.x1 + 0.15 / WIDTH_IN, pos.y0, 0.22 / WIDTH_IN, pos.height))
    fig.colorbar(im, cax=cax, label="busy share")
    ax.set_ylabel("pp stage")
    ax.set_yticks(range(pp))
    if np.isnan(busy).all():
        _no_data(ax, "no busy figure in the run: it needs GPU samples or the engine's timers")
    _finish_time_axes(ax, a, "Busy share per pipeline stage (gray: no figure)\nbusy from: "
                      + busy_sources(over_time.signals))
    return fig


def _reference_lines(ax: Axes, a: Analysis) -> None:
    """K (SGLang's micro-batch cap) and the pool (max_running_requests) as horizontal lines."""
    engine = a.run.engine
    if engine.engine_spec.microbatch_slots:
        k, k_from = default_microbatch_cap(engine, max(a.run.pp_size, 1))
        if k is not None:
            ax.axhline(k, color="#c33", lw=1.6, ls="-.",
                       label=f"K = {k}: micro-batch cap\n({k_from.split(' = ')[0]})")
            ax.annotate(f"K = {k}", (0.005, k), xycoords=("axes fraction", "data"), va="bottom",
                        color="#c33", fontsize=10)
    pool = engine.admission_limit
    pool_name = engine.engine_spec.setting("max_running_requests")  # vLLM's max_num_seqs
    if pool:
        ax.axhline(int(pool), color="#555", lw=1.6, ls=(0, (6, 3)),
                   label=f"pool = {int(pool)}: request pool\n({pool_name})")
        ax.annotate(f"pool = {int(pool)}", (0.005, int(pool)), xycoords=("axes fraction", "data"),
                    va="bottom", color="#555", fontsize=10)


def running_vs_load(a: Analysis) -> Figure:
    """Micro-batch size (#running-req) per stage against the offered load of each phase, with the
    cap K and the request pool: where the stages' lines meet K, the cap binds."""
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 5.5))
    xs = [pm.inflight_mean if pm.inflight_mean is not None else (pm.target_concurrency or 0)
          for pm in a.metrics]
    order = np.argsort(xs)
    x = np.array(xs, dtype=float)[order]
    pp = a.run.pp_size
    colors = _stage_colors(pp)
    for s in range(pp):
        y = np.array([v if (v := a.metrics[i].stages[s].microbatch_size_mean) is not None else np.nan
                      for i in order], dtype=float)
        # stages often coincide: hollow markers shrinking with the stage stay visible one inside
        # another, and line styles differ where the lines lie on each other
        ax.plot(x, y, marker=MARKERS[s % len(MARKERS)], markersize=5 + 9 * (pp - 1 - s) / max(pp - 1, 1),
                markerfacecolor="none", markeredgewidth=1.4, color=colors[s],
                ls=LINESTYLES[s % len(LINESTYLES)], lw=1.3, alpha=0.85, label=f"stage {s}")
    if len(x):
        ax.plot(x, x, color="gray", ls=":", lw=1.2, label="offered load (y = x)")
    total = _engine_running_by_phase(a)
    if total is not None and not np.isnan(total[order]).all():
        # the engine's running total beside the stages' micro-batches: a stage's "8" at a load of 32
        # is one of 4 micro-batches, and a reader looked for the other 24
        ax.plot(x, total[order], color="black", lw=2.2, marker="s", markersize=6,
                label="engine running (all micro-batches)")
    _reference_lines(ax, a)
    ax.set_xlabel("requests in flight (offered load)")
    ax.set_ylabel("running requests: per stage (micro-batch), engine total")
    ax.set_ylim(bottom=0)
    _legend_beside(ax)
    ax.set_title("Running requests (per stage and the engine's total) vs offered load")
    fig.subplots_adjust(left=LEFT_IN / WIDTH_IN, right=1 - 3.6 / WIDTH_IN)
    return fig


def _engine_running_by_phase(a: Analysis) -> np.ndarray | None:
    """Per phase, the requests the engine ran in all its micro-batches as the verdict counts them:
    the micro-batches in flight times the stages' mean micro-batch."""
    out = []
    for pm in a.metrics:
        sizes = [st.microbatch_size_mean for st in pm.stages if st.microbatch_size_mean]
        mbs = pm.microbatches_in_flight
        out.append(mbs * float(np.mean(sizes)) if sizes and mbs is not None else np.nan)
    return None if np.isnan(out).all() else np.array(out, dtype=float)


def bubble_bars(a: Analysis) -> Figure:
    """Bubble fraction per stage, grouped by phase."""
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 4.8))
    pp = a.run.pp_size
    colors = _stage_colors(pp)
    width = 0.8 / max(pp, 1)
    for s in range(pp):
        y = [v if (v := pm.stages[s].bubble_fraction) is not None else np.nan for pm in a.metrics]
        ax.bar(np.arange(len(a.metrics)) + s * width - 0.4 + width / 2, y, width, color=colors[s],
               label=f"stage {s}")
    ax.set_xticks(np.arange(len(a.metrics)), [pm.label for pm in a.metrics])
    ax.set_ylim(0, 1)
    ax.set_ylabel("bubble fraction")
    ax.set_xlabel("phase")
    if all(st.bubble_fraction is None for pm in a.metrics for st in pm.stages):
        _no_data(ax, "no bubble fractions: they need GPU samples")  # not 0: unknown
    _legend_beside(ax)  # bubble fractions are often high: a legend inside would hide the bars
    ax.set_title("Bubble fraction per stage and phase")
    fig.subplots_adjust(left=LEFT_IN / WIDTH_IN, right=1 - RIGHT_IN / WIDTH_IN)
    return fig


def _series_figure(a: Analysis, series: list[tuple[np.ndarray, str, str]], ylabel: str, title: str,
                   scale: float = 1.0, top: float | None = None) -> Figure:
    """Lines per stage over time; ``series`` is (values (pp x cells), line style, direction name);
    ``top``: a fixed upper limit of the y axis (else matplotlib's, from the data)."""
    fig, ax = _time_figure(3.8)
    t_all = _time_axis(a)
    colors = _stage_colors(a.run.pp_size)
    empty = all(np.isnan(values).all() for values, _, _ in series)
    for values, ls, _ in series:
        v, t = sample_columns(values / scale, t_all, MAX_COLUMNS // 2)
        column_s = float(t[1] - t[0]) if len(t) > 1 else 0.0
        sample_s = (a.sample_period_ns() or a.run.period_ns) / 1e9
        max_gap_s = max(GAP_PERIODS * sample_s, 1.5 * column_s)
        for s in range(v.shape[0]):
            ax.plot(*gap_broken(t, v[s], max_gap_s), lw=1.2, ls=ls, color=colors[s], alpha=0.9)
    if empty:
        _no_data(ax, "no samples of this metric in the run")
    else:
        handles = [Line2D([], [], color=colors[s], lw=2, label=f"stage {s}") for s in range(a.run.pp_size)]
        if len(series) > 1:
            handles += [Line2D([], [], color="black", ls=ls, lw=1.2, label=name) for _, ls, name in series]
        _legend_beside(ax, handles)
        peak = max((float(np.nanmax(values / scale)) for values, _, _ in series
                    if not np.isnan(values).all()), default=0.0)
        ax.set_ylim(bottom=0, top=None if top is None else top if peak <= top else peak * 1.05)
    ax.set_ylabel(ylabel)
    _finish_time_axes(ax, a, title)
    return fig


def power_figure(a: Analysis) -> Figure:
    """Power per stage as a share of the power limit (in watts where no limit is known)."""
    if np.isnan(a.series.power_share).all():
        return _series_figure(a, [(a.series.power_w, "-", "power")], "power (W)",
                              "Power per stage (no power limit known)")
    # the whole share scale, 0 to the limit: auto-scaled, one report read 0-1 and the next 0-0.4,
    # and side by side the idler deployment looked as hot
    return _series_figure(a, [(a.series.power_share, "-", "power")], "power / limit",
                          "Power per stage (share of the power limit)", top=1.0)


def _rate_unit(peak_bytes_per_s: float) -> tuple[float, str]:
    for div, unit in ((1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s")):
        if peak_bytes_per_s >= div:
            return div, unit
    return 1.0, "B/s"


def _nanmax(*arrays: np.ndarray) -> float | None:
    finite = [x[np.isfinite(x)] for x in arrays]
    peaks = [float(x.max()) for x in finite if x.size]
    return max(peaks) if peaks else None


def pcie_figure(a: Analysis) -> Figure:
    """PCIe TX (solid) and RX (dashed) per stage in bytes/s, in the unit the peak reads best in;
    the title gives the peak as a share of the link (it is often well under 1 %)."""
    tx, rx = a.series.pcie_tx_bytes_per_s, a.series.pcie_rx_bytes_per_s
    peak = _nanmax(tx, rx)
    div, unit = _rate_unit(peak or 0.0)
    share = _nanmax(a.series.pcie_tx_share, a.series.pcie_rx_share)
    title = "PCIe traffic per stage"
    if share is not None:
        title += f" (peak {share:.2%} of the link's capacity)"
    return _series_figure(a, [(tx, "-", "TX (GPU sends)"), (rx, "--", "RX (GPU receives)")],
                          f"PCIe ({unit})", title, scale=div)


def _rendered(build: Callable[[Analysis], Figure]) -> Callable[[Analysis], bytes]:
    def render(a: Analysis) -> bytes:
        with report_style():
            return figure_png(build(a))
    return render


def build_figure(name: str, a: Analysis) -> Figure:
    """The named figure, unrendered (the caller closes it): for checks of its axes."""
    with report_style():
        return BUILDERS[name](a)


BUILDERS: dict[str, Callable[[Analysis], Figure]] = {
    "busy_heatmap": busy_heatmap,
    "phase_throughput": phase_throughput,
    "running_vs_load": running_vs_load,
    "bubble_fraction": bubble_bars,
    "power": power_figure,
    "pcie": pcie_figure,
}

TIME_FIGURES = ("busy_heatmap", "power", "pcie")
"""The figures over time: they share one x range and axes position."""

FIGURES: dict[str, tuple[str, Callable[[Analysis], bytes]]] = {
    "busy_heatmap": ("Per-stage busy share over time, by the signal the analysis took",
                     _rendered(busy_heatmap)),
    "phase_throughput": ("Throughput per phase: measured against predicted, with the band",
                         _rendered(phase_throughput)),
    "power": ("Power", _rendered(power_figure)),
    "pcie": ("PCIe", _rendered(pcie_figure)),
    "running_vs_load": ("Running requests per stage and in the engine vs offered load",
                        _rendered(running_vs_load)),
    "bubble_fraction": ("Bubble fraction per stage per phase", _rendered(bubble_bars)),
}
"""name -> (caption, function giving PNG bytes): the figures in report order. The first screen
shows the first two (FIRST_SCREEN); the rest follow the tables, power and PCIe first: they share
the heatmap's time axis."""

FIRST_SCREEN = ("busy_heatmap", "phase_throughput")
"""The figures directly under the report's one-sentence answer: the bubble at a glance, and what
the advice is predicted to do per phase."""
