"""The comparison's figure, A beside B: per phase throughput (B's prediction from A with its band,
where the what-if model made one), then each run's busy share per stage and phase as a heatmap
on one colour scale, so where B filled (or emptied) the pipeline reads at a glance. Drawn from
the comparison document alone (compare.json), as the page is."""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes

from gputrace.json_types import JsonReadObject
from gputrace.report.comparison import Comparison
from gputrace.report.figures import figure_png, report_style

A_COLOR, B_COLOR, PREDICTED = "#4a6fa5", "#d08a2c", "#2e9d5b"


def _busy_grid(columns_by_phase: list[tuple[float | None, ...]]) -> np.ndarray:
    """Stages x phases of one run's busy share (NaN where it had none)."""
    columns = [[np.nan if v is None else v for v in column] for column in columns_by_phase]
    stages = max((len(c) for c in columns), default=0)
    grid = np.full((stages, len(columns)), np.nan)
    for j, column in enumerate(columns):
        grid[:len(column), j] = column
    return grid


def _heatmap(ax: Axes, grid: np.ndarray, labels: list[str], title: str) -> Any:
    cmap = plt.get_cmap("viridis").with_extremes(bad="lightgray")
    im = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap=cmap, vmin=0, vmax=1,
                   interpolation="nearest")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_yticks(range(grid.shape[0]))
    ax.set_ylabel("pp stage")
    ax.set_title(title)
    if grid.size == 0 or np.isnan(grid).all():
        ax.text(0.5, 0.5, "no busy figure", transform=ax.transAxes, ha="center", va="center")
    return im


def compare_figure(doc: JsonReadObject) -> bytes:
    """The PNG: throughput per phase A vs B (and B predicted), busy per stage and phase in A and B."""
    c = Comparison.read(doc)
    labels = [p.label for p in c.phases]
    predicted = {ph.label: ph for ph in c.prediction.phases} if c.prediction else {}
    band = (c.prediction.band_ratio if c.prediction else None) or 0.0
    with report_style():
        fig, axes = plt.subplots(1, 3, figsize=(13.0, 3.6), gridspec_kw={"width_ratios": [1.4, 1, 1]})
        ax = axes[0]
        x = np.arange(len(labels))
        a = np.array([np.nan if p.throughput_tok_s_a is None else p.throughput_tok_s_a for p in c.phases],
                     dtype=float)
        b = np.array([np.nan if p.throughput_tok_s_b is None else p.throughput_tok_s_b for p in c.phases],
                     dtype=float)
        pb = np.array([np.nan if (ph := predicted.get(label)) is None or ph.predicted_tok_s is None
                       else ph.predicted_tok_s for label in labels], dtype=float)
        shown = not np.isnan(pb).all()
        width = 0.8 / (3 if shown else 2)
        ax.bar(x - 0.4 + width / 2, a, width, color=A_COLOR, label=f"A: {c.run_a}")
        ax.bar(x - 0.4 + 1.5 * width, b, width, color=B_COLOR, label=f"B: {c.run_b}")
        if shown:
            ax.bar(x - 0.4 + 2.5 * width, pb, width, color=PREDICTED, label="B predicted from A (± band)",
                   yerr=np.vstack([pb * band, pb * band]), capsize=3)
        ax.set_xticks(x, labels)
        ax.set_ylabel("tok/s")
        ax.set_ylim(bottom=0)
        ax.set_title("Throughput per phase")
        ax.legend(loc="upper left", fontsize=8, frameon=False)
        im = _heatmap(axes[1], _busy_grid([p.busy_fraction_a for p in c.phases]), labels,
                      f"Busy per stage, A ({c.run_a})")
        _heatmap(axes[2], _busy_grid([p.busy_fraction_b for p in c.phases]), labels,
                 f"Busy per stage, B ({c.run_b})")
        fig.colorbar(im, ax=list(axes[1:]), label="busy share", fraction=0.03, pad=0.02)
        fig.subplots_adjust(left=0.06, right=0.9, bottom=0.12, top=0.88, wspace=0.3)
        return figure_png(fig)
