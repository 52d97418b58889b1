"""The Grafana dashboard as code: the panels over the metric contract (gputrace.metric_names),
and every PromQL expression it runs. ``python -m gputrace.dashboard --write grafana/dashboard.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gputrace import metric_names as mn
from gputrace.json_types import (
    JsonObject,
    JsonReadObject,
    JsonReadValue,
    JsonValue,
    as_objects,
    as_text,
    section,
)

DATASOURCE_UID = "gputrace-prometheus"  # fixed: grafana/provisioning/datasources/prometheus.yaml
DATASOURCE: JsonObject = {"type": "prometheus", "uid": DATASOURCE_UID}
DASHBOARD_UID = "gputrace-pp-bubbles"
DASHBOARD_PATH = Path(__file__).resolve().parent.parent / "grafana" / "dashboard.json"


# The contract's metrics the dashboard shows (names, types, labels, help: gputrace.metric_names).
# A test holds it to the panels: each is shown and the panels query no other gputrace metric.
METRICS: tuple[mn.MetricSpec, ...] = (
    mn.GPU_UTILIZATION, mn.GPU_MEMORY_UTILIZATION, mn.GPU_POWER, mn.GPU_ENERGY, mn.GPU_PCIE_TX,
    mn.GPU_PCIE_RX, mn.GPU_SM_CLOCK, mn.GPU_MEMORY_USED, mn.GPU_TEMPERATURE, mn.GPU_SM_ACTIVE, mn.AGENT_UP,
    *mn.ENGINE_GAUGES, mn.LOAD_INFLIGHT, mn.LOAD_TARGET_CONCURRENCY, mn.STAGE_BUBBLE, *mn.LIVE_EXTRAS,
)
METRIC_NAMES: frozenset[str] = frozenset(m.name for m in METRICS)

# Values a template variable takes when queries are run outside Grafana (all hosts, all runs), and
# Grafana's interval macros with the values used then.
DEFAULT_VARIABLES: dict[str, str] = {"host": ".*", "run": ".*"}
DEFAULT_MACROS: dict[str, str] = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m"}

_HOST = 'host=~"$host"'
_RUN = 'run=~"$run"'
_ENGINE = f"{_HOST}, {_RUN}"


def _target(ref: str, expr: str, legend: str, instant: bool = False) -> JsonObject:
    target: JsonObject = {"datasource": DATASOURCE, "editorMode": "code", "expr": expr,
                          "legendFormat": legend, "range": not instant, "refId": ref}
    return {**target, "instant": True} if instant else target


def _targets(*queries: tuple[str, str]) -> list[JsonValue]:
    return [_target(chr(ord("A") + i), expr, legend) for i, (expr, legend) in enumerate(queries)]


def _timeseries(title: str, description: str, unit: str, queries: Sequence[tuple[str, str]],
                *, minimum: float | None = None, maximum: float | None = None,
                draw: str = "line") -> JsonObject:
    defaults: JsonObject = {
        "unit": unit,
        "custom": {"drawStyle": draw, "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                   "spanNulls": False, "lineInterpolation": "stepAfter" if draw == "line" else "linear"},
    }
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    return {
        "type": "timeseries", "title": title, "description": description, "datasource": DATASOURCE,
        "targets": _targets(*queries),
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "right", "showLegend": True,
                               "calcs": ["mean", "lastNotNull"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
    }


def _heatmap(title: str, description: str, expr: str, legend: str) -> JsonObject:
    # Each series (one per stage) becomes a row; the cell colour is the value, 0..1.
    return {
        "type": "heatmap", "title": title, "description": description, "datasource": DATASOURCE,
        "targets": _targets((expr, legend)),
        "fieldConfig": {"defaults": {"custom": {"scaleDistribution": {"type": "linear"}}}, "overrides": []},
        "options": {
            "calculate": False,
            # Stage names are labels, not bucket bounds: an ordinal y axis, one row per series.
            "rowsFrame": {"layout": "unknown", "value": "utilization"},
            "color": {"mode": "scheme", "scheme": "Turbo", "fill": "dark-orange", "exponent": 0.5,
                      "steps": 64, "reverse": False, "min": 0, "max": 1},
            "cellGap": 1,
            "cellValues": {"unit": "percentunit"},
            "showValue": "never",
            "yAxis": {"axisPlacement": "left", "axisLabel": "pipeline stage (pp_rank)", "reverse": True},
            "legend": {"show": True},
            "tooltip": {"mode": "single", "yHistogram": False, "showColorScale": True},
            "exemplars": {"color": "rgba(255,0,255,0.7)"},
        },
    }


def _stat(title: str, description: str, unit: str, expr: str, legend: str) -> JsonObject:
    return {
        "type": "stat", "title": title, "description": description, "datasource": DATASOURCE,
        "targets": _targets((expr, legend)),
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"graphMode": "area", "colorMode": "value", "justifyMode": "auto", "textMode": "auto",
                    "wideLayout": True, "showPercentChange": False, "percentChangeColorMode": "standard",
                    "orientation": "auto",
                    "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
    }


def _text_stat(title: str, description: str, expr: str, legend: str) -> JsonObject:
    """A line of text from an info series' labels: the series' name (its legend) is the panel's text."""
    return {
        "type": "stat", "title": title, "description": description, "datasource": DATASOURCE,
        "targets": [_target("A", expr, legend, instant=True)],
        "fieldConfig": {"defaults": {"unit": "none", "color": {"mode": "fixed", "fixedColor": "text"}},
                        "overrides": []},
        "options": {"graphMode": "none", "colorMode": "none", "justifyMode": "center", "textMode": "name",
                    "wideLayout": True, "showPercentChange": False, "percentChangeColorMode": "standard",
                    "orientation": "auto",
                    "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
    }


def _row(title: str) -> JsonObject:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def _per_stage(fn: str, metric: str, selector: str) -> str:
    """A per-stage series of an engine metric: every TP rank logs the same numbers (take the max),
    data-parallel replicas add up."""
    return f"sum by (pp_rank) ({fn} by (pp_rank, dp_rank) ({metric}{{{selector}}}))"


def _panels() -> list[tuple[JsonObject, int, int]]:
    """(panel, width, height) in reading order; positions are filled in by layout()."""
    util = f"avg by (pp_rank) ({mn.GPU_UTILIZATION.name}{{{_HOST}}})"
    busy = f"max by (pp_rank, signal) ({mn.STAGE_BUSY.name}{{{_RUN}}})"
    gpu_legend = "{{host}} gpu{{gpu}} (stage {{pp_rank}})"
    return [
        (_row("The pipeline: what the verdict rests on"), 24, 1),
        (_text_stat("Finding now", "What the live figures say now, by the report's rules over the "
                    "collector's last window (the line `gputrace watch` shows); the report's advice, "
                    "with its predicted gain, comes from `gputrace report` over whole phases.",
                    f"max by (cause, finding) ({mn.LIVE_FINDING.name}{{{_RUN}}})", "{{finding}}"), 24, 3),
        (_timeseries("Micro-batches in flight vs pipeline stages", "Micro-batches the engine has in "
                     "flight (from the first stage's log lines, as the report reads them) against "
                     "the stages: below the stages line, some stages idle each step (the schedule "
                     "allows in flight / stages busy).", "short",
                     [(f"max({mn.ENGINE_MICROBATCHES.name}{{{_RUN}}})", "micro-batches in flight"),
                      (f"max({mn.ENGINE_STAGES.name}{{{_RUN}}})", "pipeline stages (pp_size)")],
                     minimum=0), 12, 9),
        (_timeseries("Engine running total vs its pool and the load", "Requests the engine runs in "
                     "all its micro-batches (one stage's logged running count is one micro-batch), "
                     "its admission limit (its request pool) and what the load offers.", "short",
                     [(f"sum({mn.ENGINE_TOTAL_RUNNING.name}{{{_RUN}}})", "engine running (total)"),
                      (f"max({mn.ENGINE_POOL.name}{{{_RUN}}})", "pool limit"),
                      (f"sum({mn.LOAD_INFLIGHT.name}{{{_RUN}}})", "load in flight")],
                     minimum=0), 12, 9),
        (_heatmap("Busy per stage (heatmap)", "Each stage's busy share by the best signal present, "
                  "in the report's order: the engine's device timer, SM activity (GPM), the engine's "
                  "loop timers (with [hosts.engine_metrics]), else NVML utilization, which reads high "
                  "while a stage only waits in NCCL. Rows: pp_rank; stages in lockstep show as bands.",
                  f"max by (pp_rank) ({mn.STAGE_BUSY.name}{{{_RUN}}})", "stage {{pp_rank}}"), 12, 9),
        (_timeseries("Busy and bubble per stage", "Busy (by the signal named) and the bubble: the "
                     "share of time the stage's GPUs idled while the engine had requests running or "
                     "queued.", "percentunit",
                     [(busy, "busy, stage {{pp_rank}} ({{signal}})"),
                      (f"{mn.STAGE_BUBBLE.name}{{{_RUN}}}", "bubble, stage {{pp_rank}}")],
                     minimum=0, maximum=1), 12, 9),
        (_timeseries("TTFT and ITL", "Time to first token and mean inter-token latency of the "
                     "requests completed in the collector's last window (p50, p90).", "s",
                     [(f"max by (quantile) ({mn.LOAD_TTFT.name}{{{_RUN}}})", "TTFT p{{quantile}}"),
                      (f"max by (quantile) ({mn.LOAD_ITL.name}{{{_RUN}}})", "ITL p{{quantile}}")],
                     minimum=0), 24, 8),
        (_row("Pipeline stages"), 24, 1),
        (_timeseries("GPU utilization per stage", "NVML utilization averaged over each stage's GPUs "
                     "(raw: a stage waiting in NCCL reads busy here; the busy panels use SM activity "
                     "where the GPU has it).",
                     "percentunit", [(util, "stage {{pp_rank}}")], minimum=0, maximum=1), 12, 8),
        (_timeseries("SM activity per stage (GPM)", "GPM SM activity averaged per stage (Hopper and "
                     "newer; empty on older GPUs).", "percentunit",
                     [(f"avg by (pp_rank) ({mn.GPU_SM_ACTIVE.name}{{{_HOST}}})", "stage {{pp_rank}}")],
                     minimum=0, maximum=1), 12, 8),
        (_row("Engine and load"), 24, 1),
        (_timeseries("Micro-batch per stage (running) vs load in flight", "Each stage's "
                     "logged running count: the micro-batch it last ran, not the engine's total (see the "
                     "engine panel), against what the load generator keeps in flight.", "short",
                     [(_per_stage("max", mn.ENGINE_RUNNING.name, _ENGINE),
                       "running, stage {{pp_rank}}"),
                      (f"sum({mn.LOAD_INFLIGHT.name}{{{_RUN}}})", "load in flight"),
                      (f"sum({mn.LOAD_TARGET_CONCURRENCY.name}{{{_RUN}}})", "target concurrency")],
                     minimum=0), 12, 9),
        (_timeseries("Queued requests per stage", "The engine's logged waiting queue per stage.", "short",
                     [(_per_stage("max", mn.ENGINE_QUEUE.name, _ENGINE),
                       "queued, stage {{pp_rank}}")],
                     minimum=0), 12, 9),
        (_timeseries("Generation throughput", "Generated tokens per second as logged by each stage; "
                     "the total takes the last stage's figure per data-parallel replica.", "short",
                     [(f"sum(max by (dp_rank) ({mn.ENGINE_GENERATION_THROUGHPUT.name}{{{_ENGINE}}}))",
                       "total tok/s"),
                      (_per_stage("max", mn.ENGINE_GENERATION_THROUGHPUT.name, _ENGINE),
                       "stage {{pp_rank}}")], minimum=0), 12, 8),
        (_timeseries("KV-cache token usage", "Token usage per stage; near 1.0 the engine stops "
                     "admitting requests (not a bubble).", "percentunit",
                     [(f"max by (pp_rank) ({mn.ENGINE_TOKEN_USAGE.name}{{{_ENGINE}}})",
                       "stage {{pp_rank}}")], minimum=0, maximum=1), 12, 8),
        (_row("GPUs"), 24, 1),
        (_timeseries("Power", "Power draw per GPU.", "watt",
                     [(f"{mn.GPU_POWER.name}{{{_HOST}}}", gpu_legend)], minimum=0), 12, 8),
        (_timeseries("PCIe throughput", "PCIe TX and RX per GPU: activation hand-offs between stages "
                     "on the same host travel here.", "Bps",
                     [(f"{mn.GPU_PCIE_TX.name}{{{_HOST}}}", "TX " + gpu_legend),
                      (f"{mn.GPU_PCIE_RX.name}{{{_HOST}}}", "RX " + gpu_legend)],
                     minimum=0), 12, 8),
        (_timeseries("SM clock", "SM clock per GPU; a drop under load means power or thermal "
                     "throttling.", "hertz",
                     [(f"{mn.GPU_SM_CLOCK.name}{{{_HOST}}}", gpu_legend)]), 8, 8),
        (_timeseries("Temperature", "GPU temperature.", "celsius",
                     [(f"{mn.GPU_TEMPERATURE.name}{{{_HOST}}}", gpu_legend)]), 8, 8),
        (_timeseries("Memory", "Device memory in use per GPU.", "bytes",
                     [(f"{mn.GPU_MEMORY_USED.name}{{{_HOST}}}", "used " + gpu_legend)],
                     minimum=0), 8, 8),
        (_timeseries("Memory-controller utilization", "Fraction of time device memory was read or "
                     "written.", "percentunit",
                     [(f"{mn.GPU_MEMORY_UTILIZATION.name}{{{_HOST}}}", gpu_legend)],
                     minimum=0, maximum=1), 12, 8),
        (_stat("Energy over the time range", "Energy used by the selected hosts' GPUs over the "
               "dashboard's time range.", "joule",
               f"sum by (host) (increase({mn.GPU_ENERGY.name}{{{_HOST}}}[$__range]))",
               "{{host}}"), 6, 8),
        (_stat("Agents up", f"Agents reporting ({mn.AGENT_UP.name}, all hosts).", "short",
               f"sum({mn.AGENT_UP.name})", "agents"), 6, 8),
    ]


def layout(panels: Sequence[tuple[JsonObject, int, int]]) -> list[JsonValue]:
    """Place panels left to right, wrapping at Grafana's 24 columns; number them from 1."""
    placed: list[JsonValue] = []
    x = y = row_h = 0
    for panel_id, (panel, width, height) in enumerate(panels, start=1):
        if x + width > 24:
            x, y, row_h = 0, y + row_h, 0
        placed.append({**panel, "id": panel_id, "gridPos": {"h": height, "w": width, "x": x, "y": y}})
        x, row_h = x + width, max(row_h, height)
    return placed


def _variable(name: str, label: str, query: str) -> JsonObject:
    return {
        "type": "query", "name": name, "label": label, "datasource": DATASOURCE,
        "query": query, "definition": query, "refresh": 2, "sort": 1,
        "multi": True, "includeAll": True, "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "options": [],
    }


def build_dashboard() -> JsonObject:
    """The dashboard as Grafana's JSON model (schemaVersion 42)."""
    return {
        "uid": DASHBOARD_UID,
        "title": "gputrace: pipeline-parallel bubbles",
        "description": "The live finding, micro-batches in flight against the stages, the engine's "
                       "running total against its pool, busy and bubble per stage by the best signal, "
                       "TTFT/ITL, the load phases; then per-stage GPU figures, from gputrace's agent "
                       "and collector.",
        "tags": ["gputrace", "gpu", "llm-serving"],
        "editable": True,
        "graphTooltip": 1,
        "timezone": "browser",
        "time": {"from": "now-30m", "to": "now"},
        "refresh": "5s",
        "schemaVersion": 42,
        "templating": {"list": [
            _variable("host", "Host", f"label_values({mn.GPU_UTILIZATION.name}, host)"),
            _variable("run", "Run", 'label_values({__name__=~"gputrace_.+"}, run)'),
        ]},
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
            "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
            "type": "dashboard",
        }, {
            # each load phase where its marker put it: the series' value is the phase's start
            # (Unix seconds; Grafana takes milliseconds with useValueForTime)
            "datasource": DATASOURCE, "enable": True, "hide": False, "iconColor": "rgba(255, 152, 48, 1)",
            "name": "Load phases", "expr": f"max by (phase) ({mn.LOAD_PHASE_START.name}{{{_RUN}}}) * 1000",
            "step": "5s", "titleFormat": "phase {{phase}}", "textFormat": "load phase {{phase}} began",
            "tagKeys": "phase", "useValueForTime": True,
        }]},
        "panels": layout(_panels()),
    }


def render(dashboard: JsonReadObject) -> str:
    """The committed form: sorted keys, two-space indent, trailing newline (stable diffs)."""
    return json.dumps(dashboard, indent=2, sort_keys=True) + "\n"


@dataclass(frozen=True, slots=True)
class PanelQuery:
    panel: str
    ref_id: str
    expr: str  # template variables and interval macros substituted: plain PromQL
    legend: str
    instant: bool = False  # evaluated at the range's end only (Grafana's "Instant" query type)


@dataclass(frozen=True, slots=True)
class VariableQuery:
    name: str
    label: str  # the label whose values the variable lists
    match: str  # the series selector they come from ('{run!=""}' when the query names no metric)


_VAR_RE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")


def substitute(expr: str, variables: Mapping[str, str] | None = None,
               macros: Mapping[str, str] | None = None) -> str:
    """Replace $var, ${var}, ${var:fmt}, [[var]] and $__macros as Grafana would for one value each."""
    values = {**DEFAULT_VARIABLES, **DEFAULT_MACROS, **(variables or {}), **(macros or {})}

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in values:
            raise KeyError(f"no value for template variable ${name} in {expr!r}")
        return values[name]

    return _VAR_RE.sub(repl, expr)


def text_of(value: JsonReadValue | None) -> str:
    """A string of the dashboard's model, empty where it has none."""
    return as_text(value) or ""


def _all_panels(dashboard: JsonReadObject) -> list[JsonReadObject]:
    out: list[JsonReadObject] = []
    for panel in as_objects(dashboard.get("panels")):
        out.append(panel)
        out.extend(as_objects(panel.get("panels")))  # panels inside a collapsed row
    return out


def panel_queries(panel: JsonReadObject, variables: Mapping[str, str] | None = None,
                  macros: Mapping[str, str] | None = None) -> list[PanelQuery]:
    """One panel's PromQL expressions, ready for /api/v1/query (none for a row)."""
    return [PanelQuery(text_of(panel.get("title")), text_of(target.get("refId")),
                       substitute(expr, variables, macros), text_of(target.get("legendFormat")),
                       bool(target.get("instant")) and not target.get("range", False))
            for target in as_objects(panel.get("targets")) if isinstance(expr := target.get("expr"), str)]


def annotation_queries(dashboard: JsonReadObject, variables: Mapping[str, str] | None = None,
                       macros: Mapping[str, str] | None = None) -> list[PanelQuery]:
    """The dashboard's annotations that run PromQL (the load phases' markers)."""
    return [PanelQuery(f"annotation: {text_of(a.get('name'))}", "annotation",
                       substitute(expr, variables, macros), text_of(a.get("titleFormat")))
            for a in as_objects(section(dashboard, "annotations").get("list"))
            if isinstance(expr := a.get("expr"), str)]


def dashboard_queries(dashboard: JsonReadObject | None = None,
                      variables: Mapping[str, str] | None = None,
                      macros: Mapping[str, str] | None = None) -> list[PanelQuery]:
    """Every PromQL expression in the dashboard's panels and annotations, ready for /api/v1/query."""
    board = dashboard if dashboard is not None else load_dashboard()
    panels = [q for panel in _all_panels(board) for q in panel_queries(panel, variables, macros)]
    return panels + annotation_queries(board, variables, macros)


def panels_in_order(dashboard: JsonReadObject | None = None) -> list[JsonReadObject]:
    """The dashboard's panels (rows included, a collapsed row's panels after it) in reading order."""
    return _all_panels(dashboard if dashboard is not None else load_dashboard())


_LEGEND_RE = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def legend_text(legend_format: str, labels: Mapping[str, str]) -> str:
    """A series' name as Grafana writes it: ``{{label}}`` replaced by the series' value of it (empty
    where it has none); no format: the labels as PromQL writes them."""
    if not legend_format:
        inner = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
        return f"{labels.get('__name__', '')}{{{inner}}}"
    return _LEGEND_RE.sub(lambda m: labels.get(m.group(1), ""), legend_format)


@dataclass(frozen=True, slots=True)
class PanelSeries:
    """One series a panel's query returned: its name (the legend format applied), the query's
    refId, its step times (Unix s) and values."""

    legend: str
    ref_id: str
    ts_s: np.ndarray
    values: np.ndarray


@dataclass(frozen=True, slots=True)
class PanelResult:
    """A panel (its JSON model) and what its queries returned over one time range."""

    panel: JsonReadObject
    series: tuple[PanelSeries, ...]


@dataclass(frozen=True, slots=True)
class PhaseMark:
    """An annotation: its title (the format applied) at a time (Unix s)."""

    title: str
    t_s: float


_LABEL_VALUES_RE = re.compile(r"^label_values\(\s*(?:(?P<metric>[^,]+?)\s*,\s*)?(?P<label>\w+)\s*\)$")


def variable_queries(dashboard: JsonReadObject | None = None) -> list[VariableQuery]:
    """The dashboard's label_values() variables as (label, series selector) for /api/v1/label."""
    board = dashboard if dashboard is not None else load_dashboard()
    out = []
    for var in as_objects(section(board, "templating").get("list")):
        query = var.get("query")
        promql = str(query.get("query", "")) if isinstance(query, Mapping) else str(query)
        m = _LABEL_VALUES_RE.match(promql.strip())
        if var.get("type") != "query" or m is None:
            raise ValueError(f"variable {var.get('name')!r}: not a label_values() query: {promql!r}")
        label = m.group("label")
        out.append(VariableQuery(text_of(var.get("name")), label, m.group("metric") or f'{{{label}!=""}}'))
    return out


_NAME_RE = re.compile(r"\bgputrace_\w+")


def metrics_used(dashboard: JsonReadObject | None = None) -> set[str]:
    """The gputrace metric names the dashboard's panels and variables read."""
    board = dashboard if dashboard is not None else load_dashboard()
    names = {n for q in dashboard_queries(board) for n in _NAME_RE.findall(q.expr)}
    names.update(n for v in variable_queries(board) for n in _NAME_RE.findall(v.match))
    return names


def load_dashboard(path: Path = DASHBOARD_PATH) -> JsonObject:
    loaded = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: not a dashboard (a JSON object)")
    return loaded


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate the gputrace Grafana dashboard JSON.")
    parser.add_argument("--write", type=Path, help="write the dashboard to this file")
    parser.add_argument("--check", type=Path, help="exit 1 when this file differs from the generated one")
    args = parser.parse_args(argv)
    text = render(build_dashboard())
    if args.check is not None:
        if args.check.read_text(encoding="utf-8") != text:
            print(f"{args.check}: differs from the generated dashboard; run "
                  f"python -m gputrace.dashboard --write {args.check}", file=sys.stderr)
            return 1
        return 0
    if args.write is not None:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
