"""`gputrace import --run DIR ...`: write records from files made elsewhere into a run store.

Each kind of input has its own option and its own small handler below; the command creates the
run when it does not exist and appends to it when it does.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from gputrace.engines import ENGINE_WORDS, engine_words
from gputrace.engines.common import MAX_LINE_BYTES
from gputrace.errors import SourceError
from gputrace.imports import ledger
from gputrace.imports.engine_log import default_source, ingest_log
from gputrace.imports.input_path import pipes_spooled
from gputrace.imports.nvidia_smi import import_nvidia_smi_csv, import_nvidia_smi_dmon, parse_tz
from gputrace.imports.report import ImportReport
from gputrace.imports.request_files import import_aiperf, import_guidellm, import_requests_jsonl
from gputrace.store import Store

# Logs larger than this show a progress bar on a terminal (about 3 s of ingest on 2 cores).
PROGRESS_MIN_BYTES = 64 << 20


def _import_engine_logs(
    store: Store, engine: str, paths: tuple[str, ...], host: str, timezone: str, date: str | None,
    progress: bool | None,
) -> None:
    for path in paths:
        known = ledger.check(store, path, f"{engine} log")
        if known.earlier is not None:
            click.echo(known.already_imported())
            continue
        # the same log grown, or compressed: its lines go in under the earlier copy's source, and
        # only those the run lacks. Recorded first, so an import cut short is resumed by the next.
        stream = ledger.log_stream(store, path, default_source(path))
        if (stream_entry := stream.entry(f"{engine} log", path)) is not None:
            store.record_stream(stream_entry)
        content = ledger.StreamHash()
        size = os.path.getsize(path) if os.path.isfile(path) else 0
        show = progress if progress is not None else (size >= PROGRESS_MIN_BYTES and sys.stderr.isatty())
        year_until = None
        words = engine_words(engine)
        if not words.stamps_have_year and date is None and os.path.isfile(path):
            # stamps without a year (vLLM's MM-DD): the year is the one in which the file was last written
            last_write = dt.datetime.fromtimestamp(os.path.getmtime(path), dt.UTC).date()
            year_until = lambda last_write=last_write: last_write  # noqa: E731
            click.echo(f"{path}: {words.name}'s times have no year: dated up to the file's last change "
                       f"({last_write.isoformat()}); --date YYYY-MM-DD sets the year", err=True)
        with _bytes_progress(f"{engine} log {os.path.basename(path)}", size, show) as advance:
            stats = ingest_log(store, path, host=host, engine=engine, source=stream.source,
                               tz=timezone, date=date, year_until=year_until, on_progress=advance,
                               on_bytes=content.update, stored_lines=stream.stored)
        if stream.earlier is not None and stream.earlier.path != str(Path(path).resolve()):
            stats.continues = stream.earlier.path
        click.echo(stats.summary())
        if not any(stats.recognised.values()):
            other = ", ".join(f"a {k} log goes in with --{k}-log" for k in ENGINE_WORDS if k != engine)
            cut = (f", {stats.lines_cut} of them past {MAX_LINE_BYTES >> 20} MiB and cut"
                   if stats.lines_cut else "")
            raise SourceError(f"{path}: no {engine} line recognised in its {stats.lines} lines{cut}: is it "
                              f"the engine's log ({other})?")
        if (entry := known.entry(content.finish(path))) is not None:
            store.record_import(entry)


@contextmanager
def _bytes_progress(what: str, total_bytes: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr over a file's bytes; a no-op callback when not enabled."""
    if not enabled:
        yield lambda _done: None
        return
    bar = Progress(TextColumn(f"[bold]import[/] {what}"), BarColumn(), DownloadColumn(),
                   TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
                   transient=True)
    with bar:
        task = bar.add_task("", total=total_bytes or None)
        yield lambda done: bar.update(task, completed=done)


# what the ledger calls each kind of file (the names the import summaries use)
_LEDGER_KINDS = {"aiperf": "aiperf", "guidellm": "guidellm", "requests": "gputrace-jsonl",
                 "smi_csv": "nvidia-smi-csv", "smi_dmon": "nvidia-smi-dmon"}


def _import_load_and_smi_files(
    store: Store, host: str, host_given: bool, timezone: str, files: dict[str, tuple[str, ...]],
    smi_fields: str | None, aiperf_phase: str | None,
) -> None:
    """Request files (AIPerf, guidellm, gputrace JSONL) and nvidia-smi captures."""
    tz = parse_tz(timezone)
    fields = [f.strip() for f in smi_fields.split(",") if f.strip()] if smi_fields else None
    # gputrace's own JSONL names its client host; --host replaces it only when given.
    importers: dict[str, Callable[[str], ImportReport]] = {
        "aiperf": lambda p: import_aiperf(store, p, host, aiperf_phase),
        "guidellm": lambda p: import_guidellm(store, p, host),
        "requests": lambda p: import_requests_jsonl(store, p, host if host_given else None),
        "smi_csv": lambda p: import_nvidia_smi_csv(store, p, host, fields, tz),
        "smi_dmon": lambda p: import_nvidia_smi_dmon(store, p, host, tz),
    }
    for kind, import_file in importers.items():
        for path in files[kind]:
            known = ledger.check(store, path, _LEDGER_KINDS[kind])
            if known.earlier is not None:
                click.echo(known.already_imported())
                continue
            click.echo(import_file(path).summary())
            # these files are small and read whole by their parsers: hashed after, in one more pass
            if (entry := known.entry(ledger.StreamHash().finish(path))) is not None:
                store.record_import(entry)


_FILE = click.Path(dir_okay=False, path_type=str)


def _engine_log_options(command: Callable[..., None]) -> Callable[..., None]:
    """A ``--<engine>-log`` option (repeatable) for each registered engine."""
    for engine in reversed(ENGINE_WORDS.values()):
        command = click.option(f"--{engine.kind}-log", f"{engine.kind}_logs", multiple=True,
                               type=click.Path(dir_okay=False, path_type=str),
                               help=f"{engine.name} server log (plain or .gz); repeatable.")(command)
    return command


@click.command("import")
@click.option("--run", "run_dir", required=True, type=click.Path(file_okay=False, path_type=str),
              help="Run directory (created if absent).")
@click.option("--host", default="localhost", show_default=True,
              help="Host the imported files came from (their timestamps are in its clock).")
# -- engine logs: --<engine>-log for each engine registered (gputrace/engines/) ---------------
@_engine_log_options
# -- load and GPU files --------------------------------------------------------------------
@click.option("--aiperf", "aiperf_files", multiple=True, type=_FILE,
              help="AIPerf per-request profile_export.jsonl; repeatable.")
@click.option("--aiperf-phase", default=None, metavar="LABEL",
              help="Phase label for the AIPerf files (one concurrency per AIPerf run), e.g. C=32.")
@click.option("--guidellm", "guidellm_files", multiple=True, type=_FILE,
              help="guidellm JSON benchmarks report (benchmarks.json); repeatable.")
@click.option("--requests", "requests_files", multiple=True, type=_FILE,
              help="gputrace requests JSONL (gputrace load --out); repeatable.")
@click.option("--nvidia-smi-csv", "smi_csv_files", multiple=True, type=_FILE,
              help="nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits] -lms N output; repeatable.")
@click.option("--nvidia-smi-fields", default=None, metavar="F1,F2,...",
              help="The --query-gpu field list, for CSV captured with noheader.")
@click.option("--nvidia-smi-dmon", "smi_dmon_files", multiple=True, type=_FILE,
              help="nvidia-smi dmon -o DT output; repeatable.")
@click.option("--timezone", default="UTC", show_default=True,
              help="Timezone the engine and nvidia-smi printed local times in (IANA name).")
@click.option("--date", default=None, metavar="YYYY-MM-DD",
              help="Date for log times printed without one (SGLang before 2024-10; vLLM's year).")
@click.option("--progress/--no-progress", default=None,
              help="Force the progress bar over engine logs on or off (default: on a terminal, "
                   "for logs over 64 MiB).")
def command(
    run_dir: str,
    host: str,
    aiperf_files: tuple[str, ...],
    aiperf_phase: str | None,
    guidellm_files: tuple[str, ...],
    requests_files: tuple[str, ...],
    smi_csv_files: tuple[str, ...],
    nvidia_smi_fields: str | None,
    smi_dmon_files: tuple[str, ...],
    timezone: str,
    date: str | None,
    progress: bool | None,
    **engine_logs: tuple[str, ...],
) -> None:
    """Import files made elsewhere (engine logs, load results, nvidia-smi captures) into a run store."""
    files = {"aiperf": aiperf_files, "guidellm": guidellm_files, "requests": requests_files,
             "smi_csv": smi_csv_files, "smi_dmon": smi_dmon_files}
    logs = {kind: engine_logs.get(f"{kind}_logs", ()) for kind in ENGINE_WORDS}
    if not (any(logs.values()) or any(files.values())):
        raise click.UsageError(
            f"nothing to import: give {', '.join(f'--{kind}-log' for kind in ENGINE_WORDS)}, --aiperf, "
            "--guidellm, --requests, --nvidia-smi-csv or --nvidia-smi-dmon"
        )
    host_given = click.get_current_context().get_parameter_source("host") is not (
        click.core.ParameterSource.DEFAULT
    )
    # a pipe (<(cat log)) is read into a temporary file: the import reads each input twice
    with pipes_spooled({**logs, **files},
                       lambda line: click.echo(line, err=True)) as readable:
        _import_into(run_dir, host, host_given, timezone, date, progress, readable, nvidia_smi_fields,
                     aiperf_phase)


def _import_into(run_dir: str, host: str, host_given: bool, timezone: str, date: str | None,
                 progress: bool | None, paths: dict[str, tuple[str, ...]], nvidia_smi_fields: str | None,
                 aiperf_phase: str | None) -> None:
    files = {kind: group for kind, group in paths.items() if kind not in ENGINE_WORDS}
    new_run = not (Path(run_dir) / "meta.json").exists()
    store = Store.create(run_dir, exist_ok=True)
    try:
        for kind in ENGINE_WORDS:
            _import_engine_logs(store, kind, paths[kind], host, timezone, date, progress)
        _import_load_and_smi_files(store, host, host_given, timezone, files, nvidia_smi_fields, aiperf_phase)
    except BaseException:
        # a failed import into a run it created leaves none behind, so the retry can use --run
        if new_run and store.is_empty():
            store.discard()
            raise
        store.close()
        raise
    store.close()
