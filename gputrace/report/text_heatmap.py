"""The busy heatmap as terminal text: one row of shaded blocks per stage over time, the phases'
starts marked above, for the demo's console (the report's first figure, where no image shows)."""

from __future__ import annotations

import itertools
import warnings

import numpy as np

from gputrace.analysis.busy_cells import busy_over_time
from gputrace.analysis.result import Analysis

SHADES = " ░▒▓█"
"""Busy share 0 .. 1 in five steps; no figure is a middle dot."""


def text_heatmap(a: Analysis, columns: int = 96) -> list[str]:
    """Lines: the phase labels at their start column, then ``stage s |....|`` per stage."""
    busy = busy_over_time(a.run, a.series, a.metrics).busy
    cells = busy.shape[1]
    if cells == 0:
        return ["(no busy figure: the run has no cells)"]
    edges = np.linspace(0, cells, min(columns, cells) + 1).astype(int)
    with warnings.catch_warnings():  # a column without a sample stays NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        grid = np.stack([np.nanmean(busy[:, lo:hi], axis=1) for lo, hi in itertools.pairwise(edges)],
                        axis=1)
    width = grid.shape[1]
    marks = [" "] * width
    t0, span = int(a.run.grid_ns[0]), max(int(a.run.grid_ns[-1] - a.run.grid_ns[0]), 1)
    for ph in a.phases:
        col = min(max(int((ph.start_ns - t0) / span * width), 0), width - 1)
        for i, ch in enumerate(f"|{ph.label}"):
            if col + i < width:
                marks[col + i] = ch
    pad = len(f"stage {grid.shape[0] - 1} ")
    lines = [" " * pad + " " + "".join(marks)]
    for s, row in enumerate(grid):
        cells_text = "".join("·" if np.isnan(v) else SHADES[min(int(v * (len(SHADES) - 1) + 0.5),
                                                                len(SHADES) - 1)] for v in row)
        lines.append(f"{f'stage {s}':<{pad}}|{cells_text}|")
    lines.append(" " * pad + f" busy share per stage over time: '{SHADES[0]}' idle .. '{SHADES[-1]}' busy, "
                 "'·' no figure")
    return lines
