"""`gputrace watch` in a real terminal: a private tmux server (own socket, no user config) holding
one detached fixed-size pane, and the screen read back as text, for the watch tests."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from live_chain import gputrace_argv

_STAGE_ROW = re.compile(r"^\W*PP(\d+)\s")
_ENGINE = re.compile(r"engine\s+running (\d+)(?: of (\d+) \(pool\))?\s+queued (\d+)"
                     r"(?:\s+micro-batches in flight (\d+) of (\d+) stages)?")


class Tmux:
    """A private tmux server (own socket, no user config) holding one fixed-size session."""

    def __init__(self, binary: str, work: Path):
        self.binary, self.socket = binary, work / "tmux.sock"
        self.conf = work / "tmux.conf"
        # The pane stays after its command exits, so what it last showed can be read back.
        self.conf.write_text("set -g remain-on-exit on\nset -g history-limit 0\n")

    def __call__(self, *args: str) -> str:
        # Without COLUMNS and LINES, which Rich prefers to the pane's real size: under pytest the C
        # environ gains COLUMNS=80 and LINES=24 (readline exports them), and under pytest-xdist's
        # workers os.environ holds them too.
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        done = subprocess.run([self.binary, "-S", str(self.socket), "-f", str(self.conf), *args],
                              capture_output=True, text=True, timeout=10, check=True, env=env)
        return done.stdout

    def capture(self) -> list[str]:
        return self("capture-pane", "-p", "-t", "watch").splitlines()

    def kill(self) -> None:
        subprocess.run([self.binary, "-S", str(self.socket), "kill-server"], capture_output=True, timeout=10)


def stage_rows(screen: list[str]) -> dict[int, str]:
    """The table's rows by pp_rank, as drawn."""
    rows: dict[int, str] = {}
    for line in screen:
        m = _STAGE_ROW.match(line)
        if m:
            rows[int(m.group(1))] = line.strip()
    return rows


EngineLine = tuple[int, int | None, int, int | None, int | None]


def engine_line(screen: list[str]) -> EngineLine | None:
    """(running, pool, queued, micro-batches in flight, stages) as the engine line shows them (None
    for a figure it does not show)."""
    m = next((m for line in screen if (m := _ENGINE.search(line))), None)
    if m is None:
        return None
    running, pool, queued, mbs, stages = (None if g is None else int(g) for g in m.groups())
    assert running is not None and queued is not None
    return running, pool, queued, mbs, stages


@contextlib.contextmanager
def watch_recorded(work: Path, collector_url: str,
                   every_s: float = 1.0) -> Iterator[list[tuple[int, list[str]]]]:
    """`gputrace watch` against ``collector_url`` in a 200x50 pane while the block runs: its screen
    read every ``every_s`` into the list yielded, as (time.time_ns(), lines)."""
    binary = shutil.which("tmux")
    if binary is None:
        raise AssertionError("tmux is not installed (apt-get install tmux): watch is read through it")
    tmux = Tmux(binary, work)
    # a redraw a second: the engines beside it share the two cores
    watch = shlex.join(gputrace_argv("watch", "--collector", collector_url, "--refresh", "1"))
    tmux("new-session", "-d", "-s", "watch", "-x", "200", "-y", "50", watch)
    screens: list[tuple[int, list[str]]] = []
    stop = threading.Event()

    def record() -> None:
        while not stop.wait(every_s):
            with contextlib.suppress(subprocess.SubprocessError):
                screens.append((time.time_ns(), tmux.capture()))

    recorder = threading.Thread(target=record, name="watch-screens", daemon=True)
    recorder.start()
    try:
        yield screens
    finally:
        stop.set()
        recorder.join(timeout=15)
        tmux.kill()
