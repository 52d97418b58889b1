"""`gputrace report RUN`: the bubble-diagnosis report (report.html, report.md, findings.json)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import click

from gputrace.analyse import analyse_run
from gputrace.analysis.aligned_run import align_store
from gputrace.commands.options.prometheus import prometheus_flags, prometheus_run, window_ns
from gputrace.errors import GputraceError, UsageError
from gputrace.report.figures import FIGURES
from gputrace.report.progress import LONG_RUN_S, report_progress
from gputrace.report.render import parse_formats, write_report
from gputrace.store import Store
from gputrace.whatif.advise import advisor


@click.command("report")
@click.argument("run", required=False, type=click.Path(exists=True, file_okay=False, path_type=str))
@click.option("--format", "formats", default="html,md,json", show_default=True,
              help="Comma-separated: html, md, json.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=str), default=None,
              help="Output directory (default: RUN/report; with --prometheus: RUN_OUT/report or ./report).")
@click.option("--progress/--no-progress", default=None, help="Force the progress bar on or off.")
@prometheus_flags
def command(run: str | None, formats: str, out_dir: str | None, progress: bool | None, **prom: Any) -> None:
    """Diagnose pipeline bubbles in a run (or a Prometheus time range) and write the report."""
    fmts = parse_formats(formats)
    if run is not None and prom["prometheus_url"]:
        raise UsageError("give a RUN directory or --prometheus, not both")
    imported = prometheus_run(**prom)
    window: tuple[int | None, int | None] = (None, None)
    if imported:
        run, out_dir = imported[0], out_dir or imported[1]
    elif run is None:
        raise UsageError("give a RUN directory, or --prometheus URL --start T --end T")
    else:  # a window of the run (its own clock: the collector's)
        window = window_ns(prom["prom_start"], prom["prom_end"])
    out_dir = out_dir or f"{run}/report"
    _check_writable(out_dir)  # before the analysis, which can take minutes on a long run
    with Store.open(run, read_only=True) as store:
        aligned = align_store(store, window)
        duration_s = float(aligned.grid_ns[-1] - aligned.grid_ns[0]) / 1e9
        enabled = progress if progress is not None else duration_s > LONG_RUN_S
        n_phases = max(len(aligned.markers), 1)
        with report_progress(n_phases + len(FIGURES) + 3, enabled) as step:
            analysis = analyse_run(store, window, aligned=aligned, advise=advisor(), progress=step)
            try:
                written = write_report(analysis, out_dir, fmts, progress=step)
            except OSError as exc:  # a disk that fills while writing (the check passed before)
                raise GputraceError(f"cannot write the report into {out_dir}: {exc.strerror or exc}; "
                                    "free space there or give --out DIR") from exc
    if analysis.advice is not None:
        click.echo(f"Advice: {analysis.advice.to_dict()['sentence']}")
    for f in analysis.findings:
        click.echo(f"{f.cause} [{f.phase}] stages {','.join(map(str, f.stages))}: {f.summary} "
                   f"-> {analysis.recommendation_of(f)}")
    if not analysis.findings:
        click.echo("no finding: every phase is healthy")
    for path in written:
        click.echo(f"wrote {path}")


def _check_writable(out_dir: str) -> None:
    """UsageError naming the directory when the report cannot be written there (a run directory
    on a read-only disk was 'unexpected OSError' after the whole analysis)."""
    try:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as exc:
        raise UsageError(f"cannot write the report into {out_dir}: {exc.strerror or exc}; "
                         "give --out DIR where it can be written") from exc
