"""The collector's agent client: resume by sequence across disconnects, 410 gaps, agent restarts.

Between client and agent sits a loopback TCP forwarder that the tests cut and restore, as the SSH
port forward the collector uses would be.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gputrace.agent.client import AgentClient, parse_sample_line
from gputrace.agent.server import Agent, AgentSettings, sample_line
from gputrace.errors import SourceError, TransportError
from gputrace.gpu.simulated import SimulatedSampler
from gputrace.model import GpuSample


class Forwarder:
    """127.0.0.1:port -> 127.0.0.1:target_port; stop() drops every connection and the listener.
    ``request_delay_s``: what reaches the agent is held that long first (a slow link)."""

    def __init__(self, target_port: int, request_delay_s: float = 0.0) -> None:
        self.target_port = target_port
        self.request_delay_s = request_delay_s
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for w in list(self._writers):
            w.close()
        await self._server.wait_closed()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    upstream: bool = False) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if upstream:
                    await asyncio.sleep(self.request_delay_s)
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer, upstream=True),
                             self._pipe(up_reader, writer))
        self._writers -= {writer, up_writer}


@contextlib.asynccontextmanager
async def serving(path: str, handler: Callable[[web.Request], Awaitable[web.Response]]) -> AsyncIterator[int]:
    """An aiohttp app on a free loopback port answering GET ``path`` with ``handler``: its port."""
    app = web.Application()
    app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    try:
        await site.start()
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


@pytest.fixture
async def agents() -> AsyncIterator[list[Agent]]:
    """Two independent sim agents (think: one agent, then the same host's agent restarted)."""
    started = []
    for _ in range(2):
        agent = Agent(SimulatedSampler("node-b", 2, pattern="square:0.4"),
                      AgentSettings(port=0, interval_s=0.01), host="node-b")
        await agent.start()
        started.append(agent)
    yield started
    for agent in started:
        await agent.stop()


async def _pull(client: AgentClient, n: int) -> list[GpuSample]:
    got: list[GpuSample] = []
    while len(got) < n:
        page = await client.fetch_page()
        got += page
        if not page:
            await asyncio.sleep(0.01)
    return got


def _seqs(samples: list[GpuSample]) -> list[int]:
    return [s.seq for s in samples if s.seq is not None]


def test_sample_line_round_trip() -> None:
    """An NDJSON line parses back to the same GpuSample with the ring's seq; unknown keys ignored."""
    s = GpuSample("h", 3, 123, utilization_ratio=0.25, power_w=301.5, memory_used_bytes=7, lost=False)
    line = sample_line(42, s)
    back = parse_sample_line(line[:-1] + ',"added_in_v2":1}')
    assert back == GpuSample("h", 3, 123, utilization_ratio=0.25, power_w=301.5, memory_used_bytes=7, seq=42)


async def test_resumes_after_disconnect_without_gap_or_duplicate(agents: list[Agent]) -> None:
    """A cut forward fails the pull with TransportError; after it returns, pulling resumes exactly."""
    fwd = Forwarder(agents[0].port or 0)
    await fwd.start()
    client = AgentClient(f"http://127.0.0.1:{fwd.port}", page_limit=50, timeout_s=2)
    try:
        before = await _pull(client, 120)
        await fwd.stop()
        with pytest.raises(TransportError):
            await client.fetch_page()
        await asyncio.sleep(0.1)  # the agent keeps sampling while the client is cut off
        await fwd.start()
        after = await _pull(client, 120)
    finally:
        await client.close()
    seqs = _seqs(before + after)
    assert seqs == list(range(1, len(seqs) + 1))
    assert client.stats.gaps == 0 and client.stats.restarts == 0


async def test_follow_rides_out_a_disconnect(agents: list[Agent]) -> None:
    """follow() keeps yielding pages across a cut forward, counting the disconnect, losing nothing."""
    fwd = Forwarder(agents[0].port or 0)
    await fwd.start()
    client = AgentClient(f"http://127.0.0.1:{fwd.port}", page_limit=40, timeout_s=2)
    got: list[GpuSample] = []
    cut = False
    try:
        async for page in client.follow(poll_s=0.02):
            got += page
            if not cut and len(got) >= 80:
                cut = True
                await fwd.stop()
                asyncio.get_running_loop().call_later(0.3, lambda: asyncio.ensure_future(fwd.start()))
            if len(got) >= 400:
                break
    finally:
        await client.close()
    seqs = _seqs(got)
    assert seqs == list(range(1, len(seqs) + 1))
    assert client.stats.disconnects >= 1


async def test_cursor_out_of_ring_jumps_to_oldest_and_counts_gap() -> None:
    """After a 410 the client continues at the oldest sample held and counts what it missed;
    every sample from the first on is then read or counted, none lost silently.

    The ring holds 1 s and is full when the cursor jumps to its oldest end, so on a loaded machine
    the ring can pass the cursor again before the next page (CI's parallel pass read 23-27, then
    29): that second gap is counted too, and the pages stay in order."""
    agent = Agent(SimulatedSampler("node-c", 2), AgentSettings(port=0, interval_s=0.01, buffer_s=1.0),
                  host="node-c")
    await agent.start()
    client = AgentClient(f"http://127.0.0.1:{agent.port}", page_limit=5)
    try:
        while agent.ring.oldest_seq() < 20:
            await asyncio.sleep(0.01)
        page = await client.fetch_page()
        first = page[0].seq
        assert first is not None
        assert client.stats.gaps >= 1 and client.stats.missed_samples == first - 1
        more = await _pull(client, 10)
        seqs = _seqs(page + more)
        assert seqs == sorted(set(seqs)) and seqs[0] == first, seqs
        assert client.stats.missed_samples + len(seqs) == seqs[-1], (client.stats, seqs)
    finally:
        await client.close()
        await agent.stop()


@contextlib.asynccontextmanager
async def behind_a_slow_link(host: str, buffer_s: float, request_delay_s: float
                             ) -> AsyncIterator[tuple[Agent, Forwarder, AgentClient]]:
    """A sim agent (2 GPUs at 100 Hz, a ring of ``buffer_s``) behind a forwarder that holds each
    request ``request_delay_s``, and a client through it reading pages of 1,000."""
    agent = Agent(SimulatedSampler(host, 2), AgentSettings(port=0, interval_s=0.01, buffer_s=buffer_s),
                  host=host)
    await agent.start()
    fwd = Forwarder(agent.port or 0, request_delay_s=request_delay_s)
    await fwd.start()
    client = AgentClient(f"http://127.0.0.1:{fwd.port}", page_limit=1000, timeout_s=5)
    try:
        yield agent, fwd, client
    finally:
        await client.close()
        await fwd.stop()
        await agent.stop()


async def test_a_link_slower_than_the_tick_reads_on_past_the_moving_ring() -> None:
    """Each request takes 40 ms to reach an agent whose ring drops a tick (2 samples) every 10 ms:
    asking again for the oldest sample a 410 named loses that race every time. The client asks
    past it by what the ring moved meanwhile, reads on, and counts every sample it skipped as one
    gap (before, the pull gave up after three 410s, and every later pull did the same)."""
    async with behind_a_slow_link("node-s", buffer_s=0.3, request_delay_s=0.04) as (agent, _, client):
        while agent.ring.oldest_seq() < 100:
            await asyncio.sleep(0.01)
        page = await client.fetch_page()
        seqs = _seqs(page)
        assert seqs and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert client.stats.gaps == 1 and client.stats.missed_samples == seqs[0] - 1
        more = await _pull(client, 20)
        assert _seqs(more)[0] == seqs[-1] + 1 and client.stats.gaps == 1


async def test_follow_keeps_trying_while_the_link_is_slower_than_the_ring() -> None:
    """An agent holding 0.25 s of samples behind a link taking 0.4 s a request: every pull finds its
    cursor gone, however far past the oldest it asks. follow() says why and keeps trying (it
    stopped the host's GPU samples for the rest of the capture); once the link is fast again it
    reads on."""
    problems: list[str | None] = []
    got: list[GpuSample] = []
    async with behind_a_slow_link("node-r", buffer_s=0.25, request_delay_s=0.4) as (_, fwd, client):
        async def read() -> None:
            async for page in client.follow(poll_s=0.01, retry_max_s=0.2, on_problem=problems.append):
                got.extend(page)
                if len(got) >= 20:
                    return

        reader = asyncio.create_task(read())
        try:
            for _ in range(200):
                if problems or reader.done():
                    break
                await asyncio.sleep(0.05)
            assert not reader.done() and not got
            assert problems and problems[0] and "faster than this link reads them" in problems[0]
            fwd.request_delay_s = 0.0
            await asyncio.wait_for(reader, 10)
        finally:
            reader.cancel()
    assert len(got) >= 20 and problems[-1] is None and client.stats.gaps >= 1


async def test_follow_rides_out_an_agent_answering_503(agents: list[Agent]) -> None:
    """A proxy in front of the agent answers 503 to its first three pulls: follow() retries as
    after a lost connection (it stopped the host's GPU samples for the rest of the capture), then
    reads every sample from the start."""
    refused = 0

    async def samples(request: web.Request) -> web.Response:
        nonlocal refused
        if refused < 3:
            refused += 1
            return web.Response(status=503, text="upstream busy")
        url = f"http://127.0.0.1:{agents[0].port}/v1/samples"
        async with aiohttp.ClientSession() as s, s.get(url, params=request.query) as r:
            return web.Response(status=r.status, body=await r.read(), headers={
                k: v for k, v in r.headers.items() if k.startswith("X-Gputrace")})

    got: list[GpuSample] = []
    async with serving("/v1/samples", samples) as port:
        client = AgentClient(f"http://127.0.0.1:{port}", page_limit=50, timeout_s=2)

        async def read() -> None:
            async for page in client.follow(poll_s=0.01, retry_max_s=0.05):
                got.extend(page)
                if len(got) >= 60:
                    return
        try:
            await asyncio.wait_for(read(), 20)
        finally:
            await client.close()
    assert refused == 3 and client.stats.disconnects == 3
    assert _seqs(got) == list(range(1, len(got) + 1))


async def test_restarted_agent_is_read_from_its_start(agents: list[Agent]) -> None:
    """When the forward reaches a new agent instance, the client starts over at its seq 1."""
    fwd = Forwarder(agents[0].port or 0)
    await fwd.start()
    client = AgentClient(f"http://127.0.0.1:{fwd.port}", page_limit=50, timeout_s=2)
    try:
        old = await _pull(client, 60)
        await fwd.stop()
        fwd.target_port = agents[1].port or 0
        await fwd.start()
        new = await _pull(client, 30)
    finally:
        await client.close()
    assert _seqs(old)[-1] >= 60
    assert _seqs(new)[0] == 1 and client.stats.restarts == 1
    assert client.instance == agents[1].instance


async def test_clock_probe_is_taken_on_the_injected_clock(agents: list[Agent]) -> None:
    """A client given a clock stamps the probe's send and receive on it (here 1 h behind the agent's)."""
    hour_ns = 3600 * 10**9
    client = AgentClient(f"http://127.0.0.1:{agents[0].port}", clock_ns=lambda: time.time_ns() - hour_ns)
    try:
        probe = await client.probe_clock()
    finally:
        await client.close()
    assert probe.local_send_ns <= probe.local_recv_ns
    assert probe.offset_ns == pytest.approx(hour_ns, abs=10**9)  # the agent reads ~1 h ahead


@pytest.mark.parametrize("answer", ['"soon"', "[1, 2]", '{"time_ns": 1e30, "host": "h"}',
                                    '{"time_ns": 1764650000.25, "host": "h"}', '{"time_ns": "17"}',
                                    '{"time_ns": 1764650000, "host": "h"}', '{"time_ns": true}',
                                    '{"time_ns": 1764650000000000000, "host": ["h"]}'])
async def test_a_malformed_time_answer_is_refused_counted_and_probing_goes_on(answer: str) -> None:
    """[robust] 12: a /v1/time answer that is no time in ns (a string, a list, 1e30, seconds as a
    float or int) is refused with a SourceError and counted; the next good answer is a probe (it
    stopped probing for the run, or was applied as a -296,187 s offset)."""
    answers = [answer, json.dumps({"time_ns": time.time_ns(), "host": "node-b"})]

    async def time_handler(request: web.Request) -> web.Response:
        return web.Response(text=answers.pop(0), content_type="application/json")

    async with serving("/v1/time", time_handler) as port, AgentClient(f"http://127.0.0.1:{port}") as client:
        with pytest.raises(SourceError, match="no time in ns"):
            await client.probe_clock("node-b")
        assert client.stats.bad_probes == 1
        probe = await client.probe_clock("node-b")
        assert abs(probe.remote_ns - time.time_ns()) < 5e9 and client.stats.bad_probes == 1


async def test_a_client_started_at_present_skips_the_agents_history(agents: list[Agent]) -> None:
    """[robust] 5: a client told to start at the present (with a margin) gets no sample older than
    the agent's time at first contact less the margin, and counts no gap."""
    await asyncio.sleep(1.5)
    async with AgentClient(f"http://127.0.0.1:{agents[0].port}", history_margin_s=0.5) as client:
        first_contact_ns = time.time_ns()
        got: list[GpuSample] = []
        async for page in client.follow(poll_s=0.02):
            got += page
            if len(got) >= 50:
                break
    assert min(s.ts_ns for s in got) >= first_contact_ns - int(0.7e9)
    assert client.stats.history_skipped > 0 and client.stats.gaps == 0


async def test_from_the_first_sample_kept_the_run_is_one_unbroken_sequence() -> None:
    """A driver's buffered samples carry earlier times than the tick they come with: one just older
    than the capture's margin, between kept ticks, is kept, so the run's sequence numbers have no
    gap (skipping it left gaps no one could tell from samples lost; a PP8 capture on a busy machine
    read 26, 28, 30, 32, 33, ...)."""
    from aiohttp import web

    now_ns = time.time_ns()
    margin_ns = 1_000_000_000
    times = {1: now_ns - 3 * margin_ns, 2: now_ns - margin_ns + 50_000_000,  # history, then a tick
             3: now_ns - margin_ns - 40_000_000,  # the driver's sample just before the margin
             4: now_ns - margin_ns + 60_000_000, 5: now_ns}
    body = b"".join(sample_line(seq, GpuSample("h", 0, ts, power_w=70.0)).encode() + b"\n"
                    for seq, ts in times.items())
    seq_header = {"X-Gputrace-Newest-Seq": "5", "X-Gputrace-Instance": "a"}

    async def time_handler(request: web.Request) -> web.Response:
        return web.json_response({"time_ns": now_ns, "host": "h"})

    async def info_handler(request: web.Request) -> web.Response:
        return web.json_response({"devices": [{}], "interval_s": 0.1}, headers=seq_header)

    async def samples_handler(request: web.Request) -> web.Response:
        page = body if request.query["since"] == "0" else b""
        return web.Response(body=page, content_type="application/x-ndjson", headers=seq_header)

    app = web.Application()
    app.router.add_get("/v1/time", time_handler)
    app.router.add_get("/v1/info", info_handler)
    app.router.add_get("/v1/samples", samples_handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        async with AgentClient(f"http://127.0.0.1:{runner.addresses[0][1]}", history_margin_s=1.0) as client:
            await client.start_at_present()
            page = await client.fetch_page()
    finally:
        await runner.cleanup()
    assert _seqs(page) == [2, 3, 4, 5] and client.stats.history_skipped == 1


class HeldExecutor(ThreadPoolExecutor):
    """Runs what it is given only once ``release`` is set: a page as slow to decode as a test wants."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.entered = threading.Event()
        self.release = threading.Event()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        def held() -> Any:
            self.entered.set()
            self.release.wait(timeout=30)
            return fn(*args, **kwargs)
        return super().submit(held)


async def test_a_page_being_decoded_does_not_hold_another_agents_pull(agents: list[Agent]) -> None:
    """[scale] A page is decoded off the event loop: while one agent's page is held in decoding,
    another agent's pages are pulled and decoded, and the held page then arrives whole (the
    pages of 32 agents decoded on the loop held it for a quarter second at a time)."""
    held = HeldExecutor()
    slow = AgentClient(f"http://127.0.0.1:{agents[0].port}", page_executor=held)
    other = AgentClient(f"http://127.0.0.1:{agents[1].port}")
    try:
        await asyncio.sleep(0.1)  # both agents hold samples
        pending = asyncio.create_task(slow.fetch_page())
        assert await asyncio.to_thread(held.entered.wait, 10), "the page was not decoded in the executor"
        meanwhile = await _pull(other, 40)
        assert not pending.done()
        held.release.set()
        page = await pending
    finally:
        held.release.set()
        held.shutdown()
        await slow.close()
        await other.close()
    assert len(meanwhile) >= 40 and _seqs(meanwhile) == list(range(1, len(meanwhile) + 1))
    assert page and _seqs(page) == list(range(1, len(page) + 1)) and slow.since == page[-1].seq


async def test_a_line_of_invalid_utf8_is_a_bad_line_and_the_page_goes_on() -> None:
    """A page line that is not UTF-8 is counted as a bad line; the samples around it are kept (the
    page was decoded whole and one such byte stopped the agent source)."""
    from aiohttp import web

    lines = [sample_line(1, GpuSample("h", 0, 1_764_650_000_000_000_000, power_w=70.0)).encode(),
             b'{"host":"h\xff","gpu_index":0,"ts_ns":1764650000100000000,"seq":2}',
             sample_line(3, GpuSample("h", 0, 1_764_650_000_200_000_000, power_w=71.0)).encode()]

    async def samples_handler(request: web.Request) -> web.Response:
        body = b"".join(line + b"\n" for line in lines) if request.query["since"] == "0" else b""
        return web.Response(body=body, content_type="application/x-ndjson")

    app = web.Application()
    app.router.add_get("/v1/samples", samples_handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    told: list[str] = []
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        async with AgentClient(url, on_bad_line=told.append) as client:
            page = await client.fetch_page()
    finally:
        await runner.cleanup()
    assert [(s.seq, s.power_w) for s in page] == [(1, 70.0), (3, 71.0)]
    assert client.stats.bad_lines == 1 and len(told) == 1 and client.since == 3
