"""The Grafana dashboard's panels drawn with the report's figure code from what a Prometheus
returned for their queries (gputrace.prometheus.panels): time series as lines, the busy heatmap as
one row per stage, stats as their last value; the load phases' annotations as dashed lines. One
PNG per panel and an index.html laying them out in the dashboard's order, where Grafana itself
cannot run (its server is not installed here, nor needed to see what a panel shows)."""

from __future__ import annotations

import html
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

from gputrace.dashboard import PanelResult, PanelSeries, PhaseMark, text_of
from gputrace.json_types import JsonReadObject, JsonReadValue, as_number, as_text, section
from gputrace.report.figures import WIDTH_IN, figure_png, report_style

GRID_COLUMNS = 24  # Grafana's dashboard width in grid units
HEIGHT_IN_PER_UNIT = 0.42  # a grid unit is 30 px in Grafana; a little more here for the legends

# Grafana's units as an axis label and a divisor that keeps the numbers short
_UNITS: dict[str, tuple[str, float]] = {
    "watt": ("W", 1.0), "celsius": ("°C", 1.0), "s": ("s", 1.0), "joule": ("J", 1.0),
    "hertz": ("GHz", 1e9), "bytes": ("GB", 1e9), "short": ("", 1.0),
}


@dataclass(frozen=True)
class RenderedPanel:
    """One panel's PNG: where it went, what was drawn (series and finite points)."""

    title: str
    kind: str
    path: Path
    series: int
    points: int


def _unit(unit: str, peak: float) -> tuple[str, float]:
    """(axis label, divisor) for a Grafana unit; bytes per second scaled to the peak."""
    if unit == "Bps":
        for div, name in ((1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s")):
            if peak >= div:
                return name, div
        return "B/s", 1.0
    return _UNITS.get(unit, (unit, 1.0))


def _number_or(value: JsonReadValue | None, default: float) -> float:
    """A number of the panel's model, ``default`` (Grafana's) where it has none."""
    number = as_number(value)
    return default if number is None else number


def _grid_units(panel: JsonReadObject, key: str, default: int) -> int:
    """The panel's width or height (``w``, ``h``) in Grafana's grid units."""
    return int(_number_or(section(panel, "gridPos").get(key), default))


def _peak(series: Sequence[PanelSeries]) -> float:
    finite = [s.values[np.isfinite(s.values)] for s in series]
    return max((float(np.max(np.abs(v))) for v in finite if v.size), default=0.0)


def _phase_lines(ax: Axes, marks: Sequence[PhaseMark], start_s: float, end_s: float, fig_width_in: float
                 ) -> None:
    """A dashed line per phase mark, its title above the axes; a title close to the previous one
    goes a line higher (in a narrow panel they ran into each other)."""
    width_in = ax.get_position().width * fig_width_in
    close_s = (end_s - start_s) * 1.1 / max(width_in, 0.1)  # about an inch of the axes
    previous_s, level = None, 0
    for m in marks:
        if start_s <= m.t_s <= end_s:
            level = 1 - level if previous_s is not None and m.t_s - previous_s < close_s else 0
            previous_s = m.t_s
            ax.axvline(m.t_s - start_s, color="#f98f1d", lw=1.0, ls="--")
            ax.text(m.t_s - start_s, 1.01 + 0.07 * level, f" {m.title}", transform=ax.get_xaxis_transform(),
                    va="bottom", ha="left", fontsize=8, color="#b55d00", clip_on=False)


def _no_data(ax: Axes) -> None:
    ax.text(0.5, 0.5, "No data", transform=ax.transAxes, ha="center", va="center", fontsize=14,
            color="#777")
    ax.set_yticks([])


def _time_axis(ax: Axes, start_s: float, end_s: float) -> None:
    ax.set_xlim(0, max(end_s - start_s, 1.0))
    ax.set_xlabel(f"s since {datetime.fromtimestamp(start_s, UTC):%H:%M:%S} UTC")


def _timeseries(fig: Figure, panel: JsonReadObject, series: Sequence[PanelSeries],
                marks: Sequence[PhaseMark], start_s: float, end_s: float) -> None:
    width_in = fig.get_figwidth()
    legend_in = 2.3 if width_in > 6 else 1.9  # the legend's column, right of the axes
    ax = fig.add_axes((0.8 / width_in, 0.17, 1 - (0.8 + legend_in) / width_in, 0.65))
    defaults = section(panel, "fieldConfig", "defaults")
    unit = as_text(defaults.get("unit")) or "short"
    label, div = _unit(unit, _peak(series))
    for s in series:
        # step-after, as the dashboard draws them (a gauge holds its value until the next scrape)
        ax.step(s.ts_s - start_s, s.values / div, where="post", lw=1.3, label=s.legend)
    if unit == "percentunit":
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    else:
        ax.set_ylabel(label)
    if series:
        lo, hi = as_number(defaults.get("min")), as_number(defaults.get("max"))
        ax.set_ylim(bottom=lo / div if lo is not None else None,
                    top=hi / div if hi is not None and _peak(series) <= hi else None)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, frameon=False,
                  fontsize=8 if width_in > 6 else 7,
                  ncol=max(1, -(-len(series) // 16)))
    else:
        _no_data(ax)
    _time_axis(ax, start_s, end_s)
    _phase_lines(ax, marks, start_s, end_s, fig.get_figwidth())


def _stage_order(legend: str) -> tuple[int, str]:
    """Rows in stage order: 'stage 10' after 'stage 9'."""
    m = re.search(r"\d+", legend)
    return (int(m.group(0)) if m else 0, legend)


def heatmap_rows(series: Sequence[PanelSeries], start_s: float, step_s: float, end_s: float
                 ) -> tuple[list[str], np.ndarray]:
    """(row names, rows x steps): each series a row on the query's step grid, NaN where it has no
    value (the grid: start + i * step up to end, as Prometheus evaluates a range query)."""
    ordered = sorted(series, key=lambda s: _stage_order(s.legend))
    n = round((end_s - start_s) / step_s) + 1
    rows = np.full((len(ordered), n), np.nan)
    for r, s in enumerate(ordered):
        col = np.rint((s.ts_s - start_s) / step_s).astype(np.int64)
        ok = (col >= 0) & (col < n)
        rows[r, col[ok]] = s.values[ok]
    return [s.legend for s in ordered], rows


def _heatmap(fig: Figure, panel: JsonReadObject, series: Sequence[PanelSeries],
             marks: Sequence[PhaseMark], start_s: float, end_s: float, step_s: float) -> None:
    width_in = fig.get_figwidth()
    left, right = 1.3 / width_in, 1 - 1.0 / width_in  # room for the stage names and the colour bar
    ax = fig.add_axes((left, 0.2, right - left, 0.62))
    color = section(panel, "options", "color")
    if series:
        names, rows = heatmap_rows(series, start_s, step_s, end_s)
        cmap = _cmap(as_text(color.get("scheme")) or "viridis")
        im = ax.imshow(np.ma.masked_invalid(rows), aspect="auto", cmap=cmap, interpolation="nearest",
                       vmin=_number_or(color.get("min"), 0), vmax=_number_or(color.get("max"), 1),
                       extent=(-step_s / 2, end_s - start_s + step_s / 2, len(names) - 0.5, -0.5))
        ax.set_yticks(range(len(names)), names)
        cax = fig.add_axes((right + 0.15 / width_in, 0.2, 0.15 / width_in, 0.62))
        cb = fig.colorbar(im, cax=cax)
        if section(panel, "options", "cellValues").get("unit") == "percentunit":
            cb.ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    else:
        _no_data(ax)
    ax.set_ylabel(text_of(section(panel, "options", "yAxis").get("axisLabel")))
    _time_axis(ax, start_s, end_s)
    _phase_lines(ax, marks, start_s, end_s, fig.get_figwidth())


def _cmap(scheme: str) -> Any:
    import matplotlib

    name = scheme.lower()
    gray = {"bad": "#d9d9d9"}  # no value: gray, not the scale's lowest
    return (matplotlib.colormaps[name] if name in matplotlib.colormaps else matplotlib.colormaps["viridis"]
            ).with_extremes(**gray)


def _format(value: float, unit: str) -> str:
    if unit == "percentunit":
        return f"{value:.0%}"
    label, div = _unit(unit, abs(value))
    if unit == "joule" and abs(value) >= 1e3:
        label, div = ("kJ", 1e3) if abs(value) < 1e6 else ("MJ", 1e6)
    return f"{value / div:,.3g} {label}".strip()


def stat_value(s: PanelSeries) -> float | None:
    """A stat panel's figure for a series: its last value that is a number (lastNotNull)."""
    finite = s.values[np.isfinite(s.values)]
    return float(finite[-1]) if finite.size else None


def _stat(fig: Figure, panel: JsonReadObject, series: Sequence[PanelSeries], start_s: float) -> None:
    unit = as_text(section(panel, "fieldConfig", "defaults").get("unit")) or "short"
    if not series:
        _no_data(fig.add_subplot())
        return
    if section(panel, "options").get("textMode") == "name":  # a line of text: the series' names
        text = "\n".join(textwrap.fill(s.legend, 110) for s in series)
        fig.text(0.5, 0.42, text, ha="center", va="center", fontsize=14)
        return
    width = 1.0 / len(series)
    for i, s in enumerate(series):
        value = stat_value(s)
        spark = fig.add_axes((i * width + 0.02, 0.08, width - 0.04, 0.35))
        spark.fill_between(s.ts_s - start_s, s.values, step="post", color="#73bf69", alpha=0.35)
        spark.set_axis_off()
        fig.text(i * width + width / 2, 0.62, "n/a" if value is None else _format(value, unit),
                 ha="center", va="center", fontsize=26, color="#3f8f36", weight="bold")
        fig.text(i * width + width / 2, 0.84, s.legend, ha="center", va="center", fontsize=10)


def panel_figure(result: PanelResult, marks: Sequence[PhaseMark], start_s: float, end_s: float,
                 step_s: float) -> Figure:
    """One panel as a figure of its dashboard width (24 grid units: the report's 1,300 px)."""
    panel = result.panel
    width_in = WIDTH_IN * _grid_units(panel, "w", GRID_COLUMNS) / GRID_COLUMNS
    kind = panel.get("type")
    shortest_in = 1.5 if kind == "stat" else 3.0  # a stat is a figure or a line of text
    fig = Figure(figsize=(width_in, max(shortest_in, HEIGHT_IN_PER_UNIT * _grid_units(panel, "h", 8))))
    if kind == "heatmap":
        _heatmap(fig, panel, result.series, marks, start_s, end_s, step_s)
    elif kind == "stat":
        _stat(fig, panel, result.series, start_s)
    else:
        _timeseries(fig, panel, result.series, marks, start_s, end_s)
    fig.suptitle(text_of(panel.get("title")), fontsize=12, weight="bold", x=0.01, ha="left")
    return fig


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:60]


def write_panels(results: Sequence[PanelResult], marks: Sequence[PhaseMark], out_dir: Path, start_s: float,
                 end_s: float, step_s: float) -> list[RenderedPanel]:
    """A PNG per panel (rows are headings) and index.html with them in the dashboard's order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rendered: list[RenderedPanel] = []
    body: list[str] = []
    with report_style():
        for result in results:
            panel = result.panel
            title = text_of(panel.get("title"))
            if panel.get("type") == "row":
                body.append(f"<h2>{html.escape(title)}</h2>")
                continue
            panel_id = int(_number_or(panel.get("id"), len(rendered) + 1))
            path = out_dir / f"{panel_id:02d}-{_slug(title)}.png"
            path.write_bytes(figure_png(panel_figure(result, marks, start_s, end_s, step_s)))
            points = sum(int(np.isfinite(s.values).sum()) for s in result.series)
            rendered.append(RenderedPanel(title, str(panel.get("type")), path, len(result.series), points))
            width = 100 * _grid_units(panel, "w", GRID_COLUMNS) / GRID_COLUMNS
            caption = html.escape(text_of(panel.get("description")))
            body.append(f'<figure style="width:{width - 1:.1f}%"><img src="{path.name}" '
                        f'alt="{html.escape(title)}"><figcaption>{caption}</figcaption></figure>')
    span = (f"{datetime.fromtimestamp(start_s, UTC):%Y-%m-%d %H:%M:%S} to "
            f"{datetime.fromtimestamp(end_s, UTC):%H:%M:%S} UTC, step {step_s:g} s")
    (out_dir / "index.html").write_text(
        "<!doctype html><meta charset='utf-8'><title>gputrace dashboard panels</title>"
        "<style>body{font-family:sans-serif;margin:12px;max-width:1340px}figure{display:inline-block;"
        "vertical-align:top;margin:0 0.5% 10px 0}img{width:100%}figcaption{font-size:12px;color:#555}"
        "h2{border-bottom:1px solid #ccc;margin:18px 0 6px}</style>"
        f"<h1>gputrace: pipeline-parallel bubbles</h1><p>The Grafana dashboard's panels drawn from "
        f"what Prometheus returned for their queries, {html.escape(span)}.</p>" + "".join(body),
        encoding="utf-8")
    return rendered

