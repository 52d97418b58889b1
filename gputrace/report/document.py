"""The report's content as plain data: summary, findings, the phase-by-stage table, the stage
mapping. ``findings.json`` is exactly this document (schema ``gputrace.findings/1``)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from gputrace.analysis.diagnose import Finding
from gputrace.analysis.run import Analysis

SCHEMA = "gputrace.findings/1"

TABLE_COLUMNS = (
    ("phase", "phase"), ("pp_rank", "stage"), ("busy_fraction", "busy"),
    ("bubble_fraction", "bubble"), ("utilization_p50", "util p50"), ("utilization_p90", "util p90"),
    ("microbatch_size_mean", "#running (mean)"), ("microbatch_size_max", "#running (max)"),
    ("offered_load", "offered"), ("queue_req_mean", "queue"), ("token_usage_max", "token usage max"),
    ("power_w_mean", "power W"), ("power_limit_share_mean", "power/limit"),
    ("pcie_tx_bytes_per_s_mean", "PCIe TX B/s"), ("pcie_rx_bytes_per_s_mean", "PCIe RX B/s"),
    ("pcie_link_share_p95", "PCIe/link p95"), ("allowed_busy_fraction", "allowed busy"),
    ("throughput_tok_s", "tok/s"),
)
"""(key, header) of the phase-by-stage table, in display order."""


def phase_stage_table(a: Analysis) -> list[dict[str, Any]]:
    """One row per (phase, stage)."""
    rows = []
    for pm in a.metrics:
        offered = pm.inflight_mean if pm.inflight_mean is not None else pm.target_concurrency
        for st in pm.stages:
            row = {"phase": pm.label, **asdict(st), "offered_load": offered,
                   "target_concurrency": pm.target_concurrency,
                   "allowed_busy_fraction": pm.allowed_busy_fraction,
                   "throughput_tok_s": pm.throughput_tok_s}
            rows.append(row)
    return rows


def finding_entry(f: Finding) -> dict[str, Any]:
    """A finding as findings.json gives it: ``change`` is the setting it names (knob and value,
    the value None where it is not one number), for tools that apply or compare it."""
    entry = {k: v for k, v in f.to_dict().items() if k not in ("impact", "details")}
    if f.details.get("knob"):
        entry["change"] = {"knob": f.details["knob"], "value": f.details.get("value")}
    return entry


def build_document(a: Analysis) -> dict[str, Any]:
    """The findings.json document."""
    return {
        "schema": SCHEMA,
        "summary": a.summary(),
        "findings": [finding_entry(f) for f in a.findings],
        "phases": [{k: v for k, v in pm.to_dict().items() if k != "stages"} for pm in a.metrics],
        "table": phase_stage_table(a),
        "mapping": [asdict(p) for p in a.run.mapping.placements],
        "notes": a.notes,
    }


def fmt(value: Any, key: str = "") -> str:
    """A table cell: fractions as percent, bytes/s in SI, None as n/a."""
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if key.endswith("fraction") or key.endswith("share_mean") or key.endswith("share_p95") \
                or key.startswith("utilization"):
            return f"{value:.1%}"
        if key.endswith("bytes_per_s_mean"):
            for unit, div in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
                if abs(value) >= div:
                    return f"{value / div:.2f} {unit}"
            return f"{value:.0f} B/s"
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)
