"""Terminal output of ``gputrace load``: a progress bar on stderr while it runs, then the per-level
table (throughput, latency percentiles, ok/failed, the in-flight count actually achieved)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from gputrace.load.generator import LoadGenerator, LoadResult
from gputrace.load.stats import LAG_WARN_MS, LevelStats
from gputrace.model import is_abandoned

_REFRESH_S = 0.25


async def run_with_progress(gen: LoadGenerator, console: Console) -> LoadResult:
    """Run the generator with a progress bar that a ticker updates a few times a second (never per
    request: the bar must cost the client nothing measurable)."""
    progress = Progress(
        TextColumn("[bold]{task.fields[level]:>8}"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("in flight {task.fields[inflight]:>4}/{task.fields[target]:<4} "
                   "ok {task.fields[ok]} failed {task.fields[failed]}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        auto_refresh=False,
    )
    task_id = progress.add_task("load", total=1.0, level="", inflight=0, target=0, ok=0, failed=0)
    run = asyncio.create_task(gen.run())
    with progress:
        while not run.done():
            done, total = gen.level_progress()
            progress.update(
                task_id,
                completed=done,
                total=max(total, 1e-9),
                level=gen.phase or "drain",
                inflight=gen.inflight,
                target=gen.target_concurrency,
                ok=gen.completed,
                failed=gen.failed,
            )
            progress.refresh()
            await asyncio.wait({run}, timeout=_REFRESH_S)
    return run.result()


def _ms(p: tuple[float, float, float] | None) -> str:
    return "-" if p is None else "/".join(f"{v:.0f}" if v >= 100 else f"{v:.1f}" for v in p)


def levels_table(levels: Sequence[LevelStats]) -> Table:
    table = Table(title="load levels", title_justify="left")
    for name in ("level", "time s", "ok", "failed", "tok/s", "req tok/s", "TTFT ms p50/p90/p99",
                 "ITL ms p50/p90/p99", "in flight mean", "min"):
        table.add_column(name, justify="left" if name == "level" else "right", no_wrap=True)
    for lv in levels:
        short = lv.short and lv.label != "warmup"
        inflight = "-" if lv.inflight_mean is None else f"{lv.inflight_mean:.1f}"
        table.add_row(
            lv.label,
            f"{lv.duration_s:.1f}",
            str(lv.ok),
            str(lv.failed) if not lv.failed else f"[red]{lv.failed}",
            "-" if lv.aggregate_tok_s is None else f"{lv.aggregate_tok_s:.1f}",
            "-" if lv.request_tok_s_p50 is None else f"{lv.request_tok_s_p50:.1f}",
            _ms(lv.ttft_ms),
            _ms(lv.itl_ms),
            f"[bold red]{inflight}" if short else inflight,
            "-" if lv.inflight_min is None else str(lv.inflight_min),
        )
    return table


def print_summary(result: LoadResult, console: Console) -> None:
    if not console.is_terminal:
        console.width = max(console.width, 150)  # a pipe or file: keep the table on one line per level
    console.print(levels_table(result.levels))
    n = len(result.requests)
    per_req = result.cpu_s / n * 1e3 if n else 0.0
    console.print(
        f"{n} requests in {result.wall_s:.1f} s; client CPU {result.cpu_s:.1f} s "
        f"({result.cpu_s / max(result.wall_s, 1e-9):.0%} of one core, {per_req:.2f} ms per request)"
    )
    for lv in result.levels:
        if lv.loop_lag_p99_ms is not None and lv.loop_lag_p99_ms > LAG_WARN_MS:
            console.print(
                f"[bold red]warning:[/] {lv.label}: the client's event loop woke up to "
                f"{lv.loop_lag_p99_ms:.0f} ms late (p99): its TTFT and ITL include client delay"
            )
    for lv in result.short_levels:
        console.print(
            f"[bold red]warning:[/] {lv.label}: the client kept {lv.inflight_mean:.1f} requests in flight "
            f"on average (min {lv.inflight_min}), not {lv.target_concurrency}"
            + (f"; {lv.failed} requests failed" if lv.failed else "")
        )
    for error, count in failure_reasons(result):
        console.print(f"[bold red]failed:[/] {count} x {escape(error)}")
    if result.abandoned:
        console.print(f"[bold yellow]abandoned:[/] {result.abandoned} requests still running when the drain "
                      "time after the last level ran out (not counted as failed; their end is unknown)")
    for what, count in sorted(result.malformed.items()):
        console.print(f"[bold yellow]warning:[/] {count} answers with {escape(what)} (read as not available)")


def failure_reasons(result: LoadResult, top: int = 3) -> list[tuple[str, int]]:
    """The most frequent errors of the failed requests (not the abandoned), with their counts."""
    errors = Counter(r.error or "failed without an error message" for r in result.requests
                     if not r.ok and not is_abandoned(r.error))
    return errors.most_common(top)
