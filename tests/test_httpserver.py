"""The shared HTTP listener's limits on real loopback servers: header and request deadlines, the
connection cap, and running out of file descriptors ([robust] #9)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from slow_clients import PARTIAL_REQUEST, get_within, half_sent_requests, raise_own_fd_limit
from structlog.testing import capture_logs

from gputrace.httpserver import HttpLimits, HttpListener, RateLimitedWarning

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass
class Served:
    listener: HttpListener
    port: int
    release: asyncio.Event = field(default_factory=asyncio.Event)  # lets /held answer
    held: int = 0  # requests /held has received


Serve = Callable[[HttpLimits], Awaitable[Served]]


async def _echo(request: web.Request) -> web.Response:
    return web.Response(body=await request.read())


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """Starts listeners on 127.0.0.1 (/healthz, POST /echo, /held: answers once released)."""
    listeners: list[HttpListener] = []

    async def start(limits: HttpLimits) -> Served:
        async def held(request: web.Request) -> web.Response:
            served.held += 1
            await served.release.wait()
            return web.json_response({"released": True})

        app = web.Application()
        app.router.add_get("/healthz", _ok)
        app.router.add_post("/echo", _echo)
        app.router.add_get("/held", held)
        listener = HttpListener(app, "test", limits)
        listeners.append(listener)
        served = Served(listener, await listener.start("127.0.0.1", 0))
        return served

    yield start
    for listener in listeners:
        await listener.stop()


async def _connect(port: int, first: bytes) -> Streams:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(first)
    await writer.drain()
    return reader, writer


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), seconds) is not None
    except TimeoutError:
        return False


async def _status(port: int, path: str, timeout_s: float = 5.0) -> int:
    reader, writer = await _connect(port, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                                    .encode())
    try:
        head = await asyncio.wait_for(reader.readline(), timeout_s)
    finally:
        writer.close()
    return int(head.split(b" ", 2)[1])


async def test_an_unfinished_header_is_closed_at_the_header_deadline(serve: Serve) -> None:
    """A header still unfinished at header_timeout_s is closed, even one trickled a byte at a time
    (aiohttp's default was an hour: the agent could be held by half-sent requests)."""
    port = (await serve(HttpLimits(header_timeout_s=0.5))).port
    silent_reader, silent = await _connect(port, PARTIAL_REQUEST)
    trickle_reader, trickle = await _connect(port, b"GET /healthz HTTP/1.1\r\n")
    for _ in range(30):  # 3 s of one byte each 0.1 s
        if trickle_reader.at_eof():
            break
        with contextlib.suppress(ConnectionError):
            trickle.write(b"X")
        await asyncio.sleep(0.1)
    assert await _closed_within(silent_reader, 3.0)
    assert await _closed_within(trickle_reader, 3.0)
    silent.close()
    trickle.close()
    assert await _status(port, "/healthz") == 200


async def test_a_body_not_sent_in_time_gets_408(serve: Serve) -> None:
    """A request whose body stops coming is answered 408 at request_timeout_s; a whole one echoes."""
    port = (await serve(HttpLimits(request_timeout_s=0.5))).port
    reader, writer = await _connect(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
                                    b"only ten b")
    head = await asyncio.wait_for(reader.readline(), 5.0)
    writer.close()
    assert head.startswith(b"HTTP/1.1 408")
    reader, writer = await _connect(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                                    b"Connection: close\r\n\r\nhello")
    answer = await asyncio.wait_for(reader.read(), 5.0)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"hello")


async def test_at_the_cap_the_oldest_idle_connection_makes_room(serve: Serve) -> None:
    """Past max_connections, half-sent requests are closed oldest first, a whole request is still
    answered, and the cap is logged once, not once per connection."""
    served = await serve(HttpLimits(max_connections=8))
    listener, port = served.listener, served.port
    with capture_logs() as logs:
        flood = [await _connect(port, PARTIAL_REQUEST) for _ in range(40)]
        assert await _status(port, "/healthz") == 200
    assert len(listener.connections) <= 8
    assert all([await _closed_within(reader, 3.0) for reader, _ in flood[:30]])
    for _, writer in flood:
        writer.close()
    cap_lines = [e for e in logs if e["event"].startswith("connections at the cap")]
    assert len(cap_lines) == 1 and cap_lines[0]["max_connections"] == 8


async def test_a_request_being_answered_is_never_closed_to_make_room(serve: Serve) -> None:
    """When every connection is in the middle of an answer, a new one is told 503 and closed;
    the answers in progress complete."""
    served = await serve(HttpLimits(max_connections=8))
    held = [asyncio.create_task(_status(served.port, "/held", timeout_s=10.0)) for _ in range(8)]
    while served.held < 8:
        await asyncio.sleep(0.01)
    with capture_logs():
        assert await _status(served.port, "/healthz") == 503
    served.release.set()
    assert await asyncio.gather(*held) == [200] * 8
    assert served.listener.refused == 1


def test_a_repeated_warning_is_one_line_per_interval() -> None:
    """A condition met thousands of times logs once per interval, with the count it stands for."""
    now = [0.0]
    warning = RateLimitedWarning("out of something", interval_s=60.0, clock=lambda: now[0])
    with capture_logs() as logs:
        for i in range(5000):
            now[0] = i * 0.01  # 50 s
            warning.note()
        now[0] = 61.0
        warning.note()
    assert [(e["event"], e["occurrences"]) for e in logs] == [("out of something", 1),
                                                              ("out of something", 5000)]
    assert warning.occurrences == 5001


_EXHAUSTED_SERVER = textwrap.dedent("""
    import asyncio, os
    from aiohttp import web
    from gputrace.httpserver import HttpLimits, HttpListener
    from gputrace.logsetup import configure_logging

    async def ok(request):
        return web.json_response({"ok": True})

    async def main():
        configure_logging("json")
        app = web.Application()
        app.router.add_get("/healthz", ok)
        listener = HttpListener(app, "test", HttpLimits(max_connections=256))
        port = await listener.start("127.0.0.1", 0)
        held = []  # what another part of the process holds (the store's files, say)
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        for fd in held[:40]:
            os.close(fd)
        print(port, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


def test_out_of_descriptors_at_accept_is_logged_once_and_sheds_idle_connections() -> None:
    """With file descriptors gone below the cap, a flood of half-sent requests makes accept fail:
    the server logs that once (asyncio alone logs a traceback per attempt, thousands), closes idle
    connections and lowers its cap, and a whole request is answered again."""
    raise_own_fd_limit(600)
    proc = subprocess.Popen([sys.executable, "-c", _EXHAUSTED_SERVER], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        port = int(proc.stdout.readline())
        with half_sent_requests(port, 200):
            status, _ = get_within(port, "/healthz", timeout_s=10.0)
            assert status == 200
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    lines = err.splitlines()
    out_of_fds = [line for line in lines if "out of file descriptors" in line]
    assert len(out_of_fds) == 1, err[-2000:]
    assert "Traceback" not in err and len(lines) <= 3, err[-2000:]
