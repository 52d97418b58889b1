"""Render a comparison document as HTML (self-contained), Markdown and JSON."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from gputrace.report.render import CSS


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _num(x: float | None, nd: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def _rows(doc: dict[str, Any]) -> list[list[str]]:
    rows = []
    for p in doc["phases"]:
        gain = p["throughput_gain"]
        rows.append([
            p["label"], _num(p["throughput_tok_s_a"]), _num(p["throughput_tok_s_b"]),
            "n/a" if gain is None else f"x{gain:.2f}",
            " ".join(_pct(x) for x in p["bubble_fraction_a"]),
            " ".join(_pct(x) for x in p["bubble_fraction_b"]),
            ", ".join(p["findings_resolved"]) or "-", ", ".join(p["findings_new"]) or "-",
        ])
    return rows


HEADERS = ["phase", "tok/s A", "tok/s B", "gain", "bubble per stage A", "bubble per stage B",
           "resolved", "new"]


def render_compare_markdown(doc: dict[str, Any]) -> str:
    out = [f"# Comparison: {doc['run_a']} (A) vs {doc['run_b']} (B)", "",
           "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    out += ["| " + " | ".join(r) + " |" for r in _rows(doc)]
    out += ["", f"Run-wide findings resolved: {', '.join(doc['run_findings_resolved']) or '-'}; "
                f"new: {', '.join(doc['run_findings_new']) or '-'}"]
    if doc["unmatched_a"] or doc["unmatched_b"]:
        out.append(f"Phases only in A: {', '.join(doc['unmatched_a']) or '-'}; "
                   f"only in B: {', '.join(doc['unmatched_b']) or '-'}")
    return "\n".join(out) + "\n"


def render_compare_html(doc: dict[str, Any]) -> str:
    e = html.escape
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>gputrace compare</title>"
             f"<style>{CSS}</style></head><body><h1>Comparison: {e(doc['run_a'])} (A) vs "
             f"{e(doc['run_b'])} (B)</h1><table><tr>"]
    parts += [f"<th>{e(h)}</th>" for h in HEADERS]
    parts.append("</tr>")
    parts += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in _rows(doc)]
    resolved = ", ".join(doc["run_findings_resolved"]) or "-"
    new = ", ".join(doc["run_findings_new"]) or "-"
    parts.append(f"</table><p>Run-wide findings resolved: {e(resolved)}; new: {e(new)}</p></body></html>")
    return "\n".join(parts)


def write_compare(doc: dict[str, Any], out_dir: str | Path, formats: list[str]) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if "json" in formats:
        (out / "compare.json").write_text(json.dumps(doc, indent=2) + "\n")
        written.append(out / "compare.json")
    if "md" in formats:
        (out / "compare.md").write_text(render_compare_markdown(doc))
        written.append(out / "compare.md")
    if "html" in formats:
        (out / "compare.html").write_text(render_compare_html(doc))
        written.append(out / "compare.html")
    return written
