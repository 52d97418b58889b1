"""The report's per-phase throughput chart: measured tok/s per phase beside what the what-if
model predicts under the advice, with the band, so the first screen shows what the advice is
worth (and, where the advice is to keep the settings, what the best trade-off would gain and
cost). Drawn from the advisor's Advice (its figures unrounded, as the advice sentence states them);
without one, the measurement alone."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from gputrace.analysis.result import Analysis
from gputrace.report.document import advice_of
from gputrace.whatif.advise import AdvisedSetting, PhaseAdvice

MEASURED, AS_RUN, PREDICTED, TRADE = "#4a6fa5", "#b8b8b8", "#2e9d5b", "#d08a2c"


def _bars(ax: Axes, x: np.ndarray, offset: float, width: float, values: Sequence[float | None],
          color: str, label: str, band: Sequence[float] | None = None) -> None:
    y = np.array([np.nan if v is None else v for v in values], dtype=float)
    err = None if band is None else np.vstack([y * np.asarray(band), y * np.asarray(band)])
    ax.bar(x + offset, y, width, color=color, label=label, yerr=err, capsize=4,
           error_kw={"elinewidth": 1.2, "ecolor": "#333"})


def _by_phase(phases: Sequence[PhaseAdvice], labels: list[str]) -> list[PhaseAdvice | None]:
    by = {p.phase: p for p in phases}
    return [by.get(label) for label in labels]


def _setting(changes: Sequence[AdvisedSetting]) -> str:
    # one per line: the legend is narrow; a layer split as findings.json writes it
    return ",\n".join(f"{c.flag} {list(c.value) if isinstance(c.value, tuple) else c.value}" for c in changes)


def phase_throughput(a: Analysis, width_in: float = 13.0) -> Figure:
    """Per phase: measured tok/s, the model's replay as run, and the advice's prediction with its
    band (error bars); for a "keep", the best trade-off's prediction instead, named as such."""
    fig, ax = plt.subplots(figsize=(width_in, 2.7))
    labels = [pm.label for pm in a.metrics]
    x = np.arange(len(labels))
    advice = advice_of(a)
    if advice is None:
        _bars(ax, x, 0.0, 0.5, [pm.throughput_tok_s for pm in a.metrics], MEASURED, "measured")
        ax.set_title("Throughput per phase (no prediction: the what-if model could not be fitted)")
    else:
        keep = advice.keep
        rows = _by_phase(advice.phases, labels)
        shown: list[tuple[str, str, list[PhaseAdvice | None]]] = []
        if keep and advice.alternatives:
            best = advice.alternatives[0]
            shown = [(TRADE, "best trade-off (not advised):\n" + _setting(best.changes),
                      _by_phase(best.phases, labels))]
        elif not keep:
            shown = [(PREDICTED, "advised:\n" + _setting(advice.changes), rows)]
        n = 2 + len(shown)
        width = 0.8 / n
        first = -0.4 + width / 2
        _bars(ax, x, first, width, [pm.throughput_tok_s for pm in a.metrics], MEASURED, "measured")
        _bars(ax, x, first + width, width, [r.unchanged_tok_s if r else None for r in rows], AS_RUN,
              "model as run")
        for i, (color, label, predicted) in enumerate(shown):
            _bars(ax, x, first + (2 + i) * width, width,
                  [p.predicted_tok_s if p else None for p in predicted], color, label + " (± band)",
                  [p.band_ratio if p else 0.0 for p in predicted])
        title = "Throughput per phase: measured against predicted"
        ax.set_title(title + (" (keep: no change gains without a cost)" if keep else ""))
    ax.set_xticks(x, labels)
    ax.set_ylabel("tok/s")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, frameon=False)
    fig.subplots_adjust(left=1.0 / width_in, right=1 - 3.3 / width_in, bottom=0.13, top=0.86)
    return fig
