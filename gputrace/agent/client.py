"""The collector's side of the agent: pull /v1/samples by sequence and probe the clock via /v1/time.

``base_url`` is the agent directly (``http://gpu-node:9402``) or a local port the SSH transport
forwards to the agent's loopback port. The cursor survives disconnects: a later pull resumes after
the last sample received; a cursor older than the agent's ring jumps to the oldest sample held and
counts the gap; a restarted agent (new instance id) is read again from its start.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import typing
from collections.abc import AsyncIterator, Callable
from dataclasses import MISSING, dataclass, fields
from typing import Any

import aiohttp

from gputrace.errors import SourceError, TransportError
from gputrace.logsetup import get_logger
from gputrace.model import ClockProbe, GpuSample

log = get_logger("agent.client")

_FIELDS = frozenset(f.name for f in fields(GpuSample))
_HINTS = typing.get_type_hints(GpuSample)
# per field: the type its value must have, and whether None (not available) is allowed
_KINDS: dict[str, tuple[type, bool]] = {
    f.name: (next(t for t in typing.get_args(_HINTS[f.name]) or (_HINTS[f.name],) if t is not type(None)),
             f.default is not MISSING)
    for f in fields(GpuSample)}
_INT64 = 1 << 63


def _value_problem(kind: type, optional: bool, value: object) -> str | None:
    """Why one JSON value cannot be its field's (a string where a count belongs reached the live
    view and stopped the agent source; a seq as text stopped the cursor), or None."""
    if value is None:
        return None if optional else "missing"
    if kind is str:
        if not isinstance(value, str):
            return "not a string"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "not valid Unicode"
        return None
    if kind is bool:
        return None if isinstance(value, bool) else "not true or false"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "not a number"
    if kind is int and not (isinstance(value, int) and -_INT64 <= value < _INT64):
        return "not a 64-bit integer"
    if isinstance(value, int) and not -_INT64 <= value < _INT64:
        return "out of range"
    return None


@dataclass(slots=True)
class PullStats:
    """What a client has seen: pages, samples, and what it could not get."""

    pages: int = 0
    samples: int = 0
    gaps: int = 0  # times the cursor fell out of the ring (410)
    missed_samples: int = 0  # samples lost to those gaps
    restarts: int = 0  # times the agent came back with a new instance id
    disconnects: int = 0
    bad_lines: int = 0
    read_to_end_ns: int | None = None  # when the newest pull that found less than a page was sent


def parse_sample_line(line: str) -> GpuSample:
    """One NDJSON line of /v1/samples -> GpuSample (unknown keys from newer agents are ignored)."""
    row = json.loads(line)
    if not isinstance(row, dict):
        raise ValueError("not a JSON object")
    values = {k: v for k, v in row.items() if k in _FIELDS}
    for name, (kind, optional) in _KINDS.items():
        problem = _value_problem(kind, optional, values.get(name))
        if problem is not None:
            raise ValueError(f"{name}: {problem}")
    return GpuSample(**values)


class AgentClient:
    """Pulls one agent's samples in order, resuming by sequence number."""

    def __init__(self, base_url: str, *, token: str | None = None,
                 ssl_context: ssl.SSLContext | None = None, page_limit: int = 5000,
                 timeout_s: float = 10.0, since: int = 0,
                 on_bad_line: Callable[[str], None] | None = None,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.base_url = base_url.rstrip("/")
        self.clock_ns = clock_ns  # the collector's clock, that probes are taken on
        self.on_bad_line = on_bad_line  # told why, for each line of a page that is not a sample
        self.page_limit = page_limit
        self.since = since  # the seq of the last sample received
        self.instance: str | None = None
        self.stats = PullStats()
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._ssl: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> AgentClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _get(self, path: str, params: dict[str, str] | None = None) -> tuple[int, Any, str]:
        url = self.base_url + path
        try:
            async with self._get_session().get(url, params=params, ssl=self._ssl) as resp:
                return resp.status, resp.headers, await resp.text()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise TransportError(f"agent {self.base_url}: {type(exc).__name__}: {exc}") from exc

    async def fetch_page(self) -> list[GpuSample]:
        """The next page after the cursor (possibly empty); advances the cursor past it."""
        for _ in range(3):  # a 410 or an agent restart re-asks at once with the corrected cursor
            status, headers, body = await self._get(
                "/v1/samples", {"since": str(self.since), "limit": str(self.page_limit)})
            if status == 401:
                raise SourceError(f"agent {self.base_url}: 401 unauthorized (token missing or wrong)")
            instance = headers.get("X-Gputrace-Instance")
            if instance and self.instance and instance != self.instance:
                log.warning("agent_restarted", agent=self.base_url)
                self.stats.restarts += 1
                self.instance, self.since = instance, 0
                continue
            self.instance = instance or self.instance
            if status == 410:
                oldest = int(json.loads(body)["oldest_seq"])
                missed = oldest - 1 - self.since
                self.stats.gaps += 1
                self.stats.missed_samples += missed
                log.warning("agent_samples_missed",
                            agent=self.base_url, missed=missed)
                self.since = oldest - 1
                continue
            if status != 200:
                raise SourceError(f"agent {self.base_url}: /v1/samples answered {status}: {body[:200]}")
            newest = headers.get("X-Gputrace-Newest-Seq")
            if newest is not None and int(newest) < self.since:
                # same instance id yet behind us: only possible if the id header was absent
                self.stats.restarts += 1
                self.since = 0
                continue
            return self._parse_page(body)
        raise SourceError(f"agent {self.base_url}: cursor kept moving; giving up this pull")

    def _parse_page(self, body: str) -> list[GpuSample]:
        out: list[GpuSample] = []
        for line in body.splitlines():
            if not line:
                continue
            try:
                s = parse_sample_line(line)
            except (ValueError, TypeError, RecursionError) as exc:
                self.stats.bad_lines += 1
                if self.stats.bad_lines == 1:  # a broken agent sends them by the page: said once
                    log.warning("agent_sample_line_skipped", agent=self.base_url, error=str(exc))
                if self.on_bad_line is not None:
                    self.on_bad_line(str(exc))
                continue
            out.append(s)
            if s.seq is not None:
                self.since = max(self.since, s.seq)
        self.stats.pages += 1
        self.stats.samples += len(out)
        return out

    async def follow(self, poll_s: float = 0.5, retry_max_s: float = 10.0) -> AsyncIterator[list[GpuSample]]:
        """Pages forever: at once while the agent has more, every ``poll_s`` once caught up;
        after a disconnect, retries with backoff and resumes after the last sample received."""
        backoff = 0.2
        while True:
            asked_ns = time.time_ns()
            try:
                page = await self.fetch_page()
            except TransportError as exc:
                self.stats.disconnects += 1
                log.warning("agent_unreachable", agent=self.base_url,
                            error=str(exc), since=self.since, retry_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, retry_max_s)
                continue
            backoff = 0.2
            if page:
                yield page
            if len(page) < self.page_limit:
                self.stats.read_to_end_ns = asked_ns  # after the yield: the consumer has the page
                await asyncio.sleep(poll_s)

    async def probe_clock(self, host: str | None = None) -> ClockProbe:
        """One NTP-style probe of the agent host's clock (keep the one with the smallest rtt)."""
        send_ns = self.clock_ns()
        status, _, body = await self._get("/v1/time")
        recv_ns = self.clock_ns()
        if status != 200:
            raise SourceError(f"agent {self.base_url}: /v1/time answered {status}")
        row = json.loads(body)
        return ClockProbe(host=host or str(row["host"]), local_send_ns=send_ns,
                          remote_ns=int(row["time_ns"]), local_recv_ns=recv_ns, via="agent")

    async def info(self) -> dict[str, Any]:
        """The agent's /v1/info: host, backend, versions, devices."""
        status, _, body = await self._get("/v1/info")
        if status != 200:
            raise SourceError(f"agent {self.base_url}: /v1/info answered {status}")
        info: dict[str, Any] = json.loads(body)
        return info
