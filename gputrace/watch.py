"""The live terminal view: one row per pipeline stage (utilization bar, power, PCIe, running and
queued requests, tok/s, bubble estimate) and the current load level, redrawn a few times a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import termios
import tty
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from gputrace.vocabulary import LiveStatus

StatusSource = Callable[[], Awaitable[LiveStatus]]


def _bar(ratio: float | None, width: int = 20) -> Text:
    if ratio is None:
        return Text("n/a".ljust(width), style="dim")
    filled = round(max(0.0, min(1.0, ratio)) * width)
    style = "green" if ratio >= 0.8 else "yellow" if ratio >= 0.5 else "red"
    return Text("█" * filled + "·" * (width - filled), style=style)


def _num(value: Any, fmt: str = "{:.0f}", suffix: str = "") -> str:
    return "n/a" if value is None else fmt.format(value) + suffix


def render_status(status: LiveStatus, error: str | None = None) -> Group:
    """The view of one /v1/status document."""
    head = Text.assemble(
        ("gputrace watch", "bold"), f"  run {status.run or '?'}  ",
        ("phase ", "dim"), str(status.phase or "-"),
        ("  target C ", "dim"), _num(status.target_concurrency),
        ("  in flight ", "dim"), _num(status.inflight),
    )
    table = Table(expand=False, header_style="bold")
    for col, justify in (("stage", "right"), ("GPUs", "left"), ("utilization", "left"), ("util", "right"),
                         ("power W", "right"), ("PCIe TX MB/s", "right"), ("PCIe RX MB/s", "right"),
                         ("running", "right"), ("queued", "right"), ("tok/s", "right"),
                         ("bubble", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for row in status.stages:
        util = row.get("utilization_ratio")
        bubble = row.get("bubble_ratio")
        table.add_row(
            f"PP{row['pp_rank']}", ",".join(row.get("gpus", [])) or "-", _bar(util),
            _num(util, "{:.0%}"), _num(row.get("power_w")),
            _num(_mb(row.get("pcie_tx_bytes_per_s")), "{:.1f}"),
            _num(_mb(row.get("pcie_rx_bytes_per_s")), "{:.1f}"),
            _num(row.get("running_req")), _num(row.get("queue_req")),
            _num(row.get("gen_throughput_tok_s"), "{:.1f}"),
            Text(_num(bubble, "{:.0%}"), style="red" if (bubble or 0) > 0.3 else ""),
        )
    counts = status.counts
    foot = Text(f"samples {counts.get('gpu_samples', 0)}  log events {counts.get('scheduler_events', 0)}"
                f"  requests {counts.get('requests', 0)}   q or Ctrl-C quits", style="dim")
    parts: list[Any] = [head, table, foot]
    for problem in status.problems:
        # a failing source or a store that cannot be written: the capture is not complete
        parts.append(Text(f"failing: {problem.source}: {problem.reason}", style="bold red"))
    if error:
        parts.append(Text(error, style="bold red"))
    return Group(*parts)


def _mb(value: float | None) -> float | None:
    return None if value is None else value / 1e6


@contextlib.contextmanager
def _cbreak() -> Iterator[bool]:
    """Single keys from a terminal stdin (for `q`); no-op when stdin is not a terminal."""
    if not sys.stdin.isatty():
        yield False
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def watch(source: StatusSource, refresh_s: float = 0.3) -> None:
    """Redraw from ``source`` every ``refresh_s`` until `q` or Ctrl-C."""
    quit_event = asyncio.Event()
    loop = asyncio.get_running_loop()
    with _cbreak() as keys:
        if keys:
            def on_key() -> None:
                if sys.stdin.read(1) in ("q", "Q"):
                    quit_event.set()
            loop.add_reader(sys.stdin.fileno(), on_key)
        try:
            status = LiveStatus()
            with Live(render_status(status), refresh_per_second=max(1, round(1 / refresh_s)),
                      screen=False, transient=False) as live:
                while not quit_event.is_set():
                    error = None
                    try:
                        status = await source()
                    except Exception as exc:  # keep showing the last view; say what failed
                        error = f"cannot read the collector: {exc}"
                    live.update(render_status(status, error))
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(quit_event.wait(), timeout=refresh_s)
        finally:
            if keys:
                loop.remove_reader(sys.stdin.fileno())
