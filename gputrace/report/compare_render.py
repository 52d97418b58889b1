"""Render a comparison document as HTML (self-contained), Markdown and JSON: a warning when both
sides are one run, the bottom line (better, worse or a trade-off, per phase with the prediction
beside the measurement), what the change resolved and introduced and what it did to throughput in words,
both runs' key figures side by side, and links to both reports."""

from __future__ import annotations

import base64
import html
import json
import os
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

from gputrace.analysis.compare import SAME_WITHIN
from gputrace.json_types import JsonReadObject
from gputrace.report.compare_figure import compare_figure
from gputrace.report.comparison import Comparison, FindingWords, Prediction

FIGURE_CAPTION = "A beside B: throughput per phase (B predicted from A, where it was), busy per stage"

CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;font-size:13px;margin:6px 0 14px}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f3f3f3}
td:first-child,th:first-child{text-align:left}
.warning{border-left:4px solid #d80;padding:6px 12px;background:#fff8e6;font-weight:bold}
.resolved{border-left:4px solid #393;padding:4px 10px;margin:6px 0;background:#f6fff6}
.new{border-left:4px solid #c33;padding:4px 10px;margin:6px 0;background:#fff6f6}
table.runs td,table.runs th{text-align:left}
.bottom{font-size:1.25em;font-weight:bold;border-left:4px solid #36c;padding:6px 12px;background:#f3f7ff}
ul.phases{margin-top:4px}li.better{color:#1a7f37}li.worse{color:#c33;font-weight:bold}
img{max-width:100%;display:block;margin:4px 0 10px}"""
"""Only what the page uses: each class here is on some element of it."""


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _num(x: float | None, nd: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def _gain(x: float | None) -> str:
    return "n/a" if x is None else f"x{x:.2f}"


def same_run_consequence(doc: JsonReadObject) -> str:
    """What a comparison of a run with itself can show."""
    return _same_run_consequence(Comparison.read(doc))


def _same_run_consequence(c: Comparison) -> str:
    if "different windows" in (c.same_run or ""):
        return "any difference comes from the windows compared, not from a change"
    return "nothing can differ between them; compare a run before a change with one after it"


def _where(phase: str) -> str:
    return "the whole run" if phase == "*" else f"phase {phase}"


def change_lines(c: Comparison) -> list[tuple[str, str]]:
    """(kind, sentence) per finding resolved ('resolved') or introduced ('new') by B, in words."""
    out = []
    groups = [(p.resolved, p.new) for p in c.phases] + [(c.run_resolved, c.run_new)]
    for resolved, new in groups:
        out += [("resolved", f"Resolved in {_where(f.phase)}: {f.cause} (run A: {f.summary}).")
                for f in resolved]
        out += [("new", f"New in {_where(f.phase)}: {f.cause} (run B: {f.summary}; "
                        f"change: {f.recommendation}).") for f in new]
    return sorted(out, key=lambda kv: kv[0] != "resolved")  # resolved first, each in phase order


def bottom_line_text(c: Comparison) -> str:
    """The page's first sentence (older documents have none: said from their gains)."""
    return c.bottom_line or "No bottom line in this comparison document."


def phase_verdict_lines(c: Comparison) -> list[str]:
    """Per phase: better, worse or the same, by how much, and what the what-if model predicted for
    B from A where it did."""
    predicted = {ph.label: ph for ph in c.prediction.phases} if c.prediction else {}
    out = []
    for p in c.phases:
        gain = p.throughput_gain
        if gain is None:
            out.append(f"{p.label}: no throughput in one of the runs")
            continue
        verdict = p.verdict or ("better" if gain > 1 + SAME_WITHIN else
                                "worse" if gain < 1 - SAME_WITHIN else "same")
        text = (f"{p.label}: {verdict}, {_num(p.throughput_tok_s_a, 0)} -> "
                f"{_num(p.throughput_tok_s_b, 0)} tok/s ({gain - 1:+.0%} measured")
        ph = predicted.get(p.label)
        if ph and ph.predicted_tok_s is not None and ph.measured_a_tok_s:
            text += f", {ph.predicted_tok_s / ph.measured_a_tok_s - 1:+.0%} predicted from A"
        out.append(text + ")")
    return out




def throughput_line(c: Comparison) -> str | None:
    """B's throughput against A's in words, per phase that moved (a regression stood only in
    the table's gain column)."""
    gains = [(p.label, p.throughput_gain) for p in c.phases if p.throughput_gain is not None]
    if not gains:
        return None
    moved = [f"{label} {_gain(g)}" for label, g in gains if abs(g - 1) > SAME_WITHIN]
    alike = len(gains) - len(moved)
    if not moved:
        return f"Throughput: B within {SAME_WITHIN:.0%} of A in every phase."
    text = "Throughput, B against A: " + ", ".join(moved)
    if alike:
        others = "the other phase" if alike == 1 else f"the other {alike} phases"
        text += f"; {others} within {SAME_WITHIN:.0%}"
    return text + "."


PREDICTION_HEADERS = ["phase", "tok/s A (measured)", "B predicted", "B measured", "error", "inside the band"]


def prediction_lines(pam: Prediction) -> list[str]:
    """What B changed, who recommended it and the band; or why there is no prediction."""
    if pam.note:
        return [f"Prediction: {pam.note}."]
    changed = ", ".join(f"{ch.setting} {'default' if ch.value_a is None else ch.value_a} -> "
                        f"{'default' if ch.value_b is None else ch.value_b}" for ch in pam.changes)
    band = "n/a" if pam.band_ratio is None else f"{pam.band_ratio:.0%}"
    out = [f"B changed {changed}; the simulator fitted to A predicts B within ±{band} (the fit's residual)."]
    out += [f"Recommended by A's {f.cause} in {_where(f.phase)}: {f.recommendation}"
            for f in pam.recommended_by]
    if not pam.recommended_by:
        out.append("No finding of A recommended this change.")
    return out


def _prediction_rows(pam: Prediction) -> list[list[str]]:
    rows = []
    for ph in pam.phases:
        err = ph.error
        rows.append([ph.label, _num(ph.measured_a_tok_s), _num(ph.predicted_tok_s),
                     _num(ph.measured_b_tok_s), "n/a" if err is None else f"{err:+.1%}",
                     "n/a" if ph.within_band is None else ("yes" if ph.within_band else "no")])
    return rows


def _top(f: FindingWords | None) -> str:
    if f is None:
        return "none: no cause found"
    return f"{f.cause} in {_where(f.phase)}: {f.summary}"


PHASE_HEADERS = ["phase", "tok/s A", "tok/s B", "gain", "bubble A", "bubble B", "TTFT p50 A s",
                 "TTFT p50 B s", "resolved", "new"]


def _has_bubble(c: Comparison) -> bool:
    return any(v is not None for p in c.phases for v in (p.bubble_fraction_mean_a, p.bubble_fraction_mean_b))


def _phase_table(c: Comparison) -> tuple[list[str], list[list[str]]]:
    """(headers, rows) of the per-phase table; without a bubble figure in either run (no GPU
    samples) the two bubble columns go (the footer says so): columns of n/a say nothing."""
    rows = [[p.label, _num(p.throughput_tok_s_a), _num(p.throughput_tok_s_b),
             _gain(p.throughput_gain), _pct(p.bubble_fraction_mean_a),
             _pct(p.bubble_fraction_mean_b), _num(p.ttft_s_p50_a, 3), _num(p.ttft_s_p50_b, 3),
             ", ".join(p.findings_resolved) or "-", ", ".join(p.findings_new) or "-"]
            for p in c.phases]
    if _has_bubble(c):
        return PHASE_HEADERS, rows
    keep = [i for i, h in enumerate(PHASE_HEADERS) if not h.startswith("bubble")]
    return [PHASE_HEADERS[i] for i in keep], [[r[i] for i in keep] for r in rows]


def _report_path(run_dir: str | None) -> Path | None:
    return Path(run_dir) / "report" / "report.html" if run_dir else None


def _run_rows(c: Comparison) -> list[tuple[str, str, str]]:
    return [("run", c.run_a, c.run_b),
            ("directory", c.run_a_dir or "n/a", c.run_b_dir or "n/a"),
            ("top finding", _top(c.top_finding_a), _top(c.top_finding_b))]


def _footer(c: Comparison) -> list[str]:
    out = []
    if c.unmatched_a or c.unmatched_b:
        out.append(f"Phases only in A: {', '.join(c.unmatched_a) or '-'}; "
                   f"only in B: {', '.join(c.unmatched_b) or '-'} (compared by label).")
    out.append("Bubble: the mean over the stages; per stage in compare.json." if _has_bubble(c) else
               "Bubble: not in either run (no GPU samples).")
    return out


def _md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def render_compare_markdown(doc: JsonReadObject, figure_file: str | None = None) -> str:
    """compare.md (and what `compare` prints): the bottom line, the figure A beside B where
    ``figure_file`` names it, then the tables."""
    c = Comparison.read(doc)
    out = [f"# Comparison: {c.run_a} (A) vs {c.run_b} (B)", ""]
    if c.same_run:
        out += [f"**Warning: run A and run B are {c.same_run}: {_same_run_consequence(c)}.**", ""]
    out += [f"**{bottom_line_text(c)}**", "", *[f"- {line}" for line in phase_verdict_lines(c)], ""]
    if figure_file:
        out += [f"![{FIGURE_CAPTION}]({figure_file})", ""]
    out += ["## What changed", ""]
    changes = change_lines(c)
    out += [f"- {text}" for _, text in changes] or ["No finding resolved or new."]
    throughput = throughput_line(c)
    if throughput:
        out += ["", throughput]
    out += ["", _md_row(["", "A", "B"]), "|---|---|---|"]
    out += [_md_row(r) for r in _run_rows(c)]
    for label, run_dir in (("A", c.run_a_dir), ("B", c.run_b_dir)):
        report = _report_path(run_dir)
        if report is not None:
            out.append(f"\nReport {label}: {report}" + ("" if report.exists() else " (not written yet)"))
    headers, rows = _phase_table(c)
    out += ["", _md_row(headers), "|" + "---|" * len(headers)]
    out += [_md_row(r) for r in rows]
    if c.prediction is not None:
        out += ["", "## Predicted against measured", "", *prediction_lines(c.prediction)]
        predicted = _prediction_rows(c.prediction)
        if predicted:
            out += ["", _md_row(PREDICTION_HEADERS), "|" + "---|" * len(PREDICTION_HEADERS)]
            out += [_md_row(r) for r in predicted]
    out += ["", *_footer(c)]
    return "\n".join(out) + "\n"


def _link(run_dir: str | None, out_dir: Path | None) -> str:
    e = html.escape
    report = _report_path(run_dir)
    if report is None:
        return "n/a"
    if not report.exists():
        return f"no report yet: <code>gputrace report {e(str(run_dir))}</code>"
    href = quote(Path(os.path.relpath(report.resolve(), out_dir.resolve())).as_posix()) if out_dir \
        else report.resolve().as_uri()
    return f"<a href='{e(href)}'>{e(str(report))}</a>"


def render_compare_html(doc: JsonReadObject, out_dir: str | Path | None = None,
                        figure: bytes | None = None) -> str:
    """The page; links to the reports are relative to ``out_dir`` (where the page is written);
    ``figure``, A beside B, under the bottom line."""
    e = html.escape
    c = Comparison.read(doc)
    where = Path(out_dir) if out_dir is not None else None
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>gputrace compare: "
             f"{e(c.run_a)} vs {e(c.run_b)}</title><style>{CSS}</style></head><body>"
             f"<h1>Comparison: {e(c.run_a)} (A) vs {e(c.run_b)} (B)</h1>"]
    if c.same_run:
        parts.append(f"<p class='warning'>Warning: run A and run B are {e(c.same_run)}: "
                     f"{e(_same_run_consequence(c))}.</p>")
    parts.append(f"<p class='bottom'>{e(bottom_line_text(c))}</p><ul class='phases'>")
    for p, line in zip(c.phases, phase_verdict_lines(c), strict=True):
        verdict = p.verdict
        parts.append(f"<li class='{verdict}'>{e(line)}</li>" if verdict in ("better", "worse") else
                     f"<li>{e(line)}</li>")
    parts.append("</ul>")
    if figure is not None:
        parts.append(f"<img alt='{e(FIGURE_CAPTION)}' id='fig-compare' "
                     f"src='data:image/png;base64,{base64.b64encode(figure).decode()}'>")
    parts.append("<h2>What changed</h2>")
    changes = change_lines(c)
    parts += [f"<p class='{kind}'>{e(text)}</p>" for kind, text in changes] or \
        ["<p>No finding resolved or new.</p>"]
    throughput = throughput_line(c)
    if throughput:
        parts.append(f"<p>{e(throughput)}</p>")
    parts.append("<h2>The two runs</h2><table class='runs'><tr><th></th><th>A</th><th>B</th></tr>")
    parts += [f"<tr><td>{e(k)}</td><td>{e(va)}</td><td>{e(vb)}</td></tr>" for k, va, vb in _run_rows(c)]
    parts.append(f"<tr><td>report</td><td>{_link(c.run_a_dir, where)}</td>"
                 f"<td>{_link(c.run_b_dir, where)}</td></tr></table>")
    headers, rows = _phase_table(c)
    parts.append("<h2>Per phase</h2><table><tr>" + "".join(f"<th>{e(h)}</th>" for h in headers) + "</tr>")
    parts += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows]
    parts.append("</table>")
    if c.prediction is not None:
        parts.append("<h2>Predicted against measured</h2>")
        parts += [f"<p>{e(line)}</p>" for line in prediction_lines(c.prediction)]
        predicted = _prediction_rows(c.prediction)
        if predicted:
            parts.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in PREDICTION_HEADERS) + "</tr>")
            parts += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in predicted]
            parts.append("</table>")
    parts += [f"<p>{e(line)}</p>" for line in _footer(c)]
    parts.append("</body></html>")
    return "\n".join(parts)


def write_compare(doc: JsonReadObject, out_dir: str | Path, formats: list[str]) -> list[Path]:
    """compare.json (the document as given), compare.md with compare.png beside it, compare.html."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if "json" in formats:
        (out / "compare.json").write_text(json.dumps(doc, indent=2) + "\n")
        written.append(out / "compare.json")
    figure = compare_figure(doc) if "md" in formats or "html" in formats else None
    if "md" in formats and figure is not None:
        (out / "compare.png").write_bytes(figure)
        (out / "compare.md").write_text(render_compare_markdown(doc, "compare.png"))
        written += [out / "compare.png", out / "compare.md"]
    if "html" in formats:
        (out / "compare.html").write_text(render_compare_html(doc, out, figure))
        written.append(out / "compare.html")
    return written
