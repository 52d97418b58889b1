"""`gputrace import --run DIR ...`: write records from files made elsewhere into a run store.

Each kind of input has its own option and its own small handler below; the command creates the
run when it does not exist and appends to it when it does.
"""

from __future__ import annotations

import click

from gputrace.engines.ingest import IngestStats, default_source, ingest_log
from gputrace.store import Store


def _echo_log_stats(engine: str, stats: IngestStats) -> None:
    recognised = ", ".join(f"{k} {v}" for k, v in stats.recognised.items() if v)
    click.echo(
        f"{engine} log {stats.path}: {stats.lines} lines, recognised {recognised or 'none'}, "
        f"unrecognised {stats.unrecognised}; {stats.events_written} events, "
        f"{stats.configs_written} configuration records"
    )


def _import_engine_logs(
    store: Store, engine: str, paths: tuple[str, ...], host: str, timezone: str, date: str | None
) -> None:
    for path in paths:
        stats = ingest_log(store, path, host=host, engine=engine, source=default_source(path),
                           tz=timezone, date=date)
        _echo_log_stats(engine, stats)


@click.command("import")
@click.option("--run", "run_dir", required=True, type=click.Path(file_okay=False, path_type=str),
              help="Run directory (created if absent).")
@click.option("--host", default="localhost", show_default=True,
              help="Host the imported files came from (their timestamps are in its clock).")
# -- engine logs ------------------------------------------------------------------------------
@click.option("--sglang-log", "sglang_logs", multiple=True, type=click.Path(dir_okay=False, path_type=str),
              help="SGLang server log (plain or .gz); repeatable.")
@click.option("--vllm-log", "vllm_logs", multiple=True, type=click.Path(dir_okay=False, path_type=str),
              help="vLLM server log (plain or .gz); repeatable.")
@click.option("--timezone", default="UTC", show_default=True,
              help="Timezone the engine logged its times in (IANA name).")
@click.option("--date", default=None, metavar="YYYY-MM-DD",
              help="Date for log times printed without one (SGLang before 2024-10; vLLM's year).")
def command(
    run_dir: str,
    host: str,
    sglang_logs: tuple[str, ...],
    vllm_logs: tuple[str, ...],
    timezone: str,
    date: str | None,
) -> None:
    """Import files made elsewhere (engine logs, ...) into a run store."""
    if not (sglang_logs or vllm_logs):
        raise click.UsageError("nothing to import: give --sglang-log or --vllm-log")
    with Store.create(run_dir, exist_ok=True) as store:
        _import_engine_logs(store, "sglang", sglang_logs, host, timezone, date)
        _import_engine_logs(store, "vllm", vllm_logs, host, timezone, date)
