"""Phase marks posted to the collector (POST /v1/mark): checked where they enter, written to the
store a batch at a time, and each request answered only once its mark is on disk (or why not)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from gputrace.errors import StoreWriteError
from gputrace.httpserver import web
from gputrace.live import LiveState
from gputrace.logsetup import get_logger
from gputrace.model import Marker
from gputrace.store import Store

log = get_logger("collect")
MAX_CONCURRENCY = 1 << 31  # a phase's target: far above any real load, well inside int64
# Marks posted together are written as one batch after this pause (a mark written alone flushed
# the store on the event loop: 1,000 marks/s timed out 5,493 of 10,000 clients, /healthz p50 633 ms).
# An append costs ~30 ms whatever its size (busy 2-core machine); at 10 ms the appends took most
# of the loop from the requests; a mark waits about this long for its answer.
MARK_BATCH_S = 0.05

_PendingMark = tuple[Marker, "asyncio.Future[str | None]", web.Request]  # its request waits on the future


class MarkWriter:
    """The marks posted and not yet written, each with the future its request waits on (None:
    stored, else why not). ``handle`` is the /v1/mark handler; ``run`` the task writing them."""

    def __init__(self, store: Store, live: LiveState, default_host: str, clock_ns: Callable[[], int]):
        self.store = store
        self.live = live
        self.default_host = default_host  # a mark's host when its body names none
        self.clock_ns = clock_ns  # a mark's time when its body gives none
        self._pending: list[_PendingMark] = []
        self._posted = asyncio.Event()

    async def run(self) -> None:
        """Write the marks posted, a batch at a time, and tell each request whether its mark is
        stored: a mark answered 200 is on disk, one answered with an error is not."""
        try:
            while True:
                await self._posted.wait()
                await asyncio.sleep(MARK_BATCH_S)
                self._posted.clear()
                batch, self._pending = self._pending, []
                self._store(batch)
        finally:
            for _, future, _ in self._pending:
                future.cancel()
            self._pending = []

    def _store(self, batch: list[_PendingMark]) -> None:
        live = []
        for marker, future, request in batch:
            if future.done():
                continue
            if request.transport is None or request.transport.is_closing():
                future.set_result("the client went away before it was stored")  # it saw no 200
            else:
                live.append((marker, future))
        if not live:
            return
        try:
            _, rejected = self.store.append_valid([m for m, _ in live])
        except StoreWriteError as exc:
            log.warning("marks_not_stored", marks=len(live), error=str(exc))
            for _, future in live:
                future.set_result(f"the store cannot be written ({exc})")
            return
        refused = {id(record): reason for record, reason in rejected}
        for marker, future in live:
            reason = refused.get(id(marker))
            if reason is None:
                self.live.on_marker(marker)
            else:
                self.live.counts["bad_marks"] += 1
            future.set_result(None if reason is None else f"bad marker: {reason}")

    async def handle(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            marker = marker_from_json(body, default_host=self.default_host, now_ns=self.clock_ns())
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            self.live.counts["bad_marks"] += 1
            why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            return web.json_response({"error": f"bad marker: {why}"}, status=400)
        # queued and written with the marks posted with it; answered once it is on disk
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        entry = (marker, future, request)
        self._pending.append(entry)
        self._posted.set()
        try:
            why_not = await future
        except asyncio.CancelledError:
            # the request timed out or the collector stops: not stored, as its answer will say
            with contextlib.suppress(ValueError):
                self._pending.remove(entry)
            raise
        if why_not is not None:
            status = 400 if why_not.startswith("bad marker") else 503
            return web.json_response({"error": why_not, "stored": False}, status=status)
        return web.json_response({"ok": True, "ts_ns": marker.ts_ns, "stored": True})


def marker_from_json(body: Any, default_host: str, now_ns: int) -> Marker:
    """A Marker from the JSON body `gputrace mark` and the load generator post (``now_ns``: its
    time when the body gives none)."""
    if not isinstance(body, dict):
        raise TypeError("body must be a JSON object")
    label = body["label"]
    if not isinstance(label, str) or not label:
        raise ValueError("label must be a non-empty string")
    kind = body.get("kind", "phase")
    if kind not in ("phase", "end", "note"):
        raise ValueError("kind must be phase, end or note")
    target = body.get("target_concurrency")
    # bool is an int in Python: true as a concurrency reached the store and stopped its writer
    if target is not None and (isinstance(target, bool) or not isinstance(target, int)
                               or not 0 <= target <= MAX_CONCURRENCY):
        raise ValueError(f"target_concurrency must be an integer from 0 to {MAX_CONCURRENCY}")
    ts_ns = body.get("ts_ns") or now_ns
    if isinstance(ts_ns, bool) or not isinstance(ts_ns, int) or not 0 < ts_ns < 2**63:
        raise ValueError("ts_ns must be an integer of nanoseconds since the epoch")
    host = str(body.get("host") or default_host)
    for name, text in (("label", label), ("host", host)):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{name} is not valid Unicode (a lone surrogate)") from None
        if not text.isprintable() or len(text) > 200:
            raise ValueError(f"{name} must be printable text of at most 200 characters")
    return Marker(host=host, ts_ns=ts_ns, label=label, kind=kind, target_concurrency=target)
