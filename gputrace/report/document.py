"""The report's content as plain data: summary, findings, the phase-by-stage table, the stage
mapping. ``findings.json`` is exactly this document (schema ``gputrace.findings/1``); the pages
render the same analysis from its typed records, and the tables from rows of cells."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import TypeAlias

from gputrace.analysis.diagnose import Finding, rule_table
from gputrace.analysis.predicted import PredictedEffect
from gputrace.analysis.result import Analysis
from gputrace.json_types import JsonObject, JsonValue
from gputrace.whatif.advise import Advice

SCHEMA = "gputrace.findings/1"

STAGE_COLUMNS = (
    ("phase", "phase"), ("pp_rank", "stage"), ("busy_fraction", "busy"),
    ("bubble_fraction", "bubble"), ("busy_signal", "busy from"), ("microbatch_size_mean", "#running mean"),
    ("microbatch_size_max", "#running max"), ("queue_req_mean", "queue"), ("power_w_mean", "power W"),
    ("power_limit_share_mean", "power/limit"), ("pcie_link_share_p95", "PCIe/link p95"),
    ("throttled_fraction", "throttled"),
)
"""(key, header) of the report's phase-by-stage table, in display order: only what differs from
stage to stage (the per-phase values are in the phases table; every per-stage value, these and
the rest, is in findings.json's ``table``). A field added to StageMetrics reaches that JSON by
itself, and the report with one more pair here."""

STAGE_NOTE = ("load, throughput and allowed busy are per phase (the Phases table); utilization "
              "percentiles, token usage, PCIe bytes/s and clocks per stage are in findings.json (table)")
"""Said under the phase-by-stage table: where the values it leaves out are."""

Cell: TypeAlias = str | int | float | bool | None
"""One value of a table, shown by ``fmt`` (None: n/a)."""
TableRow: TypeAlias = Mapping[str, Cell]
"""A row of a report table: its cells by column key (the first item of a column's pair)."""


def advice_of(a: Analysis) -> Advice | None:
    """The run's advice as the advisor made it (``Analysis.advice`` names only its ``to_dict``, the
    analysis layer being below the advisor's); None where it has none (no what-if fit)."""
    return a.advice if isinstance(a.advice, Advice) else None


def shown_columns(columns: tuple[tuple[str, str], ...], rows: Sequence[TableRow]
                  ) -> tuple[list[tuple[str, str]], list[str]]:
    """(the columns with a value in some row, the headers of those with none): a run without GPU
    samples has no power or PCIe, and a column of n/a says nothing."""
    keep = [c for c in columns
            if c[0] in ("phase", "pp_rank") or any(row.get(c[0]) is not None for row in rows)]
    return keep, [h for k, h in columns if (k, h) not in keep]


def stage_columns(rows: Sequence[TableRow]) -> tuple[list[tuple[str, str]], list[str], str | None]:
    """The report's phase-by-stage columns: those with a value (and the headers left out), with
    the busy signal said once (the third item) where every stage's busy came from the same one
    (a column repeating it on every row, wrapped to three lines, tripled the table's height)."""
    columns, missing = shown_columns(STAGE_COLUMNS, rows)
    signals = {row.get("busy_signal") for row in rows} - {None}
    if len(signals) != 1:
        return columns, missing, None
    return [c for c in columns if c[0] != "busy_signal"], missing, str(signals.pop())


def phase_stage_table(a: Analysis) -> list[dict[str, Cell]]:
    """One row per (phase, stage): every StageMetrics figure (each a number, a word or None) and
    the phase's load, throughput and allowed busy."""
    rows = []
    for pm in a.metrics:
        offered = pm.inflight_mean if pm.inflight_mean is not None else pm.target_concurrency
        for st in pm.stages:
            row: dict[str, Cell] = {"phase": pm.label, **asdict(st), "offered_load": offered,
                   "target_concurrency": pm.target_concurrency,
                   "allowed_busy_fraction": pm.allowed_busy_fraction,
                   "throughput_tok_s": pm.throughput_tok_s}
            if st.busy_fraction is None:  # no busy figure: it came from no signal
                row["busy_signal"] = None
            rows.append(row)
    return rows


def finding_entry(f: Finding, effect: PredictedEffect | None = None) -> JsonObject:
    """A finding as findings.json gives it: ``change`` is the setting it names (knob and value,
    the value None where it is not one number), for tools that apply or compare it; ``predicted``
    the what-if model's effect of that change (``Analysis.effects``), also said in the
    recommendation."""
    entry: JsonObject = {k: v for k, v in f.to_dict().items() if k not in ("impact", "details", "change")}
    if effect is not None:
        entry["recommendation"] = f"{f.recommendation}; {effect.text()}"
    if f.change is not None:
        change = f.change.to_finding_dict()
        entry["change"] = {"knob": change["knob"], "value": change["value"]}
    if effect is not None:
        entry["predicted"] = effect.to_dict()
    return entry


def build_document(a: Analysis) -> JsonObject:
    """The findings.json document (``advice`` only where the analysis has one)."""
    table: list[JsonValue] = [{**row} for row in phase_stage_table(a)]
    doc: JsonObject = {
        "schema": SCHEMA,
        "summary": a.summary(),
        "findings": [finding_entry(f, a.effect_of(f)) for f in a.findings],
        "phases": [{k: v for k, v in pm.to_dict().items() if k != "stages"} for pm in a.metrics],
        "table": table,
        "mapping": [asdict(p) for p in a.run.mapping.placements],
        "notes": list(a.notes),
        # the rules in the order they are tried and the thresholds they were applied with
        "rules": [{"rule": name, "checks": text} for name, text in rule_table(a.run.engine.kind)],
        "thresholds": asdict(a.thresholds),
    }
    if a.advice is not None:
        doc["advice"] = {**a.advice.to_dict()}
    return doc


def fmt(value: Cell, key: str = "") -> str:
    """A table cell: fractions as percent, bytes/s in SI, None as n/a."""
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if key.endswith("fraction") or key.endswith("share_mean") or key.endswith("share_p95") \
                or key.startswith("utilization"):
            if 1e-6 <= abs(value) < 0.0005:  # a link 0.035 % used is not "0.0%"
                return f"{value * 100:.2g}%"
            return f"{value:.1%}"
        if key.endswith("bytes_per_s_mean"):
            for unit, div in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
                if abs(value) >= div:
                    return f"{value / div:.2f} {unit}"
            return f"{value:.0f} B/s"
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)
