"""The report's figures as PNG bytes (matplotlib, Agg): utilization heatmap, running requests vs
offered load, bubble fraction per stage and phase, power, PCIe."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # Agg is chosen above, before pyplot loads
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from gputrace.analysis.run import Analysis

MAX_COLUMNS = 1200
"""Time series are averaged down to at most this many columns: a figure has no more pixels."""


HEATMAP_COLUMNS = 300
"""The heatmap's columns at most: each one a readable block, not a pixel-wide stripe."""


def _downsample(values: np.ndarray, t_s: np.ndarray, max_columns: int = MAX_COLUMNS,
                min_step: int = 1) -> tuple[np.ndarray, np.ndarray]:
    n = values.shape[-1]
    step = max(int(np.ceil(n / max_columns)), min_step, 1)
    m = n // step
    if step == 1 or m == 0:
        return values, t_s
    v = values[..., : m * step].reshape(*values.shape[:-1], m, step)
    with np.errstate(all="ignore"):
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            out = np.nanmean(v, axis=-1)
    return np.asarray(out), t_s[: m * step].reshape(m, step).mean(axis=1)


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _time_axis(a: Analysis) -> np.ndarray:
    return np.asarray(a.run.grid_ns - a.run.grid_ns[0], dtype=np.float64) / 1e9


def _phase_lines(ax: Axes, a: Analysis, with_labels: bool = True) -> None:
    t0 = a.run.grid_ns[0]
    top = ax.get_ylim()[1]
    for ph in a.phases:
        x = (ph.start_ns - t0) / 1e9
        ax.axvline(x, color="black", lw=0.8, ls="--")
        if with_labels:
            ax.text(x, top, f" {ph.label}", va="bottom", ha="left", fontsize=7)


def heatmap_columns(util: np.ndarray, t_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(stages x columns, column times): at most HEATMAP_COLUMNS columns, each the mean of at least
    two of NVML's utilization periods. Those (1/6 s on most GPUs) can be longer than the grid's
    cells, which leaves cells without a sample; a column of such cells alone would show nothing."""
    filled = np.flatnonzero(~np.isnan(util).all(axis=0)) if util.size else np.zeros(0, dtype=np.int64)
    gap = int(np.median(np.diff(filled))) if len(filled) > 1 else 1
    return _downsample(util, t_s, HEATMAP_COLUMNS, min_step=2 * gap)


def utilization_heatmap(a: Analysis) -> bytes:
    """Per-stage utilization over time with phase boundaries."""
    util, t = heatmap_columns(a.series.utilization, _time_axis(a))
    fig, ax = plt.subplots(figsize=(10, 0.35 * a.run.pp_size + 1.6))
    if len(t):
        extent = (float(t[0]), float(t[-1]) if len(t) > 1 else float(t[0]) + 1, a.run.pp_size - 0.5, -0.5)
        cmap = plt.get_cmap("viridis").with_extremes(bad="lightgray")  # no sample: gray, not idle
        im = ax.imshow(np.ma.masked_invalid(util), aspect="auto", cmap=cmap, vmin=0, vmax=1,
                       extent=extent, interpolation="nearest")
        fig.colorbar(im, ax=ax, label="utilization")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("pp stage")
    ax.set_yticks(range(a.run.pp_size))
    _phase_lines(ax, a)
    ax.set_title("GPU utilization per pipeline stage", pad=14)
    return _png(fig)


def running_vs_load(a: Analysis) -> bytes:
    """Micro-batch size (#running-req) per stage against the offered load of each phase."""
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [pm.inflight_mean if pm.inflight_mean is not None else (pm.target_concurrency or 0)
          for pm in a.metrics]
    order = np.argsort(xs)
    x = np.array(xs, dtype=float)[order]
    for s in range(a.run.pp_size):
        y = np.array([a.metrics[i].stages[s].microbatch_size_mean or np.nan for i in order], dtype=float)
        ax.plot(x, y, marker="o", lw=1, label=f"stage {s}")
    if len(x):
        ax.plot(x, x, color="gray", ls=":", label="offered load")
    ax.set_xlabel("requests in flight (offered load)")
    ax.set_ylabel("#running-req per stage (micro-batch)")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("Running requests per stage vs offered load")
    return _png(fig)


def bubble_bars(a: Analysis) -> bytes:
    """Bubble fraction per stage, grouped by phase."""
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(a.metrics) + 2), 4))
    pp = a.run.pp_size
    width = 0.8 / max(pp, 1)
    for s in range(pp):
        y = [pm.stages[s].bubble_fraction or 0.0 for pm in a.metrics]
        ax.bar(np.arange(len(a.metrics)) + s * width - 0.4 + width / 2, y, width, label=f"stage {s}")
    ax.set_xticks(np.arange(len(a.metrics)), [pm.label for pm in a.metrics])
    ax.set_ylim(0, 1)
    ax.set_ylabel("bubble fraction")
    # beside the axes: bubble fractions are often high, and a legend inside would hide the bars
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.set_title("Bubble fraction per stage and phase")
    return _png(fig)


def _series_figure(a: Analysis, values: np.ndarray, ylabel: str, title: str,
                   extra: np.ndarray | None = None, extra_label: str = "") -> bytes:
    v, t = _downsample(values, _time_axis(a))
    fig, ax = plt.subplots(figsize=(10, 3.2))
    if np.isnan(values).all():
        ax.text(0.5, 0.5, "no samples of this metric in the run", transform=ax.transAxes, ha="center")
    for s in range(v.shape[0]):
        ax.plot(t, v[s], lw=0.7, label=f"stage {s}")
    if extra is not None:
        e, _ = _downsample(extra, _time_axis(a))
        for s in range(e.shape[0]):
            ax.plot(t, e[s], lw=0.7, ls="--", label=f"{extra_label} {s}" if s == 0 else None)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel(ylabel)
    _phase_lines(ax, a)
    if not np.isnan(values).all():
        ax.legend(fontsize=6, ncol=4, loc="upper right")
    ax.set_title(title, pad=14)
    return _png(fig)


def power_figure(a: Analysis) -> bytes:
    """Power per stage as a share of the power limit."""
    if np.isnan(a.series.power_share).all():
        return _series_figure(a, a.series.power_w, "power (W)", "Power per stage (no limit known)")
    return _series_figure(a, a.series.power_share, "power / limit", "Power per stage (share of limit)")


def pcie_figure(a: Analysis) -> bytes:
    """PCIe TX (solid) and RX (dashed) per stage against the link's capacity."""
    if np.isnan(a.series.pcie_tx_share).all():
        return _series_figure(a, a.series.pcie_tx_bytes_per_s / 1e9, "GB/s", "PCIe TX per stage",
                              a.series.pcie_rx_bytes_per_s / 1e9, "RX")
    return _series_figure(a, a.series.pcie_tx_share, "share of link capacity",
                          "PCIe TX (solid) / RX (dashed) per stage", a.series.pcie_rx_share, "RX")


FIGURES = {
    "utilization_heatmap": ("Per-stage utilization over time", utilization_heatmap),
    "running_vs_load": ("Running requests per stage vs offered load", running_vs_load),
    "bubble_fraction": ("Bubble fraction per stage per phase", bubble_bars),
    "power": ("Power", power_figure),
    "pcie": ("PCIe", pcie_figure),
}
"""name -> (caption, function): the figures in report order."""
