"""A clock a test moves itself (the collector, the live view and the agent client take one), and
an in-process wait on a condition, for tests that would otherwise sleep a fixed time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

S = 1_000_000_000


class FakeClock:
    """Epoch ns that move only when the test says (``advance``); called like ``time.time_ns``."""

    def __init__(self, start_ns: int | None = None):
        self.now_ns = time.time_ns() if start_ns is None else start_ns
        self.reads = 0  # how often it was read: a test waits for its reader to have taken the time

    def __call__(self) -> int:
        self.reads += 1
        return self.now_ns

    def advance(self, seconds: float) -> None:
        self.now_ns += int(seconds * S)


async def until(condition: Callable[[], object], what: str, timeout_s: float = 20.0) -> None:
    """Return once ``condition()`` holds: checked at every turn of the event loop's 10 ms ticks
    (the collector's tasks run between them); an AssertionError naming ``what`` after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)
