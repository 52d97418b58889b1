"""Write the report: one self-contained report.html (figures inline as base64 PNG), report.md with
the PNGs beside it, and findings.json."""

from __future__ import annotations

import base64
import html
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gputrace.analysis.diagnose import changes_the_deployment
from gputrace.analysis.result import Analysis
from gputrace.errors import UsageError
from gputrace.report.document import STAGE_NOTE, build_document, fmt, stage_columns
from gputrace.report.figures import FIGURES

FORMATS = ("html", "md", "json")

CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
tr.phase-start td{border-top:2px solid #888}.note{color:#555;font-size:.9em}
.finding{border-left:4px solid #c33;padding:4px 10px;margin:8px 0;background:#fff6f6}
.verdict{font-size:1.15em;border-left:4px solid #36c;padding:6px 12px;background:#f4f8ff}
.ok{border-left:4px solid #393;padding:4px 10px;background:#f6fff6}code{background:#eee;padding:1px 3px}
img{max-width:100%;display:block;margin:6px 0 18px}"""


def render_figures(a: Analysis, progress: Callable[[str], None] | None = None) -> dict[str, bytes]:
    """name -> PNG bytes, in report order."""
    out = {}
    for name, (_, fn) in FIGURES.items():
        if progress:
            progress(f"figure {name}")
        out[name] = fn(a)
    return out


def _summary_lines(doc: dict[str, Any]) -> list[str]:
    s = doc["summary"]
    if s["sample_period_ms"] is None:
        period = f"no GPU samples (aligned on a {s['grid_period_ms']:.0f} ms grid)"
    else:
        period = f"sample period {s['sample_period_ms']:.0f} ms"
        if abs(s["grid_period_ms"] - s["sample_period_ms"]) > 0.1 * s["sample_period_ms"]:
            period += f" (aligned on a {s['grid_period_ms']:.0f} ms grid: NVML's utilization samples " \
                      "come between the ticks)"
    lines = [
        f"run {s['run']}: {s['gpus']} GPUs, PP{s['pp_size']} x TP{s['tp_size']}, "
        f"{s['duration_s']:.0f} s, {period}",
        f"stage mapping: {s['mapping_source']}",
        f"phases: {s['phase_source']}; engine work from: {s['work_source']}",
        f"log events placed by: {s['log_placement']}",
    ]
    eng = s.get("engine") or {}
    keys = ("max_running_requests", "pp_max_micro_batch_size", "pp_async_batch_depth", "decode_log_interval")
    if eng:
        def shown(key: str) -> object:
            value = eng.get(key)
            pool, pp = eng.get("max_running_requests"), s.get("pp_size")
            sglang = eng.get("engine") == "sglang"
            if key == "pp_max_micro_batch_size" and value is None and pool and pp and sglang:
                return f"default ({pool} // {pp} = {max(int(pool) // int(pp), 1)})"  # SGLang's rule
            return value
        lines.append("engine: " + ", ".join(f"{k}={shown(k)}" for k in keys))
    if s["clock_offsets"]:
        lines.append("clock offsets: " + ", ".join(
            f"{h} {o['offset_ms_last']:+.3f} ms" for h, o in s["clock_offsets"].items()))
    lines.extend(doc["notes"])
    return lines


PHASE_COLUMNS = (
    ("label", "phase"), ("target_concurrency", "C"), ("inflight_mean", "in flight"),
    ("throughput_tok_s", "tok/s"), ("throughput_source", "tok/s from"),
    ("client_throughput_tok_s", "client tok/s"),
    ("input_tok_s", "input tok/s"),
    ("requests_completed", "completed"), ("requests_failed", "failed"),
    ("unfinished_requests", "unfinished"), ("ttft_s_p50", "TTFT p50 s"), ("ttft_s_p90", "TTFT p90 s"),
    ("itl_s_mean", "ITL mean s"), ("itl_s_p90", "ITL p90 s"), ("allowed_busy_fraction", "allowed busy"),
)
"""(key, header) of the per-phase table: the load and what the requests got, once per phase."""


NO_MAPPING = "No GPU placements: the run has no GPU samples or topology (stages are the engine log's)."


def verdict(doc: dict[str, Any]) -> str:
    """The report's first paragraph: the top finding that a change to the deployment answers (else
    the top one) and that change, with its predicted effect where the what-if model gave one."""
    causes = [f for f in doc["findings"] if f["cause"] != "cannot_tell"]
    missing = [f for f in doc["findings"] if f["cause"] == "cannot_tell"]
    if causes:
        top = next((f for f in causes if changes_the_deployment((f.get("change") or {}).get("knob"))),
                   causes[0])
        where = "the whole run" if top["phase"] == "*" else f"phase {top['phase']}"
        text = (f"Verdict: {top['cause']} in {where}: {top['summary']}. Next step: "
                f"{top['recommendation']}.")
        if len(causes) > 1:
            text += f" {len(causes) - 1} more finding{'s' if len(causes) > 2 else ''} below."
    elif missing:
        text = "Verdict: no cause found in what the run holds, and it lacks data to look for some."
    else:
        text = "Verdict: no cause found: every phase is healthy."
    if missing:
        text += " " + " ".join(f"Note: {f['summary']} ({f['recommendation']})." for f in missing)
    return text


ADVICE_COLUMNS = (("phase", "phase"), ("measured_tok_s", "measured tok/s"),
                  ("unchanged_tok_s", "model as run tok/s"), ("predicted_tok_s", "predicted tok/s"),
                  ("gain", "gain"), ("band", "band"), ("ttft_s_p90", "TTFT p90 s"),
                  ("itl_s_p90", "ITL p90 s"))


def advice_sentence(doc: dict[str, Any]) -> str | None:
    """The advice's one sentence (None where the run has no advice)."""
    advice = doc.get("advice")
    return None if not advice else f"Advice: {advice['sentence']}"


def advice_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per phase: measured, the model as run, predicted under the advice, its gain and band."""
    rows = []
    for p in (doc.get("advice") or {}).get("phases", []):
        model = p.get("model_band_ratio")
        noisier = model is not None and p["band_ratio"] - model >= 0.01  # the phase's own spread added
        rows.append({**p, "gain": f"{p['gain_ratio']:+.0%}", "band": f"±{p['band_ratio']:.0%}"
                     + (f" (model ±{model:.0%})" if noisier else "")
                     + (" (extrapolated)" if p.get("extrapolation") else "")})
    return rows


def advice_notes(doc: dict[str, Any]) -> list[str]:
    """The alternatives that trade, and why a band is wide."""
    advice = doc.get("advice") or {}
    out = [f"Alternative: {a['text']}" for a in advice.get("alternatives", [])]
    out += sorted({p["extrapolation"] for p in advice.get("phases", []) if p.get("extrapolation")})
    return out


def _finding_text(f: dict[str, Any]) -> tuple[str, str, str]:
    head = f"{f['cause']} (phase {f['phase']}, stages {', '.join(map(str, f['stages']))}, " \
           f"confidence {f['confidence']:.2f})"
    ev = ", ".join(f"{k}={v}" for k, v in f["evidence"].items())
    return head, f["summary"], ev


def _html_table(columns: Sequence[tuple[str, str]], rows: Sequence[dict[str, Any]],
                group: str | None = None) -> str:
    """A table; with ``group``, that column's value is shown only where it changes (and the row
    starts a group)."""
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for _, h in columns)
    body = []
    for i, row in enumerate(rows):
        starts = group is not None and (i == 0 or rows[i - 1].get(group) != row.get(group))
        cells = "".join(f"<td>{'' if k == group and not starts else e(fmt(row.get(k), k))}</td>"
                        for k, _ in columns)
        body.append(f"<tr class='phase-start'>{cells}</tr>" if starts and i else f"<tr>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _md_table(columns: Sequence[tuple[str, str]], rows: Sequence[dict[str, Any]],
              group: str | None = None) -> list[str]:
    def cell(i: int, k: str) -> str:
        repeat = group == k and i and rows[i - 1].get(k) == rows[i].get(k)
        return "" if repeat else _md(fmt(rows[i].get(k), k))
    return ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(cell(i, k) for k, _ in columns) + " |" for i in range(len(rows)))]


def _stage_note(missing: Sequence[str], busy_from: str | None) -> str:
    note = f"Per stage only: {STAGE_NOTE}."
    if busy_from:
        note += f" Busy and bubble from {busy_from} on every stage."
    if missing:
        note += f" Not in this run: {', '.join(missing)}."
    return note


def render_html(a: Analysis, doc: dict[str, Any], figures: dict[str, bytes]) -> str:
    e = html.escape
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>gputrace report: "
             f"{e(doc['summary']['run'])}</title><style>{CSS}</style></head><body>",
             f"<h1>Bubble diagnosis: {e(doc['summary']['run'])}</h1>",
             *([f"<p class='verdict'>{e(sentence)}</p>", _html_table(ADVICE_COLUMNS, advice_rows(doc)),
                *(f"<p class='note'>{e(n)}</p>" for n in advice_notes(doc))]
               if (sentence := advice_sentence(doc)) else []),
             f"<p class='verdict'>{e(verdict(doc))}</p><h2>Summary</h2><ul>"]
    parts += [f"<li>{e(line)}</li>" for line in _summary_lines(doc)]
    parts.append("</ul><h2>Findings</h2>")
    if not doc["findings"]:
        parts.append("<div class='ok'>No finding: every phase is healthy.</div>")
    for f in doc["findings"]:
        head, summary, ev = _finding_text(f)
        parts.append(f"<div class='finding'><b>{e(head)}</b><br>{e(summary)}<br>"
                     f"<small>evidence: {e(ev)}</small><br>"
                     f"change: <code>{e(f['recommendation'])}</code></div>")
    parts.append("<h2>Phases</h2>" + _html_table(PHASE_COLUMNS, doc["phases"]))
    columns, missing, busy_from = stage_columns(doc["table"])
    parts.append("<h2>Phase by stage</h2>" + _html_table(columns, doc["table"], group="phase")
                 + f"<p class='note'>{e(_stage_note(missing, busy_from))}</p>")
    parts.append("<h2>Stage mapping</h2>")
    if doc["mapping"]:
        parts.append("<table><tr><th>host</th><th>gpu</th><th>pp_rank</th><th>tp_rank</th>"
                     "<th>dp_rank</th></tr>")
        for p in doc["mapping"]:
            parts.append(f"<tr><td>{e(p['host'])}</td><td>{p['gpu_index']}</td><td>{p['pp_rank']}</td>"
                         f"<td>{p['tp_rank']}</td><td>{p['dp_rank']}</td></tr>")
        parts.append("</table>")
    else:  # a table of headers alone says nothing
        parts.append(f"<p class='note'>{e(NO_MAPPING)}</p>")
    parts.append("<h2>Rules and thresholds</h2><table><tr><th>rule</th><th>checks</th></tr>")
    parts += [f"<tr><td>{e(r['rule'])}</td><td>{e(r['checks'])}</td></tr>" for r in doc["rules"]]
    parts.append("</table><table><tr><th>threshold</th><th>value</th></tr>")
    parts += [f"<tr><td>{e(k)}</td><td>{v}</td></tr>" for k, v in doc["thresholds"].items()]
    parts.append("</table>")
    parts.append("<h2>Figures</h2>")
    for name, png in figures.items():
        caption = FIGURES[name][0]
        parts.append(f"<h3>{e(caption)}</h3><img alt='{e(caption)}' id='fig-{name}' "
                     f"src='data:image/png;base64,{base64.b64encode(png).decode()}'>")
    parts.append("</body></html>")
    return "\n".join(parts)


# What Markdown would read as HTML: a `<` that opens a tag, comment or declaration (CommonMark's
# raw HTML), an `&` that starts an entity. Only these are escaped, so the text reads as written in
# the .md file itself: "1062 -> 1282 tok/s" and "C<=32" stay as they are (they showed as -&gt;).
_MD_HTML = re.compile(r"<(?=[A-Za-z/!?])|&(?=#?[A-Za-z0-9]+;)")


def _md(text: object) -> str:
    """Text from the run (names, labels, notes) as Markdown that renders as that text: HTML in it
    would be live in most Markdown viewers, a | would cut a table cell."""
    escaped = _MD_HTML.sub(lambda m: "&lt;" if m.group() == "<" else "&amp;", str(text))
    return escaped.replace("|", "\\|").replace("\n", " ")


def _md_code(text: object) -> str:
    """Text for a `code span`: a backtick would end it."""
    return str(text).replace("`", "'").replace("\n", " ")


def render_markdown(a: Analysis, doc: dict[str, Any], figure_files: dict[str, str]) -> str:
    out = [f"# Bubble diagnosis: {_md(doc['summary']['run'])}", ""]
    sentence = advice_sentence(doc)
    if sentence:
        out += [_md(sentence), "", *_md_table(ADVICE_COLUMNS, advice_rows(doc)), ""]
        out += [f"- {_md(n)}" for n in advice_notes(doc)]
        out += [""] if advice_notes(doc) else []
    out += [_md(verdict(doc)), "", "## Summary", ""]
    out += [f"- {_md(line)}" for line in _summary_lines(doc)]
    out += ["", "## Findings", ""]
    if not doc["findings"]:
        out.append("No finding: every phase is healthy.")
    for f in doc["findings"]:
        head, summary, ev = _finding_text(f)
        out += [f"- **{_md(head)}**: {_md(summary)}  ", f"  evidence: {_md(ev)}  ",
                f"  change: `{_md_code(f['recommendation'])}`"]
    out += ["", "## Phases", "", *_md_table(PHASE_COLUMNS, doc["phases"])]
    columns, missing, busy_from = stage_columns(doc["table"])
    out += ["", "## Phase by stage", "", *_md_table(columns, doc["table"], group="phase"), "",
            _md(_stage_note(missing, busy_from))]
    out += ["", "## Stage mapping", ""]
    if doc["mapping"]:
        out += ["| host | gpu | pp_rank | tp_rank | dp_rank |", "|---|---|---|---|---|"]
        out += [f"| {_md(p['host'])} | {p['gpu_index']} | {p['pp_rank']} | {p['tp_rank']} | "
                f"{p['dp_rank']} |" for p in doc["mapping"]]
    else:
        out += [NO_MAPPING]
    out += ["", "## Rules and thresholds", "", "| rule | checks |", "|---|---|"]
    out += [f"| {_md(r['rule'])} | {_md(r['checks'])} |" for r in doc["rules"]]
    out += ["", "| threshold | value |", "|---|---|"]
    out += [f"| {_md(k)} | {v} |" for k, v in doc["thresholds"].items()]
    out += ["", "## Figures", ""]
    for name, file in figure_files.items():
        out += [f"### {FIGURES[name][0]}", "", f"![{FIGURES[name][0]}]({file})", ""]
    return "\n".join(out) + "\n"


def parse_formats(spec: str | Sequence[str]) -> list[str]:
    """'html,md' -> ['html', 'md']; unknown names are a usage error."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    fmts = [f.strip().lower() for f in items if f.strip()]
    fmts = ["md" if f == "markdown" else f for f in fmts]
    bad = [f for f in fmts if f not in FORMATS]
    if bad or not fmts:
        raise UsageError(f"--format: unknown {', '.join(bad) or 'empty'}; choose from {', '.join(FORMATS)}")
    return fmts


def write_report(a: Analysis, out_dir: str | Path, formats: Sequence[str] = FORMATS,
                 progress: Callable[[str], None] | None = None) -> list[Path]:
    """Write the chosen formats into ``out_dir``; returns the files written. Where the analysis
    has advice, the reports open with it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = build_document(a)
    written: list[Path] = []
    if "json" in formats:
        (out / "findings.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
        written.append(out / "findings.json")
    if "html" in formats or "md" in formats:
        figures = render_figures(a, progress)
        if "html" in formats:
            (out / "report.html").write_text(render_html(a, doc, figures))
            written.append(out / "report.html")
        if "md" in formats:
            files = {}
            for name, png in figures.items():
                (out / f"{name}.png").write_bytes(png)
                files[name] = f"{name}.png"
                written.append(out / f"{name}.png")
            (out / "report.md").write_text(render_markdown(a, doc, files))
            written.append(out / "report.md")
    return written
