"""`gputrace demo`: the whole chain against a simulated SGLang PP8 deployment, no GPU needed."""

from __future__ import annotations

import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from gputrace.analysis.result import Analysis
from gputrace.demo import FIRST_TRY, DemoResult, measured_tok_s, phase_tok_s, run_demo
from gputrace.engines import engine_words
from gputrace.report.text_heatmap import text_heatmap
from gputrace.sim.calibration import CONFLICTING, TOLERANCE


def _phase_rows(analysis: Analysis, speed: float) -> dict[str, dict[str, float | None]]:
    """Per phase: the throughput in the deployment's time and the mean bubble over the stages."""
    rows: dict[str, dict[str, float | None]] = {}
    for pm in analysis.metrics:
        bubbles = [st.bubble_fraction for st in pm.stages if st.bubble_fraction is not None]
        tok_s = measured_tok_s(analysis, pm)
        rows[pm.label] = {"tok_s": None if tok_s is None else tok_s / speed,
                          "bubble": sum(bubbles) / len(bubbles) if bubbles else None}
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _scaled(value: float | None, speed: float) -> float | None:
    return None if value is None else value / speed


RUN_TITLES = {"defaults": "defaults", "advised": "gputrace's advice"}


def figures_table(result: DemoResult) -> Table:
    """Each figure measured on the motivating deployment beside the demo's, within 15 % or not
    (of the two C=32 K=64 figures that cannot both hold, the better counts, as the calibration's)."""
    table = Table(title="the motivating deployment's figures (Kimi K2.6, SGLang PP8 on 8 PCIe GPUs, "
                        "bursts of C prompts of 1,024 tokens) beside the demo's")
    for name in ("figure", "measured tok/s", "demo tok/s", "demo / measured", "within 15 %"):
        table.add_column(name, justify="right")
    for row in result.figures:
        ratio = row.ratio
        ok = None if ratio is None else abs(ratio - 1) <= TOLERANCE
        verdict = "n/a" if ok is None else "yes" if ok else "no"
        if row.figure.label in CONFLICTING:
            verdict += " (pair: the better counts)"
        table.add_row(row.figure.label.replace(" tok", " tokens"), f"{row.figure.measured_tok_s:.1f}",
                      _fmt(row.demo_tok_s, ".1f"), _fmt(ratio, ".2f"), verdict)
    return table


def summary_table(result: DemoResult) -> tuple[Table, dict[str, list[str]]]:
    """Per phase of the defaults' levels: the defaults and the advice applied, measured beside what
    the model fitted to the defaults predicted (for the defaults, its replay as they ran), the
    bubble and the gain; the findings that remain in each run."""
    speed = result.speed
    runs = [r for r in result.runs if r.label in RUN_TITLES]
    rows = {run.label: _phase_rows(run.analysis, speed) for run in runs}
    base = rows["defaults"]
    table = Table(title="the defaults and gputrace's advice, in the deployment's time")
    table.add_column("phase", justify="right")
    for run in runs:
        name = RUN_TITLES[run.label]
        table.add_column(f"{name} tok/s", justify="right")
        table.add_column("predicted" if run.label != "defaults" else "model as run", justify="right")
        table.add_column("bubble", justify="right")
        if run.label != "defaults":
            table.add_column("vs defaults", justify="right")
    for label in base:
        cells = [label]
        for run in runs:
            row = rows[run.label].get(label, {})
            predicted = _scaled(result.predicted.get(run.label, {}).get(label), speed)
            cells += [_fmt(row.get("tok_s"), ".0f"), _fmt(predicted, ".0f"), _fmt(row.get("bubble"), ".0%")]
            if run.label != "defaults":
                cells.append(_fmt(_gain(base[label].get("tok_s"), row.get("tok_s")), "+.0%"))
        table.add_row(*cells)
    remaining = {run.label: [f"{f.cause} [{f.phase}]" for f in run.analysis.findings]
                 for run in result.runs}
    return table, remaining


def _gain(before: float | None, after: float | None) -> float | None:
    return after / before - 1 if before and after else None


def first_try_line(result: DemoResult) -> str | None:
    """What the model fitted to the defaults predicts of K=64 at the defaults' busiest level,
    beside what the deployment measured."""
    predicted = result.predicted.get("k64", {})
    replayed = phase_tok_s(result.defaults)  # measured: the predictions are its figures x the model's effect
    levels = [label for label in predicted if label in replayed and predicted[label] and replayed[label]]
    if not levels:
        return None
    top = max(levels, key=lambda label: int(label.removeprefix("C=")))
    before, after = _scaled(replayed[top], result.speed), _scaled(predicted[top], result.speed)
    assert before is not None and after is not None
    k = FIRST_TRY["pp_max_micro_batch_size"]
    flag = engine_words(None).flag("pp_max_micro_batch_size")  # the demo's engine: SGLang
    line = (f"{flag} {k} (what the engineer tried first), predicted from the defaults' "
            f"run: {top} {before:.0f} -> {after:.0f} tok/s ({after / before - 1:+.0%}) for bursts sent at "
            f"once, as the calibration takes the deployment's: K does not bind where the prefill budget "
            f"sets the micro-batches (the deployment measured 248 -> 250.9)")
    as_sent = _scaled(result.predicted.get("k64_as_sent", {}).get(top), result.speed)
    if as_sent is not None:
        line += (f"; as this demo's client sent them (over a few ms: the engine's first prefill turn "
                 f"takes the first request alone, and K={k} lets the next turn add the budget's 8 to "
                 f"its micro-batch) {before:.0f} -> {as_sent:.0f} ({as_sent / before - 1:+.0%})")
    return line


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
    before = _phase_rows(result.defaults.analysis, result.speed)
    after = _phase_rows(run.analysis, result.speed)
    moves = []
    for p in advice.phases:
        gain = _gain(before.get(p.phase, {}).get("tok_s"), after.get(p.phase, {}).get("tok_s"))
        moves.append(f"{p.phase} {_fmt(gain, '+.0%')} (predicted {p.gain_ratio:+.0%} ±{p.band_ratio:.0%})")
    lines.append("applied, measured vs defaults: " + ", ".join(moves))
    return lines


@click.command("demo")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("demo-out"),
              show_default=True, help="Directory for the three runs, their reports and the comparisons.")
@click.option("--quick", is_flag=True,
              help="Of the first try's figures, C=32 K=64 alone (4,096 tokens).")
@click.option("--nodes", type=int, default=1, show_default=True,
              help="Run the PP8 engine over this many simulated nodes (each its own log and agent; "
                   "2: stages 0-3 and 4-7, as SGLang places them).")
def command(out: Path, quick: bool, nodes: int) -> None:
    """Run the whole chain on loopback against the simulated motivating deployment (SGLang PP8,
    its calibrated cost, bursts of 1,024-token prompts, time scaled): the simulator's
    OpenAI-compatible server, an agent with simulated GPUs, the collector and the load generator.
    The runs: the defaults; gputrace's advice from the defaults' analysis, applied (unless it is
    to keep the settings: then it says why); and --pp-max-micro-batch-size 64 (the change the
    engineer tried first) where it was measured; each measured figure beside the demo's."""
    console = Console(stderr=True)
    started = time.monotonic()
    result = run_demo(out, quick, lambda msg: console.print(msg, highlight=False, markup=False), nodes)
    table, remaining = summary_table(result)
    out_console = Console(width=200)
    # the report's first screen, as text: the cause in the engine's words, what K=64 would do,
    # the one answer, the busy heatmap, then the tables
    cause = result.cause()
    # one line each, however wide (the first line is the cause, whole)
    out_console.print(f"Cause: {cause}" if cause else "Cause: no finding names a setting", style="bold",
                      highlight=False, markup=False, soft_wrap=True)
    first_try = first_try_line(result)
    if first_try:
        out_console.print(first_try, highlight=False, markup=False, soft_wrap=True)
    effect = advice_effect(result)
    out_console.print(effect[0], style="bold", highlight=False, markup=False, soft_wrap=True)
    out_console.print(f"time scaled: the live runs' simulated engine ran {result.speed:g}x the wall clock "
                      f"(their reports' tok/s are {result.speed:g}x); the first tries ran on the "
                      "simulator's own clock; every tok/s below is in the deployment's time", highlight=False)
    out_console.print("the defaults' busy share per stage over time:", highlight=False)
    for line in text_heatmap(result.defaults.analysis):
        out_console.print(line, highlight=False, markup=False)
    out_console.print(figures_table(result))
    out_console.print(table)
    for line in effect[1:]:
        out_console.print(line, highlight=False, markup=False)
    for run in result.runs:
        found = ", ".join(remaining[run.label]) or "none"
        out_console.print(f"findings, {run.label}: {found}", highlight=False)
    for run in result.runs:
        out_console.print(f"{run.label:>11} report: {run.report_dir / 'report.html'}")
    for path in result.comparisons:
        out_console.print(f"comparison: {path}")
    out_console.print(f"done in {time.monotonic() - started:.0f} s")
