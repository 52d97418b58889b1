"""`gputrace panels --prometheus URL`: the Grafana dashboard's panels rendered as PNGs from what
that Prometheus returns for their queries (no Grafana needed)."""

from __future__ import annotations

import time
from pathlib import Path

import click

from gputrace.commands.options.prometheus import parse_window_ms
from gputrace.errors import UsageError
from gputrace.imports.prometheus import parse_step_ms, scrape_interval_ms
from gputrace.prometheus.client import PrometheusClient
from gputrace.prometheus.panels import query_panels, query_phase_marks
from gputrace.report.panels import write_panels

# enough points per series for a panel 1,300 px wide, as Grafana picks its step from the width
MAX_STEPS = 600


@click.command("panels")
@click.option("--prometheus", "prometheus_url", required=True, metavar="URL",
              help="The Prometheus that scrapes the agents and the collector.")
@click.option("--start", default=None,
              help="From this time: RFC 3339 or unix seconds (default: --last before --end).")
@click.option("--end", default=None, help="Up to this time: RFC 3339 or unix seconds (default: now).")
@click.option("--last", default="15m", show_default=True, help="Without --start: this long before the end.")
@click.option("--step", default="auto", show_default=True,
              help="Query resolution, e.g. 1s; auto: the scrape interval, coarser when the range "
                   f"needs more than {MAX_STEPS} steps.")
@click.option("--run", "run_name", default=".*", show_default=True, help="The $run variable (a regex).")
@click.option("--host", default=".*", show_default=True, help="The $host variable (a regex).")
@click.option("--out", "out_dir", default="panels", show_default=True, type=click.Path(file_okay=False),
              help="Where the PNGs and index.html go.")
def command(prometheus_url: str, start: str | None, end: str | None, last: str, step: str, run_name: str,
            host: str, out_dir: str) -> None:
    """Render the Grafana dashboard's panels from a Prometheus, one PNG each, and index.html."""
    start_ms, end_ms = parse_window_ms(start, end)
    end_ms = end_ms if end_ms is not None else int(time.time() * 1000)
    if start_ms is None:
        start_ms = end_ms - parse_step_ms(last)
    if end_ms <= start_ms:
        raise UsageError(f"--end is not after --start ({start_ms / 1000:.0f} to {end_ms / 1000:.0f})")
    client = PrometheusClient(prometheus_url)
    if step == "auto":
        step_ms = max(scrape_interval_ms(client) or 1000, -(-(end_ms - start_ms) // MAX_STEPS))
    else:
        step_ms = parse_step_ms(step)
    variables = {"run": run_name, "host": host}
    results = query_panels(client, start_ms, end_ms, step_ms, variables)
    marks = query_phase_marks(client, start_ms, end_ms, step_ms, variables)
    rendered = write_panels(results, marks, Path(out_dir), start_ms / 1000, end_ms / 1000, step_ms / 1000)
    for r in rendered:
        click.echo(f"{r.title}: {r.series} series, {r.points} points -> {r.path}")
    empty = [r.title for r in rendered if not r.points]
    click.echo(f"{len(rendered)} panels ({len(rendered) - len(empty)} with data), {len(marks)} phase marks, "
               f"from {client.queries} range queries at a {step_ms / 1000:g} s step; "
               f"open {Path(out_dir) / 'index.html'}")
    if empty:
        click.echo(f"no data: {', '.join(empty)}")
