"""`gputrace compare RUN_A RUN_B`: per matching phase, throughput, bubbles, findings resolved/new,
and where B changed A's deployment, the what-if model's prediction of B against B's measurement."""

from __future__ import annotations

import click

from gputrace.analyse import analyse_run
from gputrace.analysis.compare import RunRef, compare_analyses
from gputrace.commands.options.prometheus import window_ns
from gputrace.report.compare_render import render_compare_markdown, same_run_consequence, write_compare
from gputrace.report.render import parse_formats
from gputrace.store import Store
from gputrace.whatif.against import SCHEMA_KEY, predicted_against_measured


@click.command("compare")
@click.argument("run_a", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.argument("run_b", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=str), default=None,
              help="Write compare.{html,md,json} here (default: print Markdown only).")
@click.option("--format", "formats", default="html,md,json", show_default=True,
              help="Comma-separated: html, md, json (with --out).")
@click.option("--start-a", default=None, metavar="T",
              help="Compare only run A from T (ISO 8601 or epoch seconds; as report's --start).")
@click.option("--end-a", default=None, metavar="T", help="... until T.")
@click.option("--start-b", default=None, metavar="T", help="Compare only run B from T.")
@click.option("--end-b", default=None, metavar="T", help="... until T.")
@click.option("--predict/--no-predict", default=True, show_default=True,
              help="Where B's log states other settings than A's: fit the simulator to A (a few "
                   "seconds) and set its prediction of B beside B's measurement.")
def command(run_a: str, run_b: str, out_dir: str | None, formats: str, start_a: str | None,
            end_a: str | None, start_b: str | None, end_b: str | None, predict: bool) -> None:
    """Compare run B against run A (before/after) phase by phase.

    Each run can be cut to a window (--start-a/--end-a, --start-b/--end-b): a phase running at a
    window's start begins there. Where B applied a change to A's deployment (a recommendation of
    A's report, or any setting its log states otherwise), the simulator fitted to A predicts B,
    and the comparison sets predicted against measured.
    """
    fmts = parse_formats(formats)
    window_a = window_ns(start_a, end_a, ("--start-a", "--end-a"))
    window_b = window_ns(start_b, end_b, ("--start-b", "--end-b"))
    with Store.open(run_a, read_only=True) as sa:
        a = analyse_run(sa, window_a, effects=False)
        ref_a = RunRef(run_a, f"{sa.meta.name}@{sa.meta.created_ns}", window_a)
    with Store.open(run_b, read_only=True) as sb:
        b = analyse_run(sb, window_b, effects=False)
        ref_b = RunRef(run_b, f"{sb.meta.name}@{sb.meta.created_ns}", window_b)
    doc = compare_analyses(a, b, ref_a, ref_b)
    if predict and not doc["same_run"]:
        doc[SCHEMA_KEY] = predicted_against_measured(a, b, lambda m: click.echo(m, err=True))
    if doc["same_run"]:
        click.echo(f"warning: run A and run B are {doc['same_run']}: {same_run_consequence(doc)}",
                   err=True)
    click.echo(render_compare_markdown(doc), nl=False)
    if out_dir:
        for path in write_compare(doc, out_dir, fmts):
            click.echo(f"wrote {path}")
