"""`gputrace export RUN --parquet DIR | --perfetto FILE.json`: tables as Parquet, or a trace."""

from __future__ import annotations

import click

from gputrace.analyse import analyse_run
from gputrace.errors import UsageError
from gputrace.report.perfetto import write_trace
from gputrace.store import Store


@click.command("export")
@click.argument("run", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.option("--parquet", "parquet_dir", type=click.Path(file_okay=False, path_type=str), default=None,
              help="Write one <table>.parquet per store table into this directory.")
@click.option("--perfetto", "perfetto_file", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Write a Chrome/Perfetto trace JSON (counter tracks per stage, phase slices).")
def command(run: str, parquet_dir: str | None, perfetto_file: str | None) -> None:
    """Export a run for other tools."""
    if not parquet_dir and not perfetto_file:
        raise UsageError("export: give --parquet DIR and/or --perfetto FILE.json")
    with Store.open(run, read_only=True) as store:
        if parquet_dir:
            for path in store.export_parquet(parquet_dir):
                click.echo(f"wrote {path}")
        if perfetto_file:
            click.echo(f"wrote {write_trace(analyse_run(store, effects=False), perfetto_file)}")
