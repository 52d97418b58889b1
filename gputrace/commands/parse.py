"""`gputrace parse FILE...`: engine log lines -> NDJSON on stdout, a summary on stderr."""

from __future__ import annotations

import heapq
import json
import os
import sys
from collections.abc import Iterator
from typing import IO

import click

from gputrace.arrow_columns import numbers
from gputrace.engines import ENGINES, KINDS, LogParser, fast_path_engine, maybe_line, ndjson
from gputrace.errors import SourceError
from gputrace.imports.input_path import check_readable
from gputrace.imports.log_files import GzipLog, chunk_lines, open_log, read_chunks


def _chunks_of(path: str, cuts: list[str]) -> Iterator[bytes]:
    """The file's chunks; a .gz file that ends early adds why to ``cuts`` (what came before is read)."""
    if path == "-":
        yield from read_chunks(sys.stdin.buffer, 1 << 20)
        return
    with open_log(path) as log:
        yield from read_chunks(log, 1 << 20)
        if isinstance(log, GzipLog) and log.cut is not None:
            cuts.append(log.cut)


def _lines_of(path: str, cuts: list[str]) -> Iterator[str]:
    for chunk in _chunks_of(path, cuts):
        yield from chunk_lines(chunk)


def _parse_chunk(parser: LogParser, chunk: bytes, out: IO[str]) -> None:
    """SGLang's current batch lines through the vectorised fast path (their JSON built column by
    column), the rest line by line; the objects come out in the file's order, the same as the
    per-line grammar gives (tested)."""
    fast_engine = fast_path_engine(parser.engine)
    assert fast_engine is not None and fast_engine.fast_path is not None
    # the lines any grammar of the parser may read (the others are counted unrecognised, unparsed)
    result = fast_engine.fast_path(chunk, 0, parser.clock, maybe_line(parser.engine))
    fast = None
    if result.n_fast:
        ts_text = ndjson.stamps(chunk, result.line_starts, numbers(result.columns["ts_resolution_ns"]))
        fast = ndjson.fast_rows_ndjson(result.columns, ts_text, fast_engine.kind)
        for kind, count in result.kinds.items():
            parser.counts.recognised[kind] += count
    parser.counts.lines += result.n_fast + result.n_rejected
    parser.counts.unrecognised += result.n_rejected
    others: list[tuple[int, str]] = []
    for offset, line in result.leftovers:
        parsed = parser.parse(line)
        if parsed is not None:
            others.append((offset, json.dumps(parsed.to_json_obj(), default=str) + "\n"))
    if not others:
        if fast is not None:
            _write_utf8(out, ndjson.joined_utf8(fast))
        return
    fast_lines = zip(result.columns["line_no"].to_pylist(), fast.to_pylist(), strict=True) if fast else ()
    out.writelines(text for _, text in heapq.merge(fast_lines, others, key=lambda item: item[0]))


def _write_utf8(out: IO[str], text: memoryview) -> None:
    """UTF-8 text to ``out``: straight to its binary stream when it has one (stdout), after what
    was written as str; decoded otherwise."""
    binary = getattr(out, "buffer", None)
    if binary is None or (getattr(out, "encoding", "") or "").lower().replace("-", "") != "utf8":
        out.write(bytes(text).decode())
        return
    out.flush()
    binary.write(text)


@click.command("parse")
@click.argument("paths", nargs=-1, required=True, metavar="FILE...")
@click.option("--engine", type=click.Choice(ENGINES), default="auto", show_default=True,
              help="Which engine's grammar to apply (auto: SGLang, then vLLM).")
def command(paths: tuple[str, ...], engine: str) -> None:
    """Print each recognised scheduler/stats/config line of FILE (- for stdin, .gz accepted)
    as one JSON object per line; a summary of lines read and recognised goes to stderr."""
    for path in paths:
        if path != "-":
            check_readable(path)  # a pipe is read as it streams; a directory or device refused
    try:
        lines, recognised = _parse_all(paths, engine, sys.stdout)
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly, as line tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    if not recognised:
        raise SourceError(f"no {'engine' if engine == 'auto' else engine} scheduler, stats or configuration "
                          f"line recognised in {lines} lines: is it a serving engine's log?")


def _parse_all(paths: tuple[str, ...], engine: str, out: IO[str], fast: bool = True) -> tuple[int, int]:
    """Parse every file to ``out``; (lines read, lines recognised)."""
    total_lines = total_unrecognised = total_bad = 0
    first_bad: str | None = None
    totals = dict.fromkeys(KINDS, 0)
    for path in paths:
        parser = LogParser(host="", source=path, engine=engine)
        cuts: list[str] = []
        if fast and fast_path_engine(engine) is not None:
            for chunk in _chunks_of(path, cuts):
                _parse_chunk(parser, chunk, out)
        else:
            for line in _lines_of(path, cuts):
                parsed = parser.parse(line)
                if parsed is not None:
                    out.write(json.dumps(parsed.to_json_obj(), default=str) + "\n")
        counts = parser.counts
        for cut in cuts:  # damage read around: said, not an error (the lines before it are out)
            click.echo(f"gputrace: warning: {path}: FILE CUT: {cut}: its {counts.lines} lines before that "
                       "were read, the rest is lost", err=True)
        total_lines += counts.lines
        total_unrecognised += counts.unrecognised
        total_bad += counts.bad_values
        if first_bad is None and counts.first_bad_value is not None:
            first_bad = f"{path} {counts.first_bad_value}"
        for kind in KINDS:
            totals[kind] += counts.recognised.get(kind, 0)
        if len(paths) > 1:
            click.echo(f"{path}: {_summary(counts.lines, dict(counts.recognised), counts.unrecognised)}",
                       err=True)
    out.flush()
    click.echo(f"total: {_summary(total_lines, totals, total_unrecognised)}"
               + (f"; {total_bad} bad values left out (first: {first_bad})" if total_bad else ""), err=True)
    return total_lines, sum(totals.values())


def _summary(lines: int, recognised: dict[str, int], unrecognised: int) -> str:
    per_kind = ", ".join(f"{kind} {recognised.get(kind, 0)}" for kind in KINDS)
    return f"{lines} lines read; recognised {per_kind}; unrecognised {unrecognised}"
