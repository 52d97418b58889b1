"""`gputrace compare RUN_A RUN_B`: per matching phase, throughput, bubbles, findings resolved/new."""

from __future__ import annotations

import click

from gputrace.analysis.compare import compare_analyses
from gputrace.analysis.run import analyse_store
from gputrace.report.compare_render import render_compare_markdown, write_compare
from gputrace.report.render import parse_formats
from gputrace.store import Store


@click.command("compare")
@click.argument("run_a", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.argument("run_b", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=str), default=None,
              help="Write compare.{html,md,json} here (default: print Markdown only).")
@click.option("--format", "formats", default="html,md,json", show_default=True,
              help="Comma-separated: html, md, json (with --out).")
def command(run_a: str, run_b: str, out_dir: str | None, formats: str) -> None:
    """Compare run B against run A (before/after) phase by phase."""
    fmts = parse_formats(formats)
    with Store.open(run_a, read_only=True) as sa:
        a = analyse_store(sa)
    with Store.open(run_b, read_only=True) as sb:
        b = analyse_store(sb)
    doc = compare_analyses(a, b)
    click.echo(render_compare_markdown(doc), nl=False)
    if out_dir:
        for path in write_compare(doc, out_dir, fmts):
            click.echo(f"wrote {path}")
