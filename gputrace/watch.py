"""The live terminal view: the engine as a whole (its running total against its pool, the queue,
the micro-batches in flight against the stages), one row per pipeline stage (micro-batch size,
busy and bubble with the signal they come from, power, PCIe, tok/s), what the figures say now in
one line, and how old the data is: a stale view says so in red in its header.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import termios
import time
import tty
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from gputrace.analysis.result import DEFAULT_THRESHOLDS
from gputrace.live import STALE_AFTER_S
from gputrace.vocabulary import LiveStatus

StatusSource = Callable[[], Awaitable[LiveStatus]]
STALE_STYLE = "bold white on red"
FETCH_GIVE_UP_S = 10.0  # a status request this old is abandoned and asked again


def _bar(ratio: float | None, width: int = 20) -> Text:
    if ratio is None:
        return Text("n/a".ljust(width), style="dim")
    filled = round(max(0.0, min(1.0, ratio)) * width)
    style = "green" if ratio >= 0.8 else "yellow" if ratio >= 0.5 else "red"
    return Text("█" * filled + "·" * (width - filled), style=style)


def _num(value: Any, fmt: str = "{:.0f}", suffix: str = "") -> str:
    return "n/a" if value is None else fmt.format(value) + suffix


def data_age_s(status: LiveStatus) -> float | None:
    """How old the newest line or sample was when the collector answered (its own clock)."""
    now, newest = status.now_ns, status.newest_data_ns
    return None if now is None or newest is None else max(0.0, (now - newest) / 1e9)


def _header(status: LiveStatus, age_s: float | None, error: str | None) -> Text:
    stale = error is not None or age_s is None or age_s > STALE_AFTER_S
    if age_s is None:
        age = "no data yet"
    elif stale:
        age = f"STALE: data {age_s:.0f} s old" + (" (collector not answering)" if error else "")
    else:
        age = f"data {age_s:.1f} s old"
    # the load in flight is known when the load runs inside the collector (`gputrace run`)
    inflight = status.inflight
    load: list[str | tuple[str, str]] = [] if inflight is None else [
        ("  load in flight ", "dim"), _num(inflight)]
    head = Text.assemble(
        ("gputrace watch", "bold"), f"  run {status.run or '?'}  ",
        ("phase ", "dim"), str(status.phase or "-"),
        ("  target C ", "dim"), _num(status.target_concurrency), *load, "   ", age)
    if stale and status != LiveStatus():
        head.stylize(STALE_STYLE)
    return head


def _engine_line(status: LiveStatus) -> Text:
    """The engine's figures once: what a stage's "running 8" is one micro-batch of."""
    e = status.engine or {}
    pp = status.pp_size
    pool = f" of {e['pool']} (pool)" if e.get("pool") else ""
    parts: list[str | tuple[str, str]] = [
        ("engine  ", "bold"), ("running ", "dim"), _num(e.get("running")) + pool,
        ("   queued ", "dim"), _num(e.get("queued"))]
    mbs = e.get("microbatches_in_flight")
    if mbs is not None:
        allowed = f": at most {min(1.0, mbs / pp):.0%} busy" if pp else ""
        k = f", K = {e['k']}" if e.get("k") else ""
        parts += [("   micro-batches in flight ", "dim"),
                  f"{mbs:.0f} of {pp or '?'} stages ({e.get('slots') or '?'} slots{k}){allowed}"]
    return Text.assemble(*parts)


def render_status(status: LiveStatus, error: str | None = None, age_s: float | None = None) -> Group:
    """The view of one /v1/status document; ``age_s``: how old its data is now (the collector's
    own figure when omitted)."""
    age_s = data_age_s(status) if age_s is None else age_s
    table = Table(expand=False, header_style="bold")
    for col, justify in (("stage", "right"), ("GPUs", "left"), ("busy", "left"), ("busy %", "right"),
                         ("bubble", "right"), ("micro-batch", "right"), ("power W", "right"),
                         ("PCIe TX MB/s", "right"), ("PCIe RX MB/s", "right"), ("tok/s", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    signals = []
    for row in status.stages:
        busy = row.get("busy_ratio", row.get("utilization_ratio"))
        bubble = row.get("bubble_ratio")
        if row.get("busy_signal") and row["busy_signal"] not in signals:
            signals.append(row["busy_signal"])
        # red where the report's diagnosis counts a bubble (its threshold: watch has none of its own)
        counted = (bubble or 0) > DEFAULT_THRESHOLDS.bubble_material
        table.add_row(
            f"PP{row['pp_rank']}", ",".join(row.get("gpus", [])) or "-", _bar(busy),
            _num(busy, "{:.0%}"),
            Text(_num(bubble, "{:.0%}"), style="red" if counted else ""),
            _num(row.get("microbatch_size", row.get("running_req"))), _num(row.get("power_w")),
            _num(_mb(row.get("pcie_tx_bytes_per_s")), "{:.1f}"),
            _num(_mb(row.get("pcie_rx_bytes_per_s")), "{:.1f}"),
            _num(row.get("gen_throughput_tok_s"), "{:.1f}"),
        )
    counts = status.counts
    signal = f"busy and bubble from {' / '.join(signals)}   " if signals else ""
    foot = Text(f"{signal}samples {counts.get('gpu_samples', 0)}  log events "
                f"{counts.get('scheduler_events', 0)}  requests {counts.get('requests', 0)}   "
                "q or Ctrl-C quits", style="dim")
    finding = status.finding
    parts: list[Any] = [_header(status, age_s, error), _engine_line(status), table]
    if finding:
        parts.append(Text.assemble(("now: ", "bold"), finding))
    parts.append(foot)
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


async def _redraw(source: StatusSource, refresh_s: float, quit_event: asyncio.Event) -> None:
    """Ask ``source`` at most every ``refresh_s`` and redraw every ``refresh_s`` whatever it does:
    a collector that hangs or is slow (a loaded host took over a second to answer) must not hold
    the view, whose data meanwhile ages on screen and turns stale."""
    status = LiveStatus()
    read_at = time.monotonic()
    error: str | None = None
    pending: asyncio.Task[LiveStatus] | None = None
    asked_at = 0.0
    quit_wait = asyncio.ensure_future(quit_event.wait())
    try:
        with Live(render_status(status), refresh_per_second=max(1, round(1 / refresh_s)),
                  screen=False, transient=False) as live:
            while not quit_event.is_set():
                now = time.monotonic()
                if pending is None and now - asked_at >= refresh_s:
                    pending, asked_at = asyncio.ensure_future(source()), now
                waiting = {quit_wait} | ({pending} if pending is not None else set())
                await asyncio.wait(waiting, timeout=refresh_s, return_when=asyncio.FIRST_COMPLETED)
                if pending is not None and pending.done():
                    try:
                        status, read_at, error = pending.result(), time.monotonic(), None
                    except Exception as exc:  # keep showing the last view; say what failed
                        error = f"cannot read the collector: {str(exc) or type(exc).__name__}"
                    pending = None
                elif pending is not None and time.monotonic() - asked_at > FETCH_GIVE_UP_S:
                    pending.cancel()
                    pending = None
                    error = f"cannot read the collector: no answer in {FETCH_GIVE_UP_S:.0f} s"
                elif pending is not None and time.monotonic() - asked_at > STALE_AFTER_S:
                    error = f"the collector has not answered for {time.monotonic() - asked_at:.0f} s"
                at_read = data_age_s(status)
                age_s = None if at_read is None else at_read + time.monotonic() - read_at
                live.update(render_status(status, error, age_s))
    finally:
        for task in (pending, quit_wait):
            if task is not None:
                task.cancel()


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
            await _redraw(source, refresh_s, quit_event)
        finally:
            if keys:
                loop.remove_reader(sys.stdin.fileno())
