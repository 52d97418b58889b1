"""The HTTP server side the agent and the collector share, and the one module that imports aiohttp's
server (``web`` is re-exported for handlers): the listen address, when a token is required, bearer
auth with one set of rules, and an aiohttp app behind limits a client cannot talk its way past, so
that no token is needed to keep the server answering.

- A connection must deliver a complete request header within ``header_timeout_s`` of connecting
  (or of its last answer); aiohttp's keep-alive timer, armed at connect, closes it otherwise.
- Reading the body and answering must end within ``request_timeout_s`` (408 otherwise).
- At most ``max_connections`` connections (and at most half the file-descriptor limit): a new one
  closes the oldest connection waiting for a request, preferring those that never completed one,
  so a flood of half-sent requests cannot lock out a client with a whole request.
- A request the client malformed (not HTTP, a bad header) is answered 400 and logged as one
  rate-limited warning line, never a traceback (aiohttp logs each with one: 1,000 of them made
  520 KB of log in 0.41 s).
- Running out of file descriptors at accept (asyncio logs it with a traceback per attempt:
  thousands a second) sheds idle connections, lowers the cap and logs one line per interval.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import ipaddress
import logging
import re
import resource
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web as web  # re-exported: handlers and apps elsewhere take it from here
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from gputrace.errors import UsageError
from gputrace.logsetup import get_logger

log = get_logger("httpserver")

_OUT_OF_RESOURCE = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_MIN_CONNECTIONS = 8
_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\n"
            b"Connection: close\r\n\r\n")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[..., Awaitable[web.StreamResponse]]  # what aiohttp's @web.middleware yields
OPEN_PATHS = frozenset({"/healthz"})  # liveness probes carry no secret; without one they learn up or down


# -- where to listen, and who may ask ----------------------------------------------------------------

def parse_listen(text: str, example_port: int = 9402) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT`` or ``:PORT`` (loopback) -> (host, port)."""
    m = re.fullmatch(r"\[([^\]]+)\]:(\d+)|([^:\[\]]*):(\d+)", text.strip())
    if not m:
        raise UsageError(f"--listen {text!r}: expected HOST:PORT (e.g. 127.0.0.1:{example_port})")
    host = m.group(1) or m.group(3) or "127.0.0.1"
    port = int(m.group(2) or m.group(4))
    if not 0 <= port <= 65535:
        raise UsageError(f"--listen {text!r}: port outside 0..65535")
    return host, port


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def require_token_beyond_loopback(host: str, token: str | None, insecure: bool, refusal: str,
                                  warning: str, **log_fields: Any) -> None:
    """Beyond loopback a token is required (UsageError ``refusal``) unless ``insecure`` says so
    explicitly, which is logged (``warning``). The rule is one; the words are each server's."""
    if is_loopback(host) or token is not None:
        return
    if not insecure:
        raise UsageError(refusal)
    log.warning(warning, **log_fields)


def has_token(request: web.Request, token: str | None) -> bool:
    """Whether ``request`` carries ``Authorization: Bearer <token>`` (the whole header, scheme
    included, compared in constant time); True when the server has no token."""
    if token is None:
        return True
    # a header is read as Latin-1 with surrogates for bytes past ASCII: back to those very bytes
    # (a plain encode() raised on them, a 500 with a traceback before authentication)
    given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, f"Bearer {token}".encode())


def bearer_auth(token: str, realm: str) -> Middleware:
    """The middleware both servers use: 401 with a JSON error and a Bearer challenge for a request
    without the token, on every path but ``OPEN_PATHS``."""

    @web.middleware
    async def check_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS and not has_token(request, token):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401,
                                     headers={"WWW-Authenticate": f'Bearer realm="{realm}"'})
        return await handler(request)

    return check_token


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one client may hold of a server; the defaults suit a few scrapers and collectors."""

    header_timeout_s: float = 30.0  # also how long an idle keep-alive connection stays open
    request_timeout_s: float = 30.0  # body read plus handler
    max_connections: int = 256
    report_interval_s: float = 60.0  # at most one line per interval about the cap or the fd limit


class RateLimitedWarning:
    """One log line per ``interval_s`` for a condition that recurs per connection, with the count of
    the occurrences it stood for."""

    def __init__(self, event: str, interval_s: float, clock: Callable[[], float] = time.monotonic):
        self.event = event
        self.interval_s = interval_s
        self.occurrences = 0
        self._clock = clock
        self._last_logged: float | None = None
        self._unlogged = 0

    def note(self, **fields: Any) -> None:
        self.occurrences += 1
        self._unlogged += 1
        now = self._clock()
        if self._last_logged is not None and now - self._last_logged < self.interval_s:
            return
        log.warning(self.event, occurrences=self._unlogged, **fields)
        self._last_logged = now
        self._unlogged = 0


class _ServerLog(logging.Logger):
    """The logger aiohttp's request handler is given: a request the client malformed (the parser's
    HttpProcessingError, answered 400 before any handler or token check) becomes one rate-limited
    warning; anything else is logged as aiohttp logs it, traceback included (a bug of ours)."""

    def __init__(self, server: str, interval_s: float) -> None:
        super().__init__("aiohttp.server")
        self.parent = logging.getLogger("aiohttp.server")  # its handlers and level, as before
        self.server = server
        self.bad_requests = RateLimitedWarning("malformed requests answered 400", interval_s)

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            reason = (exc_info.message or type(exc_info).__name__).strip().splitlines()
            self.bad_requests.note(server=self.server, remote=args[0] if args else None,
                                   reason=reason[0][:120] if reason else "")
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)


def fd_limit() -> int | None:
    """This process's soft limit on open files (None: unlimited)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY or soft < 0 else soft


class _Refused(asyncio.Protocol):
    """A connection over the cap while every held one is being answered: told 503, closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if isinstance(transport, asyncio.WriteTransport):
            transport.write(_REFUSAL)
        transport.close()


class HttpListener:
    """Serves ``app`` under ``limits``; ``start`` returns the bound port, ``stop`` closes everything.

    It puts its own middleware first in ``app`` (the request deadline, and which connections are
    being answered), so build the app, make the listener, then start it.
    """

    def __init__(self, app: web.Application, name: str, limits: HttpLimits | None = None) -> None:
        self.limits = limits or HttpLimits()
        self.name = name
        fds = fd_limit()
        cap = self.limits.max_connections if fds is None else min(self.limits.max_connections, fds // 2)
        self.max_connections = max(_MIN_CONNECTIONS, cap)
        self.refused = 0
        self._busy: set[RequestHandler] = set()  # aiohttp answers one request at a time per connection
        self._served: set[RequestHandler] = set()  # connections that completed a request header
        self._cap_warning = RateLimitedWarning(
            "connections at the cap: closing the oldest idle ones", self.limits.report_interval_s)
        self._fd_warning = RateLimitedWarning(
            "out of file descriptors: closing idle connections and lowering the cap",
            self.limits.report_interval_s)
        app.middlewares.insert(0, self._deadline)
        self.server_log = _ServerLog(name, self.limits.report_interval_s)
        self._runner = web.AppRunner(app, access_log=None, keepalive_timeout=self.limits.header_timeout_s,
                                     logger=self.server_log)
        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._previous_handler: Callable[[asyncio.AbstractEventLoop, dict[str, Any]], object] | None = None

    @property
    def connections(self) -> list[RequestHandler]:
        """The open connections, oldest first."""
        server = self._runner.server
        if server is None:
            return []
        return [c for c in server.connections if c.transport is not None]  # closed ones linger a tick

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        """Listen; OSError when the address cannot be bound."""
        await self._runner.setup()
        loop = asyncio.get_running_loop()
        try:
            # a TLS handshake is held to the header deadline too (asyncio's default is 60 s)
            self._server = await loop.create_server(
                self._accept, host, port, ssl=ssl_context, backlog=128, reuse_address=True,
                ssl_handshake_timeout=self.limits.header_timeout_s if ssl_context is not None else None)
        except OSError:
            await self._runner.cleanup()
            raise
        self._loop = loop
        self._previous_handler = loop.get_exception_handler()
        loop.set_exception_handler(self._on_loop_exception)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._runner.server is not None:  # set up and not cleaned up yet
            await self._runner.cleanup()  # closes idle connections, lets answers in progress finish
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        loop = self._loop
        if loop is not None and loop.get_exception_handler() == self._on_loop_exception:
            loop.set_exception_handler(self._previous_handler)
        self._loop = None

    # -- connections -----------------------------------------------------------------------------

    def _accept(self) -> asyncio.BaseProtocol:
        server = self._runner.server
        assert server is not None
        if len(self._served) > 2 * self.max_connections:
            self._served.intersection_update(server.connections)
        if len(self.connections) >= self.max_connections:
            self._cap_warning.note(server=self.name, max_connections=self.max_connections,
                                   refused=self.refused)
            if not self._make_room(1):
                self.refused += 1
                return _Refused()
        return server()

    def _make_room(self, wanted: int) -> bool:
        """Close the oldest idle connections until ``wanted`` more fit under the cap; False when
        every connection held is being answered."""
        live = self.connections
        excess = len(live) + wanted - self.max_connections
        if excess <= 0:
            return True
        idle = [c for c in live if c not in self._busy]
        never_served = [c for c in idle if c not in self._served]
        served = [c for c in idle if c in self._served]
        victims = (never_served + served)[:excess]
        for conn in victims:
            conn.force_close()
        return len(victims) == excess

    @web.middleware
    async def _deadline(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        conn = request.protocol
        self._busy.add(conn)
        self._served.add(conn)
        try:
            async with asyncio.timeout(self.limits.request_timeout_s) as deadline:
                return await handler(request)
        except TimeoutError:
            if not deadline.expired():
                raise
            timed_out = web.json_response({"error": f"request not read and answered within "
                                                    f"{self.limits.request_timeout_s:g} s"}, status=408)
            timed_out.force_close()  # the rest of its body may still come: not another request
            return timed_out
        finally:
            self._busy.discard(conn)

    # -- file descriptors --------------------------------------------------------------------------

    def _on_loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc, sock = context.get("exception"), context.get("socket")
        if (isinstance(exc, OSError) and exc.errno in _OUT_OF_RESOURCE and sock is not None
                and self._listens_on(sock)):
            self._shed_for_descriptors()
            return
        if self._previous_handler is not None:
            self._previous_handler(loop, context)
        else:
            loop.default_exception_handler(context)

    def _listens_on(self, sock: Any) -> bool:
        server = self._server
        return server is not None and any(s.fileno() == sock.fileno() for s in server.sockets)

    def _shed_for_descriptors(self) -> None:
        """Accept failed for want of descriptors (asyncio retries in a second): free a quarter of
        the connections and keep the cap below the count that exhausted them."""
        held = len(self.connections)
        self.max_connections = max(_MIN_CONNECTIONS, min(self.max_connections, held * 3 // 4))
        self._make_room(0)
        self._fd_warning.note(server=self.name, fd_limit=fd_limit(), connections=held,
                              max_connections=self.max_connections)
