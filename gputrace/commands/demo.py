"""`gputrace demo`: the whole chain against a simulated SGLang PP8 deployment, no GPU needed."""

from __future__ import annotations

import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from gputrace.analysis.result import Analysis
from gputrace.demo import DemoResult, run_demo
from gputrace.report.text_heatmap import text_heatmap


def _phase_rows(analysis: Analysis) -> dict[str, dict[str, float | None]]:
    """Per phase: the throughput and the mean bubble over the stages with one."""
    rows: dict[str, dict[str, float | None]] = {}
    for pm in analysis.metrics:
        bubbles = [st.bubble_fraction for st in pm.stages if st.bubble_fraction is not None]
        rows[pm.label] = {"tok_s": pm.throughput_tok_s,
                          "bubble": sum(bubbles) / len(bubbles) if bubbles else None}
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


RUN_TITLES = {"defaults": "defaults", "advised": "gputrace's advice", "k64": "K=64 (first try)"}


def summary_table(result: DemoResult) -> tuple[Table, dict[str, list[str]]]:
    """Per phase: each run's measured throughput beside what the model fitted to the defaults
    predicted for it (for the defaults, its replay as they ran), its bubble and its gain over the
    defaults; the findings that remain in each run."""
    rows = {run.label: _phase_rows(run.analysis) for run in result.runs}
    base = rows["defaults"]
    table = Table(title="gputrace demo: the motivating SGLang PP8 deployment (max_running_requests 64)")
    table.add_column("phase", justify="right")
    for run in result.runs:
        name = RUN_TITLES.get(run.label, run.label)
        table.add_column(f"{name} tok/s", justify="right")
        table.add_column("predicted" if run.label != "defaults" else "model as run", justify="right")
        table.add_column("bubble", justify="right")
        if run.label != "defaults":
            table.add_column("vs defaults", justify="right")
    for label in base:
        cells = [label]
        for run in result.runs:
            row = rows[run.label].get(label, {})
            predicted = result.predicted.get(run.label, {}).get(label)
            cells += [_fmt(row.get("tok_s"), ".0f"), _fmt(predicted, ".0f"), _fmt(row.get("bubble"), ".0%")]
            if run.label != "defaults":
                gain = _gain(base[label].get("tok_s"), row.get("tok_s"))
                cells.append(_fmt(gain, "+.0%"))
        table.add_row(*cells)
    remaining = {run.label: [f"{f.cause} [{f.phase}]" for f in run.analysis.findings]
                 for run in result.runs}
    return table, remaining


def _gain(before: float | None, after: float | None) -> float | None:
    return after / before - 1 if before and after else None


def advice_effect(result: DemoResult) -> list[str]:
    """The advice, and what it did per phase, measured beside predicted (or why the settings are
    kept, with the alternatives that trade)."""
    advice, run = result.advice, result.advised
    if advice is None:
        return ["gputrace's advice: none (the what-if model could not be fitted to the defaults)"]
    lines = [f"gputrace's advice: {advice.sentence()}"]
    if advice.keep or run is None:
        lines += [f"  alternative that trades: {alt.describe()}" for alt in advice.alternatives]
        return lines
    before, after = _phase_rows(result.defaults.analysis), _phase_rows(run.analysis)
    moves = []
    for p in advice.phases:
        gain = _gain(before.get(p.phase, {}).get("tok_s"), after.get(p.phase, {}).get("tok_s"))
        moves.append(f"{p.phase} {_fmt(gain, '+.0%')} (predicted {p.gain_ratio:+.0%} ±{p.band_ratio:.0%})")
    lines.append("applied, measured vs defaults: " + ", ".join(moves))
    return lines


@click.command("demo")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("demo-out"),
              show_default=True, help="Directory for the three runs, their reports and the comparisons.")
@click.option("--quick", is_flag=True, help="Shorter load levels: 4 s each, about 80 s in all.")
@click.option("--nodes", type=int, default=1, show_default=True,
              help="Run the PP8 engine over this many simulated nodes (each its own log and agent; "
                   "2: stages 0-3 and 4-7, as SGLang places them).")
def command(out: Path, quick: bool, nodes: int) -> None:
    """Run the whole chain on loopback against a simulated SGLang PP8 deployment: the simulator's
    OpenAI-compatible server, an agent with simulated GPUs, the collector and the load generator.
    Three runs: the defaults; gputrace's advice from the defaults' analysis, applied (unless it is
    to keep the settings: then it says why); and --pp-max-micro-batch-size 64 (the change people
    try first); then their comparisons."""
    console = Console(stderr=True)
    started = time.monotonic()
    result = run_demo(out, quick, lambda msg: console.print(msg, highlight=False), nodes)
    table, remaining = summary_table(result)
    out_console = Console(width=200)
    # the report's first screen, as text: the one answer, the busy heatmap, then the table
    effect = advice_effect(result)
    out_console.print(effect[0], style="bold", highlight=False)
    out_console.print("the defaults' busy share per stage over time:", highlight=False)
    for line in text_heatmap(result.defaults.analysis):
        out_console.print(line, highlight=False, markup=False)
    out_console.print(table)
    for line in effect[1:]:
        out_console.print(line)
    for run in result.runs:
        name = RUN_TITLES.get(run.label, run.label)
        out_console.print(f"findings, {name}: {', '.join(remaining[run.label]) or 'none'}")
    for run in result.runs:
        out_console.print(f"{run.label:>11} report: {run.report_dir / 'report.html'}")
    for path in result.comparisons:
        out_console.print(f"comparison: {path}")
    out_console.print(f"done in {time.monotonic() - started:.0f} s")
