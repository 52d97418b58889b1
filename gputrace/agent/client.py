"""The collector's side of the agent: pull /v1/samples by sequence and probe the clock via /v1/time.

``base_url`` is the agent directly (``http://gpu-node:9402``) or a local port the SSH transport
forwards to the agent's loopback port. The cursor survives disconnects: a later pull resumes after
the last sample received; a cursor older than the agent's ring jumps to the oldest sample held and
counts the gap; a restarted agent (new instance id) is read again from its start.

A capture starts at the agent's present (``history_margin_s``): the agent holds up to 15 minutes
of samples from before the run, and a run that took them reported a 910 s duration for a 12 s
capture. The cursor starts near the agent's newest sample and samples older than the agent's
time at the first contact, less the margin, are skipped.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import typing
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import MISSING, dataclass, fields
from typing import Any

import aiohttp

from gputrace.errors import CursorKeptMoving, SourceError, TransportError
from gputrace.json_types import JsonObject
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
_MIN_EPOCH_NS = 10**18  # 2001-09-09 in ns: a smaller "time_ns" is seconds, ms or us, not ns
# Samples taken this long before the capture started are kept (for alignment at the run's start:
# one agent interval is 0.1 s by default, and a clock probe's round trip is well under 1 s).
HISTORY_MARGIN_S = 2.0
# Tries of one pull: a 410 re-asks at the oldest sample, a second one past it (_past_the_ring)
FETCH_ATTEMPTS = 4


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
    history_skipped: int = 0  # samples from before the capture's start (its margin aside), not kept
    bad_probes: int = 0  # /v1/time answers that were not a time in ns (refused, probing goes on)


def parse_sample_line(line: str | bytes) -> GpuSample:
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


def decode_page(body: bytes) -> list[GpuSample | str]:
    """A /v1/samples body -> per non-empty line its GpuSample, or why it is none. Pure: the client
    runs it off the event loop (17-50 us a sample, 5000 to a page: one page held the loop of a
    collector of 32 agents for up to 0.25 s, and the other agents' pulls and logs waited)."""
    out: list[GpuSample | str] = []
    for line in body.split(b"\n"):  # NDJSON: only \n ends a line (splitlines also cuts at \r)
        if not line:
            continue
        try:
            out.append(parse_sample_line(line))  # invalid UTF-8 is a ValueError: a bad line
        except (ValueError, TypeError, RecursionError) as exc:
            out.append(str(exc))
    return out


class AgentClient:
    """Pulls one agent's samples in order, resuming by sequence number."""

    def __init__(self, base_url: str, *, token: str | None = None,
                 ssl_context: ssl.SSLContext | None = None, page_limit: int = 5000,
                 timeout_s: float = 10.0, since: int = 0,
                 on_bad_line: Callable[[str], None] | None = None,
                 clock_ns: Callable[[], int] = time.time_ns,
                 history_margin_s: float | None = None,
                 page_executor: Executor | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.page_executor = page_executor  # where pages are decoded; None: the loop's default
        self.clock_ns = clock_ns  # the collector's clock, that probes are taken on
        self.on_bad_line = on_bad_line  # told why, for each line of a page that is not a sample
        self.page_limit = page_limit
        self.since = since  # the seq of the last sample received
        self.instance: str | None = None
        # None: every sample the agent holds; else start at its present, less this margin
        self.history_margin_s = history_margin_s
        self.min_ts_ns: int | None = None  # samples older than this (agent clock) are skipped ...
        self.history_seq = 0  # ... among those the agent held at the first contact (seq up to this)
        self._started = history_margin_s is None  # the cursor was placed (at the first contact)
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

    async def _get_bytes(self, path: str, params: dict[str, str] | None = None) -> tuple[int, Any, bytes]:
        url = self.base_url + path
        try:
            async with self._get_session().get(url, params=params, ssl=self._ssl) as resp:
                return resp.status, resp.headers, await resp.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise TransportError(f"agent {self.base_url}: {type(exc).__name__}: {exc}") from exc

    async def _get(self, path: str, params: dict[str, str] | None = None) -> tuple[int, Any, str]:
        status, headers, body = await self._get_bytes(path, params)
        return status, headers, body.decode("utf-8", errors="replace")

    async def fetch_page(self) -> list[GpuSample]:
        """The next page after the cursor (possibly empty); advances the cursor past it."""
        gone_oldest: int | None = None  # the oldest seq the previous 410 of this call named
        for _ in range(FETCH_ATTEMPTS):  # a 410 or an agent restart re-asks with the corrected cursor
            status, headers, body = await self._get_bytes(
                "/v1/samples", {"since": str(self.since), "limit": str(self.page_limit)})
            if status == 401:
                raise SourceError(f"agent {self.base_url}: 401 unauthorized (token missing or wrong)")
            instance = headers.get("X-Gputrace-Instance")
            if instance and self.instance and instance != self.instance:
                log.warning("agent_restarted", agent=self.base_url)
                self.stats.restarts += 1
                self.instance, self.since, self.history_seq = instance, 0, 0  # all new
                continue
            self.instance = instance or self.instance
            if status == 410:
                oldest = int(json.loads(body)["oldest_seq"])
                self._skip_to(self._past_the_ring(oldest, gone_oldest, headers), first=gone_oldest is None)
                gone_oldest = oldest
                continue
            if status != 200:
                # a 5xx or 429 (an agent or a proxy in front of it, for now) is retried as a lost
                # connection is; anything else is a question the agent will never answer
                error = TransportError if status >= 500 or status == 429 else SourceError
                raise error(f"agent {self.base_url}: /v1/samples answered {status}: "
                            f"{body[:200].decode('utf-8', errors='replace')}")
            newest = headers.get("X-Gputrace-Newest-Seq")
            if newest is not None and int(newest) < self.since:
                # same instance id yet behind us: only possible if the id header was absent
                self.stats.restarts += 1
                self.since = self.history_seq = 0
                continue
            decoded = await asyncio.get_running_loop().run_in_executor(self.page_executor, decode_page, body)
            return self._take_page(decoded)
        raise CursorKeptMoving(f"agent {self.base_url}: cursor kept moving; giving up this pull")

    @staticmethod
    def _past_the_ring(oldest: int, gone_oldest: int | None, headers: Any) -> int:
        """The cursor to ask with after a 410 naming ``oldest``. First the oldest sample itself;
        if that was gone too by the time the request arrived (the ring drops samples while a
        request travels: a link slower than the agent's tick), as far again past it as the ring
        moved in that round trip, twice over, within what the agent holds. Asking for exactly the
        oldest sample again would lose that race on every try."""
        if gone_oldest is None or oldest <= gone_oldest:
            return oldest - 1
        target = oldest - 1 + 2 * (oldest - gone_oldest)
        newest = _int_header(headers, "X-Gputrace-Newest-Seq")
        return min(target, newest - 1) if newest is not None and newest > oldest else target

    def _skip_to(self, since: int, *, first: bool) -> None:
        """Move the cursor forward past samples the agent no longer holds, counting them (a gap
        per pull, however many tries it took) unless they came before the capture's first page."""
        missed = since - self.since
        if self.stats.pages or self.min_ts_ns is None:  # before the first page: not ours
            self.stats.gaps += int(first)
            self.stats.missed_samples += missed
            log.warning("agent_samples_missed", agent=self.base_url, missed=missed)
        self.since = since

    def _take_page(self, decoded: list[GpuSample | str]) -> list[GpuSample]:
        """The page's samples past the capture's start, in order; moves the cursor past them and
        counts the lines that were no sample."""
        out: list[GpuSample] = []
        for s in decoded:
            if isinstance(s, str):
                self.stats.bad_lines += 1
                if self.stats.bad_lines == 1:  # a broken agent sends them by the page: said once
                    log.warning("agent_sample_line_skipped", agent=self.base_url, error=s)
                if self.on_bad_line is not None:
                    self.on_bad_line(s)
                continue
            if s.seq is not None and s.seq <= self.history_seq and self.min_ts_ns is not None \
                    and s.ts_ns < self.min_ts_ns:
                self.stats.history_skipped += 1
                self.since = max(self.since, s.seq)
                continue
            out.append(s)
            # from the first sample kept on, every one is: the run's samples are one unbroken
            # sequence (a driver's buffered samples carry earlier times than the tick around them:
            # skipping those among kept ticks left gaps no one could tell from lost samples)
            self.history_seq = 0
            if s.seq is not None:
                self.since = max(self.since, s.seq)
        self.stats.pages += 1
        self.stats.samples += len(out)
        return out

    async def start_at_present(self) -> None:
        """Place the cursor at the agent's present, less ``history_margin_s``: from its /v1/info
        (newest seq, sampling rate) back over about twice the margin's samples, and skip those
        older than its /v1/time less the margin."""
        assert self.history_margin_s is not None
        margin_s = self.history_margin_s
        try:
            agent_now_ns: int | None = (await self._time())[0]
        except TransportError:
            raise
        except SourceError:  # a broken /v1/time: start by sequence only
            agent_now_ns = None
        status, headers, body = await self._get("/v1/info")
        # without an answer here (an older agent, a proxy's error page) the ring is read whole
        newest = _int_header(headers, "X-Gputrace-Newest-Seq") if status == 200 else None
        try:
            info = json.loads(body)
            devices = max(1, len(info["devices"]))
            per_s = devices * (1.0 / float(info["interval_s"]) + 6.0)  # ticks + driver samples
        except (ValueError, TypeError, KeyError, ZeroDivisionError, RecursionError):
            per_s = None
        if newest is not None and per_s is not None and per_s < 1e6:
            self.since = max(0, newest - int(per_s * margin_s * 2) - 1)
        if status == 200:
            self.instance = headers.get("X-Gputrace-Instance") or self.instance
        self.min_ts_ns = agent_now_ns - int(margin_s * 1e9) if agent_now_ns is not None else None
        # only what the agent held then is history: a later sample stamped earlier (the agent
        # host's clock stepped back) is the run's
        self.history_seq = newest or 0
        self._started = True
        log.info("agent_capture_start", agent=self.base_url, since=self.since, margin_s=margin_s)

    async def follow(self, poll_s: float = 0.5, retry_max_s: float = 10.0,
                     on_problem: Callable[[str | None], None] | None = None,
                     ) -> AsyncIterator[list[GpuSample]]:
        """Pages forever: at once while the agent has more, every ``poll_s`` once caught up;
        after a disconnect, retries with backoff and resumes after the last sample received.
        ``on_problem`` is told when the agent stops answering (no GPU samples meanwhile), and
        None once it answers again."""
        backoff = 0.2
        told: str | None = None
        while True:
            asked_ns = time.time_ns()
            try:
                if not self._started:
                    await self.start_at_present()
                page = await self.fetch_page()
            except (TransportError, CursorKeptMoving) as exc:
                lost = isinstance(exc, CursorKeptMoving)
                self.stats.disconnects += int(not lost)
                log.warning("agent_behind" if lost else "agent_unreachable", agent=self.base_url,
                            error=str(exc), since=self.since, retry_s=backoff)
                if told is None and on_problem is not None:
                    told = (f"the agent drops samples faster than this link reads them ({exc}): "
                            "retrying" if lost else
                            f"the agent does not answer ({exc}): no GPU samples until it does; retrying")
                    on_problem(told)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, retry_max_s)
                continue
            if told is not None and on_problem is not None:
                on_problem(None)
            told = None
            backoff = 0.2
            if page:
                yield page
            if len(page) < self.page_limit:
                self.stats.read_to_end_ns = asked_ns  # after the yield: the consumer has the page
                await asyncio.sleep(poll_s)

    async def _time(self) -> tuple[int, str]:
        """The agent's /v1/time: (its time_ns, its host name); SourceError for an answer that is
        not an integer time in ns (a string, a list, 1e30, seconds as a float), counted."""
        status, _, body = await self._get("/v1/time")
        if status != 200:
            raise SourceError(f"agent {self.base_url}: /v1/time answered {status}")
        try:
            row = json.loads(body)
            time_ns, host = row["time_ns"], row.get("host", "")
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            time_ns, host = None, ""
        is_ns = type(time_ns) is int and _MIN_EPOCH_NS <= time_ns < _INT64  # bool is no int here
        if not is_ns or not isinstance(host, str):
            self.stats.bad_probes += 1
            if self.stats.bad_probes == 1:
                log.warning("agent_time_refused", agent=self.base_url, answer=body[:200],
                            why="not {'time_ns': <integer ns since the epoch>, 'host': <name>}")
            raise SourceError(f"agent {self.base_url}: /v1/time answered no time in ns: {body[:100]!r}")
        return time_ns, host

    async def probe_clock(self, host: str | None = None) -> ClockProbe:
        """One NTP-style probe of the agent host's clock (keep the one with the smallest rtt)."""
        send_ns = self.clock_ns()
        remote_ns, remote_host = await self._time()
        recv_ns = self.clock_ns()
        return ClockProbe(host=host or remote_host, local_send_ns=send_ns,
                          remote_ns=remote_ns, local_recv_ns=recv_ns, via="agent")

    async def info(self) -> JsonObject:
        """The agent's /v1/info as sent: host, backend, versions, devices."""
        status, _, body = await self._get("/v1/info")
        if status != 200:
            raise SourceError(f"agent {self.base_url}: /v1/info answered {status}")
        try:
            info = json.loads(body)
        except (ValueError, RecursionError):
            info = None
        if not isinstance(info, dict):
            raise SourceError(f"agent {self.base_url}: /v1/info is not a JSON object")
        return info


def _int_header(headers: Any, name: str) -> int | None:
    try:
        return int(headers.get(name))
    except (TypeError, ValueError):
        return None
