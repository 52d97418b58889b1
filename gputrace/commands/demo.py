"""`gputrace demo`: the whole chain against a simulated SGLang PP8 deployment, no GPU needed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from gputrace.demo import DemoRun, findings_of, run_demo


def _phase_rows(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for phase in doc.get("phases", []):
        bubbles = [r["bubble_fraction"] for r in doc.get("table", [])
                   if r.get("phase") == phase.get("label") and r.get("bubble_fraction") is not None]
        rows[phase["label"]] = {"tok_s": phase.get("throughput_tok_s"),
                                "bubble": sum(bubbles) / len(bubbles) if bubbles else None}
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def summary_table(cap: DemoRun, fixed: DemoRun) -> tuple[Table, list[str], list[str]]:
    cap_doc, fixed_doc = findings_of(cap), findings_of(fixed)
    a, b = _phase_rows(cap_doc), _phase_rows(fixed_doc)
    table = Table(title="gputrace demo: SGLang PP8, default micro-batch cap vs --pp-max-micro-batch-size 64")
    for col in ("phase", "cap tok/s", "cap bubble", "fixed tok/s", "fixed bubble", "gain"):
        table.add_column(col, justify="right")
    for label in [p for p in a if p in b] or list(a):
        ra, rb = a[label], b.get(label, {})
        gain = (rb["tok_s"] / ra["tok_s"]) if ra.get("tok_s") and rb.get("tok_s") else None
        table.add_row(label, _fmt(ra.get("tok_s"), ".0f"), _fmt(ra.get("bubble"), ".0%"),
                      _fmt(rb.get("tok_s"), ".0f"), _fmt(rb.get("bubble"), ".0%"),
                      _fmt(gain, ".2f") + ("x" if gain else ""))
    causes = [f"{f['cause']} [{f['phase']}]" for f in cap_doc.get("findings", [])]
    fixed_causes = [f"{f['cause']} [{f['phase']}]" for f in fixed_doc.get("findings", [])]
    return table, causes, fixed_causes


@click.command("demo")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("demo-out"),
              show_default=True, help="Directory for both runs, their reports and the comparison.")
@click.option("--quick", is_flag=True, help="Shorter load levels: 4 s each, about 50 s in all.")
def command(out: Path, quick: bool) -> None:
    """Run the whole chain on loopback against a simulated SGLang PP8 deployment: the simulator's
    OpenAI-compatible server, an agent with simulated GPUs, the collector and the load generator,
    twice (default micro-batch cap, then the fix), then both reports and their comparison."""
    console = Console(stderr=True)
    started = time.monotonic()
    cap, fixed, compare_dir = run_demo(out, quick, lambda msg: console.print(msg, highlight=False))
    table, causes, fixed_causes = summary_table(cap, fixed)
    out_console = Console()
    out_console.print(table)
    out_console.print(f"findings with the default cap: {', '.join(causes) or 'none'}")
    out_console.print(f"findings after the fix:        {', '.join(fixed_causes) or 'none'}")
    for run in (cap, fixed):
        out_console.print(f"{run.label:>6} report: {run.report_dir / 'report.html'}")
    out_console.print(f"comparison:    {compare_dir}")
    out_console.print(f"done in {time.monotonic() - started:.0f} s")
