"""`gputrace parse FILE...`: engine log lines -> NDJSON on stdout, a summary on stderr."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import IO

import click

from gputrace.engines import ENGINES, KINDS, LogParser
from gputrace.engines.ingest import chunk_lines, open_log, read_chunks
from gputrace.errors import UsageError


def _lines_of(path: str) -> Iterator[str]:
    if path == "-":
        stream: IO[bytes] = sys.stdin.buffer
        for chunk in read_chunks(stream, 1 << 20):
            yield from chunk_lines(chunk)
        return
    with open_log(path) as log:
        for chunk in read_chunks(log, 1 << 20):
            yield from chunk_lines(chunk)


@click.command("parse")
@click.argument("paths", nargs=-1, required=True, metavar="FILE...")
@click.option("--engine", type=click.Choice(ENGINES), default="auto", show_default=True,
              help="Which engine's grammar to apply (auto: SGLang, then vLLM).")
def command(paths: tuple[str, ...], engine: str) -> None:
    """Print each recognised scheduler/stats/config line of FILE (- for stdin, .gz accepted)
    as one JSON object per line; a summary of lines read and recognised goes to stderr."""
    for path in paths:
        if path != "-" and not os.path.isfile(path):
            raise UsageError(f"{path}: no such file")
    try:
        _parse_all(paths, engine, sys.stdout)
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly, as line tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _parse_all(paths: tuple[str, ...], engine: str, out: IO[str]) -> None:
    total_lines = total_unrecognised = 0
    totals = dict.fromkeys(KINDS, 0)
    for path in paths:
        parser = LogParser(host="", source=path, engine=engine)
        for line in _lines_of(path):
            parsed = parser.parse(line)
            if parsed is not None:
                out.write(json.dumps(parsed.to_json_obj(), default=str) + "\n")
        counts = parser.counts
        total_lines += counts.lines
        total_unrecognised += counts.unrecognised
        for kind in KINDS:
            totals[kind] += counts.recognised.get(kind, 0)
        if len(paths) > 1:
            click.echo(f"{path}: {_summary(counts.lines, dict(counts.recognised), counts.unrecognised)}",
                       err=True)
    out.flush()
    click.echo(f"total: {_summary(total_lines, totals, total_unrecognised)}", err=True)


def _summary(lines: int, recognised: dict[str, int], unrecognised: int) -> str:
    per_kind = ", ".join(f"{kind} {recognised.get(kind, 0)}" for kind in KINDS)
    return f"{lines} lines read; recognised {per_kind}; unrecognised {unrecognised}"
