"""The comparison's figure, A beside B: per phase throughput (B's prediction from A with its band,
where the what-if model made one), then each run's busy share per stage and phase as a heatmap
on one colour scale, so where B filled (or emptied) the pipeline reads at a glance. Drawn from
the comparison document alone (compare.json), as the page is."""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes

from gputrace.report.figures import figure_png, report_style

A_COLOR, B_COLOR, PREDICTED = "#4a6fa5", "#d08a2c", "#2e9d5b"


def _busy_grid(doc: dict[str, Any], side: str) -> np.ndarray:
    """Stages x phases of one run's busy share (NaN where it had none)."""
    columns = [[np.nan if v is None else v for v in p[f"busy_fraction_{side}"]] for p in doc["phases"]]
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


def compare_figure(doc: dict[str, Any]) -> bytes:
    """The PNG: throughput per phase A vs B (and B predicted), busy per stage and phase in A and B."""
    labels = [p["label"] for p in doc["phases"]]
    predicted = {ph["label"]: ph for ph in (doc.get("predicted_against_measured") or {}).get("phases", [])}
    band = (doc.get("predicted_against_measured") or {}).get("band_ratio") or 0.0
    with report_style():
        fig, axes = plt.subplots(1, 3, figsize=(13.0, 3.6), gridspec_kw={"width_ratios": [1.4, 1, 1]})
        ax = axes[0]
        x = np.arange(len(labels))
        a = np.array([np.nan if p["throughput_tok_s_a"] is None else p["throughput_tok_s_a"]
                      for p in doc["phases"]], dtype=float)
        b = np.array([np.nan if p["throughput_tok_s_b"] is None else p["throughput_tok_s_b"]
                      for p in doc["phases"]], dtype=float)
        pb = np.array([np.nan if (ph := predicted.get(label)) is None or ph.get("predicted_tok_s") is None
                       else ph["predicted_tok_s"] for label in labels], dtype=float)
        shown = not np.isnan(pb).all()
        width = 0.8 / (3 if shown else 2)
        ax.bar(x - 0.4 + width / 2, a, width, color=A_COLOR, label=f"A: {doc['run_a']}")
        ax.bar(x - 0.4 + 1.5 * width, b, width, color=B_COLOR, label=f"B: {doc['run_b']}")
        if shown:
            ax.bar(x - 0.4 + 2.5 * width, pb, width, color=PREDICTED, label="B predicted from A (± band)",
                   yerr=np.vstack([pb * band, pb * band]), capsize=3)
        ax.set_xticks(x, labels)
        ax.set_ylabel("tok/s")
        ax.set_ylim(bottom=0)
        ax.set_title("Throughput per phase")
        ax.legend(loc="upper left", fontsize=8, frameon=False)
        im = _heatmap(axes[1], _busy_grid(doc, "a"), labels, f"Busy per stage, A ({doc['run_a']})")
        _heatmap(axes[2], _busy_grid(doc, "b"), labels, f"Busy per stage, B ({doc['run_b']})")
        fig.colorbar(im, ax=list(axes[1:]), label="busy share", fraction=0.03, pad=0.02)
        fig.subplots_adjust(left=0.06, right=0.9, bottom=0.12, top=0.88, wspace=0.3)
        return figure_png(fig)
