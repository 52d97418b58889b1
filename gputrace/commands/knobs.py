"""`gputrace knobs [ENGINE] [--out DIR]`: the knob reference of each registered engine, from the registry."""

from __future__ import annotations

from pathlib import Path

import click

from gputrace.engines import ENGINE_WORDS
from gputrace.engines.reference import knob_reference, write_references
from gputrace.errors import UsageError


@click.command("knobs")
@click.argument("engine", required=False, metavar="[ENGINE]")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=str), default=None,
              help="Write knobs-<engine>.md here (the docs: --out docs) instead of printing.")
def command(engine: str | None, out_dir: str | None) -> None:
    """Each engine's knobs: flag, default, valid range, what it limits, whether the simulator models
    it and which findings name it (ENGINE: one of the registered engines; default: all)."""
    if engine is not None and engine not in ENGINE_WORDS:
        raise UsageError(f"unknown engine {engine!r}; known: {', '.join(ENGINE_WORDS)}")
    engines = [ENGINE_WORDS[engine]] if engine else list(ENGINE_WORDS.values())
    if out_dir is None:
        click.echo("\n".join(knob_reference(e) for e in engines), nl=False)
        return
    for path in write_references(engines, Path(out_dir)):
        click.echo(f"wrote {path}")
