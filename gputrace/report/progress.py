"""A progress bar on stderr (rich) for long runs; a no-op callback otherwise."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

LONG_RUN_S = 600.0
"""Runs longer than this (or any run when forced) show a progress bar."""


@contextmanager
def report_progress(total_steps: int, enabled: bool) -> Iterator[Callable[[str], None]]:
    """Yield a callback that advances the bar by one step and shows the step's name."""
    if not enabled:
        yield lambda _step: None
        return
    progress = Progress(TextColumn("[bold]report[/] {task.description}"), BarColumn(),
                        TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=True)
    with progress:
        task = progress.add_task("", total=total_steps)

        def step(name: str) -> None:
            progress.update(task, advance=1, description=name)

        yield step
