"""The Grafana dashboard's queries run against a Prometheus over one time range, as Grafana runs
them (template variables and interval macros substituted, one range query per target), for
rendering the panels without Grafana (gputrace.report.panels draws them)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from gputrace import dashboard as dash
from gputrace.json_types import JsonReadObject
from gputrace.prometheus.client import MAX_POINTS_PER_SERIES, PrometheusClient


def _macros(start_ms: int, end_ms: int, step_ms: int) -> dict[str, str]:
    """Grafana's interval macros for this range: $__interval the step, $__rate_interval four
    steps (Grafana's floor: four scrape intervals), $__range the whole range."""
    return {"__interval": f"{step_ms}ms", "__rate_interval": f"{4 * step_ms}ms",
            "__range": f"{max(end_ms - start_ms, step_ms)}ms"}


def query_panels(client: PrometheusClient, start_ms: int, end_ms: int, step_ms: int,
                 variables: Mapping[str, str] | None = None, board: JsonReadObject | None = None
                 ) -> list[dash.PanelResult]:
    """Each panel of the dashboard (rows included, with no series) with what its queries returned."""
    board = board if board is not None else dash.load_dashboard()
    macros = _macros(start_ms, end_ms, step_ms)
    out = []
    for panel in dash.panels_in_order(board):
        series = []
        for q in dash.panel_queries(panel, variables, macros):
            # an instant query: the one step at the range's end
            lo = end_ms if q.instant else start_ms
            for s in client.query_range_chunked(q.expr, lo, end_ms, step_ms, MAX_POINTS_PER_SERIES):
                series.append(dash.PanelSeries(dash.legend_text(q.legend, s.labels), q.ref_id,
                                               s.ts_ms / 1000.0, s.values))
        out.append(dash.PanelResult(panel, tuple(series)))
    return out


def query_phase_marks(client: PrometheusClient, start_ms: int, end_ms: int, step_ms: int,
                      variables: Mapping[str, str] | None = None, board: JsonReadObject | None = None
                      ) -> list[dash.PhaseMark]:
    """The annotations as Grafana places them with useValueForTime: each distinct value of the
    series (a time in ms) once, titled by its labels, in time order."""
    board = board if board is not None else dash.load_dashboard()
    marks: dict[tuple[str, float], dash.PhaseMark] = {}
    for q in dash.annotation_queries(board, variables, _macros(start_ms, end_ms, step_ms)):
        for s in client.query_range_chunked(q.expr, start_ms, end_ms, step_ms, MAX_POINTS_PER_SERIES):
            title = dash.legend_text(q.legend, s.labels)
            for value_ms in np.unique(s.values[np.isfinite(s.values)]):
                marks[(title, float(value_ms))] = dash.PhaseMark(title, float(value_ms) / 1000.0)
    return sorted(marks.values(), key=lambda m: m.t_s)
