"""Write the report: one self-contained report.html (figures inline as base64 PNG), report.md with
the PNGs beside it, and findings.json."""

from __future__ import annotations

import base64
import html
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from gputrace.analysis.diagnose import Finding, changes_the_deployment, rule_table
from gputrace.analysis.predicted import PredictedEffect, cannot_predict, predictable
from gputrace.analysis.result import Analysis
from gputrace.engines import engine_words
from gputrace.errors import UsageError
from gputrace.report.document import (
    STAGE_NOTE,
    Cell,
    TableRow,
    advice_of,
    build_document,
    fmt,
    phase_stage_table,
    stage_columns,
)
from gputrace.report.figures import FIGURES, FIRST_SCREEN
from gputrace.whatif.advise import PhaseAdvice

FORMATS = ("html", "md", "json")

CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;padding:3px 4px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
tr.phase-start td{border-top:2px solid #888}.note{color:#555;font-size:.9em}
.finding{border-left:4px solid #c33;padding:4px 10px;margin:8px 0;background:#fff6f6}
.answer{font-size:1.2em;font-weight:600;border-left:5px solid #36c;padding:8px 14px;background:#f4f8ff;
margin:.4em 0}
.missing{border-left:4px solid #d80;padding:4px 10px;background:#fff8e6;font-size:.92em}
.would{color:#444}h1{margin:.2em 0 .3em;font-size:1.6em}details{margin:6px 0}
summary{cursor:pointer;font-weight:600}
.ok{border-left:4px solid #393;padding:4px 10px;background:#f6fff6}code{background:#eee;padding:1px 3px}
img{max-width:100%;display:block;margin:4px 0 10px}"""


def render_figures(a: Analysis, progress: Callable[[str], None] | None = None) -> dict[str, bytes]:
    """name -> PNG bytes, in report order."""
    out = {}
    for name, (_, fn) in FIGURES.items():
        if progress:
            progress(f"figure {name}")
        out[name] = fn(a)
    return out


# The settings the summary's engine line shows, where the run's engine has them.
ENGINE_LINE_SETTINGS = ("max_running_requests", "pp_max_micro_batch_size", "pp_async_batch_depth",
                        "chunked_prefill_size", "decode_log_interval")


def _summary_lines(a: Analysis) -> list[str]:
    s = a.summary()
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
    if eng:
        # the settings the run's engine has, by its own names
        words = engine_words(eng.get("engine"))
        keys = [k for k in ENGINE_LINE_SETTINGS if words.flag(k)]

        def shown(key: str) -> object:
            value = eng.get(key)
            pool, pp = eng.get("max_running_requests"), s.get("pp_size")
            knob = words.knob_named(key)
            default = None if value is not None or knob is None else knob.default_for({**eng, "pp_size": pp})
            if key == "pp_max_micro_batch_size" and default is not None:
                return f"default ({pool} // {pp} = {default})"  # SGLang's rule, as its knob gives it
            return value
        lines.append("engine: " + ", ".join(f"{words.setting(k)}={shown(k)}" for k in keys))
    if s["clock_offsets"]:
        lines.append("clock offsets: " + ", ".join(
            f"{h} {o['offset_ms_last']:+.3f} ms" for h, o in s["clock_offsets"].items()))
    lines.extend(a.notes)
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


def _where(phase: str) -> str:
    return "the whole run" if phase == "*" else f"phase {phase}"


def verdict(a: Analysis) -> str:
    """The report's one sentence where the run has no advice (the what-if model could not be
    fitted): the top finding that a change to the deployment answers (else the top one) and what
    its change is, or that no cause was found."""
    causes = [f for f in a.findings if f.cause != "cannot_tell"]
    if causes:
        top = next((f for f in causes if changes_the_deployment(f.change.flag if f.change else None)),
                   causes[0])
        return (f"No advice (the what-if model could not be fitted to this run); the top finding, "
                f"{top.cause} in {_where(top.phase)}: {top.summary}; its change: "
                f"{a.recommendation_of(top)}.")
    if any(f.cause == "cannot_tell" for f in a.findings):
        return "No cause found in what the run holds, and it lacks data to look for some (below)."
    return "No cause found: every phase is healthy."


def answer(a: Analysis) -> str:
    """The report's first sentence and its one recommendation: the advice (a change, or keep with
    its reason and the best trade-off), else the verdict of the findings."""
    advice = advice_of(a)
    return f"Advice: {advice.sentence()}" if advice else verdict(a)


def missing_data(a: Analysis) -> str | None:
    """What the run lacks and the source that would give it on this run's engine and hosts, said
    once (the cannot_tell findings, one remedy each), or None."""
    missing = [f for f in a.findings if f.cause == "cannot_tell"]
    if not missing:
        return None
    return "Missing from this run: " + " ".join(
        f"{f.summary} ({_where(f.phase)}); to get it: {a.recommendation_of(f)}." for f in missing)


ADVICE_COLUMNS = (("unchanged_tok_s", "model as run tok/s"), ("predicted_tok_s", "predicted tok/s"),
                  ("gain", "gain"), ("band", "band"), ("predicted_ttft_s_p90", "predicted TTFT p90 s"),
                  ("predicted_itl_s_p90", "predicted ITL p90 s"))
"""The advice's columns of the per-phase table, after the measured tok/s; where the advice is to
keep the settings, the model as run and the band alone (a prediction equal to it says nothing)."""


def advice_cells(p: PhaseAdvice) -> dict[str, Cell]:
    """A phase under the advice, as its table cells: the model as run, predicted, gain and band."""
    model = p.model_band_ratio
    noisier = model is not None and p.band_ratio - model >= 0.01  # the phase's own spread added
    if not predictable(p.decision_band_ratio):
        return {"unchanged_tok_s": p.unchanged_tok_s, "gain": "cannot predict",
                "band": f"±{p.decision_band_ratio:.0%} (wider than predictions are stated)"}
    return {"unchanged_tok_s": p.unchanged_tok_s, "predicted_tok_s": p.predicted_tok_s,
            "gain": f"{p.gain_ratio:+.0%}",
            "band": f"±{p.band_ratio:.0%}" + (f" (model ±{model:.0%})" if noisier else "")
            + (" (extrapolated)" if p.extrapolation else ""),
            "predicted_ttft_s_p90": p.ttft_s_p90, "predicted_itl_s_p90": p.itl_s_p90}


def phase_table(a: Analysis) -> tuple[list[tuple[str, str]], list[TableRow]]:
    """The per-phase table: the load and what the requests got, with the advice's prediction beside
    the measured tok/s (columns with no value in any row left out)."""
    advice = advice_of(a)
    by_phase = {p.phase: advice_cells(p) for p in advice.phases} if advice else {}
    rows: list[TableRow] = [{**by_phase.get(pm.label, {}), **{k: getattr(pm, k) for k, _ in PHASE_COLUMNS}}
                            for pm in a.metrics]
    extra = [c for c in ADVICE_COLUMNS if advice.changes or c[0] in ("unchanged_tok_s", "band")
             ] if advice else []
    at = [k for k, _ in PHASE_COLUMNS].index("throughput_tok_s") + 1
    columns = [*PHASE_COLUMNS[:at], *extra, *PHASE_COLUMNS[at:]]
    keep = [c for c in columns if c[0] == "label" or any(r.get(c[0]) is not None for r in rows)]
    return keep, rows


def advice_notes(a: Analysis) -> list[str]:
    """The alternatives that trade, and why a band is wide."""
    advice = advice_of(a)
    if advice is None:
        return []
    out = [f"Alternative that trades: {option.describe()}" for option in advice.alternatives]
    out += sorted({p.extrapolation for p in advice.phases if p.extrapolation})
    return out


def _stage_label(stages: Sequence[int]) -> str:
    return f"stage {stages[0]}" if len(stages) == 1 else f"stages {', '.join(map(str, stages))}"


def finding_cost(a: Analysis, f: Finding) -> str | None:
    """What a finding costs, from the phase-by-stage figures: its stages' mean bubble in its phase
    (the share of the phase they idled while requests were there)."""
    bubbles = [st.bubble_fraction for pm in a.metrics if f.phase in ("*", pm.label) for st in pm.stages
               if st.pp_rank in f.stages and st.bubble_fraction is not None]
    if not bubbles:
        return None
    bubble = sum(bubbles) / len(bubbles)
    return (f"{_stage_label(f.stages)} idled {bubble:.0%} of {_where(f.phase)} "
            "while requests were running or waiting")


def finding_effect(pred: PredictedEffect | None) -> str | None:
    """What a finding's own change would do per phase (the what-if's ``predicted``): measured ->
    predicted tok/s at its phase with the band, and at every other phase; None where not predicted."""
    if pred is None:
        return None
    if not predictable(pred.band_ratio):
        return f"C={pred.concurrency}: {cannot_predict(pred.band_ratio)}"
    cells = [(pred.concurrency, pred.measured_tok_s, pred.predicted_tok_s)]
    cells += [(o.concurrency, o.measured_tok_s, o.predicted_tok_s) for o in pred.other_phases]
    parts = [f"C={c} {m:.0f} -> {p:.0f} tok/s ({p / m - 1:+.0%})" if m else f"C={c} n/a"
             for c, m, p in sorted(cells)]
    text = ", ".join(parts) + f" (band ±{pred.band_ratio:.0%})"
    if pred.within_uncertainty:
        text += f"; at C={pred.concurrency} inside the model's uncertainty: no clear gain"
    return text


def _finding_text(a: Analysis, f: Finding) -> tuple[str, str, str, str | None]:
    """(head, summary, evidence, what its change would do): its own change as its analysis states
    it (without the prediction, which is shown per phase)."""
    head = f"{f.cause} (phase {f.phase}, {_stage_label(f.stages)}, " \
           f"confidence {f.confidence:.2f})"
    ev = ", ".join(f"{k}={v}" for k, v in f.evidence.items())
    effect = finding_effect(a.effect_of(f))
    would = f.recommendation + (f": {effect}" if effect else " (not predicted)")
    return head, f.summary, ev, would


def evidence_findings(a: Analysis) -> list[Finding]:
    """The findings that are causes (what the run lacks is said once, under the answer)."""
    return [f for f in a.findings if f.cause != "cannot_tell"]


def _html_table(columns: Sequence[tuple[str, str]], rows: Sequence[TableRow],
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


def _md_table(columns: Sequence[tuple[str, str]], rows: Sequence[TableRow],
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


def _img(name: str, png: bytes) -> str:
    caption = html.escape(FIGURES[name][0])
    return (f"<img alt='{caption}' title='{caption}' id='fig-{name}' "
            f"src='data:image/png;base64,{base64.b64encode(png).decode()}'>")


def render_html(a: Analysis, figures: dict[str, bytes]) -> str:
    """The page: the one-sentence answer, the busy heatmap and the per-phase throughput chart
    (the first screen), the per-phase table, the findings as the evidence, the other figures,
    and folded below, the run's details, the phase-by-stage table, mapping, rules and thresholds."""
    e = html.escape
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>gputrace report: "
             f"{e(a.run.name)}</title><style>{CSS}</style></head><body>",
             f"<h1>Bubble diagnosis: {e(a.run.name)}</h1>",
             "<section class='first-screen'>",
             f"<p class='answer'>{e(answer(a))}</p>"]
    if (lacking := missing_data(a)) is not None:
        parts.append(f"<p class='missing'>{e(lacking)}</p>")
    parts += [_img(name, figures[name]) for name in FIRST_SCREEN if name in figures]
    parts.append("</section>")
    columns, rows = phase_table(a)
    parts.append("<h2>Per phase</h2>" + _html_table(columns, rows))
    parts += [f"<p class='note'>{e(n)}</p>" for n in advice_notes(a)]
    parts.append("<h2>Findings: the evidence</h2>")
    findings = evidence_findings(a)
    if not findings:
        parts.append("<div class='ok'>No cause found in any phase.</div>")
    for f in findings:
        head, summary, ev, would = _finding_text(a, f)
        cost = finding_cost(a, f)
        parts.append(f"<div class='finding'><b>{e(head)}</b><br>{e(summary)}<br>"
                     + (f"costs: {e(cost)}<br>" if cost else "")
                     + f"<small>evidence: {e(ev)}</small>"
                     + (f"<br><span class='would'>what its change would do: {e(would)}</span>"
                        if would else "") + "</div>")
    rest = [name for name in figures if name not in FIRST_SCREEN]
    if rest:
        parts.append("<h2>Figures</h2>")
        parts += [f"<h3>{e(FIGURES[name][0])}</h3>{_img(name, figures[name])}" for name in rest]
    parts.append("<h2>Details</h2><details><summary>The run: sources, mapping rule, clocks, notes"
                 "</summary><ul>")
    parts += [f"<li>{e(line)}</li>" for line in _summary_lines(a)]
    parts.append("</ul></details>")
    table = phase_stage_table(a)
    columns, missing, busy_from = stage_columns(table)
    parts.append("<details><summary>Phase by stage</summary>"
                 + _html_table(columns, table, group="phase")
                 + f"<p class='note'>{e(_stage_note(missing, busy_from))}</p></details>")
    parts.append("<details><summary>Stage mapping</summary>")
    if a.run.mapping.placements:
        parts.append("<table><tr><th>host</th><th>gpu</th><th>pp_rank</th><th>tp_rank</th>"
                     "<th>dp_rank</th></tr>")
        for p in a.run.mapping.placements:
            parts.append(f"<tr><td>{e(p.host)}</td><td>{p.gpu_index}</td><td>{p.pp_rank}</td>"
                         f"<td>{p.tp_rank}</td><td>{p.dp_rank}</td></tr>")
        parts.append("</table>")
    else:  # a table of headers alone says nothing
        parts.append(f"<p class='note'>{e(NO_MAPPING)}</p>")
    parts.append("</details><details><summary>Rules and thresholds</summary>"
                 "<table><tr><th>rule</th><th>checks</th></tr>")
    parts += [f"<tr><td>{e(rule)}</td><td>{e(checks)}</td></tr>"
              for rule, checks in rule_table(a.run.engine.kind)]
    parts.append("</table><table><tr><th>threshold</th><th>value</th></tr>")
    parts += [f"<tr><td>{e(k)}</td><td>{v}</td></tr>" for k, v in asdict(a.thresholds).items()]
    parts.append("</table></details></body></html>")
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


def render_markdown(a: Analysis, figure_files: dict[str, str]) -> str:
    """report.md in the page's order: the answer, the two first-screen figures, the per-phase
    table, the findings as the evidence, the other figures, and the details folded."""
    out = [f"# Bubble diagnosis: {_md(a.run.name)}", "", f"**{_md(answer(a))}**", ""]
    if (lacking := missing_data(a)) is not None:
        out += [_md(lacking), ""]
    for name in FIRST_SCREEN:
        if name in figure_files:
            out += [f"![{FIGURES[name][0]}]({figure_files[name]})", ""]
    columns, rows = phase_table(a)
    out += ["## Per phase", "", *_md_table(columns, rows), ""]
    out += [f"- {_md(n)}" for n in advice_notes(a)]
    out += ["", "## Findings: the evidence", ""]
    findings = evidence_findings(a)
    if not findings:
        out.append("No cause found in any phase.")
    for f in findings:
        head, summary, ev, would = _finding_text(a, f)
        cost = finding_cost(a, f)
        out += [f"- **{_md(head)}**: {_md(summary)}  "]
        out += [f"  costs: {_md(cost)}  "] if cost else []
        out += [f"  evidence: {_md(ev)}" + ("  " if would else "")]
        out += [f"  what its change would do: {_md(would)}"] if would else []
    rest = [name for name in figure_files if name not in FIRST_SCREEN]
    if rest:
        out += ["", "## Figures", ""]
        for name in rest:
            out += [f"### {FIGURES[name][0]}", "", f"![{FIGURES[name][0]}]({figure_files[name]})", ""]
    out += ["", "## Details", "", "<details><summary>The run: sources, mapping rule, clocks, notes</summary>",
            ""]
    out += [f"- {_md(line)}" for line in _summary_lines(a)]
    table = phase_stage_table(a)
    columns, missing, busy_from = stage_columns(table)
    out += ["", "</details>", "", "<details><summary>Phase by stage</summary>", "",
            *_md_table(columns, table, group="phase"), "", _md(_stage_note(missing, busy_from)),
            "", "</details>", "", "<details><summary>Stage mapping</summary>", ""]
    if a.run.mapping.placements:
        out += ["| host | gpu | pp_rank | tp_rank | dp_rank |", "|---|---|---|---|---|"]
        out += [f"| {_md(p.host)} | {p.gpu_index} | {p.pp_rank} | {p.tp_rank} | "
                f"{p.dp_rank} |" for p in a.run.mapping.placements]
    else:
        out += [NO_MAPPING]
    out += ["", "</details>", "", "<details><summary>Rules and thresholds</summary>", "",
            "| rule | checks |", "|---|---|"]
    out += [f"| {_md(rule)} | {_md(checks)} |" for rule, checks in rule_table(a.run.engine.kind)]
    out += ["", "| threshold | value |", "|---|---|"]
    out += [f"| {_md(k)} | {v} |" for k, v in asdict(a.thresholds).items()]
    out += ["", "</details>"]
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
    written: list[Path] = []
    if "json" in formats:
        (out / "findings.json").write_text(json.dumps(build_document(a), indent=2, default=str) + "\n")
        written.append(out / "findings.json")
    if "html" in formats or "md" in formats:
        figures = render_figures(a, progress)
        if "html" in formats:
            (out / "report.html").write_text(render_html(a, figures))
            written.append(out / "report.html")
        if "md" in formats:
            files = {}
            for name, png in figures.items():
                (out / f"{name}.png").write_bytes(png)
                files[name] = f"{name}.png"
                written.append(out / f"{name}.png")
            (out / "report.md").write_text(render_markdown(a, files))
            written.append(out / "report.md")
    return written
