"""The `report --prometheus` flags and the step that turns them into a run store to report on
(click lives in gputrace/commands/ only: this is the commands' shared option set, not a command)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from gputrace.errors import UsageError
from gputrace.imports.prometheus import (
    import_prometheus,
    parse_matchers,
    parse_step_ms,
    parse_time_ms,
    scrape_interval_ms,
)
from gputrace.prometheus.client import MAX_POINTS_PER_SERIES, PrometheusClient

DCGM_SCHEMA_WORDS = {"4.8": "the names before 4.9: utilization in %, MHz, mJ, MiB",
                     "4.9": "DCGM 4.7 names: ratios, Hz, J, bytes",
                     "4.9+": "DCGM 4.7 names: ratios, Hz, J, bytes; 4.9 or later",
                     "4.10": "4.9's names, PCIe and NVLink as *_PER_SECOND"}
"""dcgm-exporter's schemas as the import reports them (each series converted to SI by its own name)."""


def _setting_option(setting: str, help_text: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """gputrace's own option for an engine setting Prometheus does not carry, named after
    gputrace's setting (``--max-running-requests``), whatever the engine calls it."""
    return click.option("--" + setting.replace("_", "-"), "prom_" + setting, type=int, default=None,
                        help=help_text)


def prometheus_flags(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The flags of `report --prometheus` (all passed on as keyword arguments)."""
    options: list[Callable[[Callable[..., Any]], Callable[..., Any]]] = [
        click.option("--prometheus", "prometheus_url", default=None, metavar="URL",
                     help="Analyse what this Prometheus scraped from the agents and the collector."),
        click.option("--start", "prom_start", default=None,
                     help="Analyse from this time on: RFC 3339 or unix seconds (needed with --prometheus)."),
        click.option("--end", "prom_end", default=None,
                     help="Analyse up to this time: RFC 3339 or unix seconds (needed with --prometheus)."),
        click.option("--step", "prom_step", default="auto", show_default=True,
                     help="With --prometheus: query resolution, e.g. 1s; auto: the shortest scrape "
                          "interval of the server's targets, else 1s."),
        click.option("--match", "prom_match", default=None,
                     help='With --prometheus: label matchers, e.g. {run="x"} (run= selects the '
                          "collector's series; host, job, instance select both)."),
        click.option("--token-file", "prom_token_file", default=None, type=click.Path(dir_okay=False),
                     help="With --prometheus: file holding a bearer token."),
        click.option("--run-out", "prom_run_out", default=None, type=click.Path(file_okay=False),
                     help="With --prometheus: keep the imported run store here (default: a temporary one)."),
        _setting_option("max_running_requests",
                        "With --prometheus: the engine's setting (Prometheus does not carry it; the "
                        "micro-batch cap diagnosis needs it or the next flag)."),
        _setting_option("pp_max_micro_batch_size",
                        "With --prometheus: the engine's setting, when it was given."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def parse_window_ms(start: str | None, end: str | None, flags: tuple[str, str] = ("--start", "--end")
                    ) -> tuple[int | None, int | None]:
    """--start and --end (or the ``flags`` named) in ms since the epoch (None where not given);
    the end after the start."""
    start_flag, end_flag = flags
    start_ms = parse_time_ms(start, start_flag) if start is not None else None
    end_ms = parse_time_ms(end, end_flag) if end is not None else None
    if start_ms is not None and end_ms is not None and end_ms <= start_ms:
        raise UsageError(f"{end_flag} {end} is not after {start_flag} {start}")
    return start_ms, end_ms


def window_ns(start: str | None, end: str | None, flags: tuple[str, str] = ("--start", "--end")
              ) -> tuple[int | None, int | None]:
    """``parse_window_ms`` in ns, for align_store."""
    start_ms, end_ms = parse_window_ms(start, end, flags)
    return (None if start_ms is None else start_ms * 1_000_000,
            None if end_ms is None else end_ms * 1_000_000)


def prometheus_run(prometheus_url: str | None, prom_start: str | None, prom_end: str | None,
                   prom_step: str, prom_match: str | None, prom_token_file: str | None,
                   prom_run_out: str | None, prom_max_running_requests: int | None,
                   prom_pp_max_micro_batch_size: int | None) -> tuple[str, str] | None:
    """Import the Prometheus range into a run store: (run dir, default report dir), or None when
    --prometheus was not given. A temporary store is removed when the command ends."""
    if prometheus_url is None:
        if prom_run_out:
            raise UsageError("--run-out goes with --prometheus URL")
        return None
    if prom_start is None or prom_end is None:
        raise UsageError("--prometheus needs --start and --end")
    start_ms, end_ms = parse_window_ms(prom_start, prom_end)
    assert start_ms is not None and end_ms is not None
    token = None
    if prom_token_file:
        try:
            token = Path(prom_token_file).read_text().strip()
        except OSError as exc:
            raise UsageError(f"--token-file {prom_token_file}: {exc.strerror}") from exc
    engine = {k: v for k, v in (("max_running_requests", prom_max_running_requests),
                                ("pp_max_micro_batch_size", prom_pp_max_micro_batch_size)) if v}
    client = PrometheusClient(prometheus_url, token)
    if prom_run_out:
        run_dir, default_out = Path(prom_run_out), str(Path(prom_run_out) / "report")
    else:
        tmp = tempfile.mkdtemp(prefix="gputrace-prometheus-")
        click.get_current_context().call_on_close(lambda: shutil.rmtree(tmp, ignore_errors=True))
        run_dir, default_out = Path(tmp) / "run", "report"
    matchers = parse_matchers(prom_match)
    step_ms = (scrape_interval_ms(client) or 1000) if prom_step == "auto" else parse_step_ms(prom_step)
    summary = import_prometheus(client, run_dir, start_ms, end_ms, step_ms, matchers, engine or None)
    click.echo(f"read {summary.gpus} GPUs ({summary.count('gpu_samples')} samples), {summary.ranks} engine "
               f"ranks ({summary.count('scheduler_events')} lines), {summary.count('load_samples')} client "
               f"in-flight samples and {summary.count('markers')} markers from {client.base_url} "
               f"at a {step_ms / 1000:g} s step in {summary.queries} range queries "
               f"({summary.windows} window(s) of at most {MAX_POINTS_PER_SERIES} steps per metric)"
               + (f"; {client.retries} call(s) asked again after a 'later' answer" if client.retries else ""))
    if held := {table: n for table, n in summary.present.items() if n}:
        click.echo(f"already in {run_dir} (not added again): "
                   + ", ".join(f"{n} {table}" for table, n in sorted(held.items())))
    click.echo(f"series found: {', '.join(summary.found)}")
    if summary.dcgm_schema:
        words = DCGM_SCHEMA_WORDS.get(summary.dcgm_schema, "names of several releases, each converted")
        click.echo(f"dcgm-exporter schema: {summary.dcgm_schema} ({words})")
    if summary.lacking:
        click.echo(f"lacking (no series for): {', '.join(summary.lacking)}")
    for problem in summary.problems:
        click.echo(problem)
    return str(run_dir), default_out
