"""The collector's seams, in process on real loopback servers and real files: an injected transport
factory, an explicit drain, the built-in load attached through a method, and one bearer-auth rule
shared with the agent (the HTTP server side lives in gputrace.httpserver)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fake_clock import FakeClock, until

from gputrace.agent.server import Agent, AgentSettings
from gputrace.collect import CollectOptions, Collector
from gputrace.collect.collector import DRAIN_QUIET_S
from gputrace.config import Config, HostConfig, parse_config
from gputrace.gpu.simulated import SimulatedSampler
from gputrace.remote.local import LocalTransport
from gputrace.remote.transport import Transport
from gputrace.store import Store

QUICK = {"agent_poll_s": 0.02, "flush_s": 0.05, "probe_interval_s": 3600.0, "ready_timeout_s": 10.0}


def decode_lines(start: int, n: int) -> str:
    ts = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S")
    return "".join(f"[{ts} PP0] Decode batch, #running-req: 8, #token: {i}, token usage: 0.05, "
                   f"cuda graph: True, gen throughput (token/s): 250.00, #queue-req: 0\n"
                   for i in range(start, start + n))


def config(tmp_path: Path, logs: dict[str, Path], agent_url: str | None = None) -> Config:
    text = ""
    for name, log in logs.items():
        agent = f'agent = "{agent_url}"\n' if agent_url else ""
        text += (f'[[hosts]]\nname = "{name}"\n{agent}\n[hosts.log]\nkind = "file"\n'
                 f'path = {json.dumps(str(log))}\nengine = "sglang"\n\n')
    return parse_config(text, tmp_path / "gputrace.toml")


Start = Callable[..., Awaitable[Collector]]


@pytest.fixture
async def start_collector(tmp_path: Path) -> AsyncIterator[Start]:
    """Starts collectors into fresh stores under tmp_path; stops them after the test."""
    started: list[Collector] = []

    async def start(cfg: Config, **kw: Any) -> Collector:
        store = Store.create(tmp_path / f"run{len(started)}")
        options = CollectOptions(**{"listen": None, **QUICK, **kw.pop("options", {})})
        collector = Collector(cfg, store, options, **kw)
        started.append(collector)
        await collector.start()
        return collector

    yield start
    for collector in started:
        await collector.stop()
        collector.store.close()


async def test_the_collector_reaches_hosts_through_the_injected_factory(
        tmp_path: Path, start_collector: Start) -> None:
    """Every configured host is reached through the factory given, and its log read through it."""
    logs = {"n0": tmp_path / "n0.log", "n1": tmp_path / "n1.log"}
    for i, log in enumerate(logs.values()):
        log.write_text(decode_lines(100 * i, 5))
    asked: list[str] = []

    async def connect(host: HostConfig) -> Transport:
        asked.append(host.name)
        return LocalTransport(host.name)

    collector = await start_collector(config(tmp_path, logs), connect=connect)
    assert await collector.drain()
    assert asked == ["n0", "n1"]
    rows = collector.store.sql("SELECT host, count(*) FROM scheduler_events GROUP BY host ORDER BY host")
    assert rows == [("n0", 5), ("n1", 5)]


async def test_drain_returns_once_lines_written_before_it_are_stored(
        tmp_path: Path, start_collector: Start) -> None:
    """Lines appended just before drain() are in the store when it returns, without stop()."""
    log = tmp_path / "n0.log"
    log.write_text(decode_lines(0, 10))
    collector = await start_collector(config(tmp_path, {"n0": log}))
    with log.open("a") as fh:
        fh.write(decode_lines(10, 2000))
    assert await collector.drain(timeout_s=20.0)
    assert collector.store.count("scheduler_events") == 2010


async def test_drain_waits_for_the_agent_to_be_read_to_the_end(
        tmp_path: Path, start_collector: Start) -> None:
    """Every sample the agent held when drain() was called is in the store when it returns."""
    agent = Agent(SimulatedSampler("n0", 4), AgentSettings(port=0, interval_s=0.01), host="n0")
    await agent.start()
    try:
        log = tmp_path / "n0.log"
        log.write_text(decode_lines(0, 3))
        collector = await start_collector(config(tmp_path, {"n0": log}, f"http://127.0.0.1:{agent.port}"))
        # the agent samples 400 a second (its ring files them in batches)
        await until(lambda: agent.ring.newest_seq >= 200, "the agent to hold 200 samples")
        held = agent.ring.newest_seq
        assert await collector.drain(timeout_s=20.0)
        assert collector.store.count("gpu_samples") >= held > 0
    finally:
        await agent.stop()


async def test_drain_gives_up_after_its_timeout_while_a_log_keeps_growing(
        tmp_path: Path, start_collector: Start) -> None:
    """A log written to without pause never falls quiet: drain() says so by its timeout, both read
    on the collector's clock (here the test's, a line every 0.1 s of it); once the log pauses for
    the quiet time, drain() returns True."""
    log = tmp_path / "n0.log"
    log.write_text(decode_lines(0, 1))
    clock = FakeClock()
    collector = await start_collector(config(tmp_path, {"n0": log}), clock_ns=clock)
    drained = asyncio.create_task(collector.drain(timeout_s=1.0))
    lines = 1
    while not drained.done():
        assert lines <= 40, "drain did not time out after 1 s of its clock"
        with log.open("a") as fh:
            fh.write(decode_lines(lines, 1))
        lines += 1
        await until(lambda n=lines: collector.live.counts["log_lines"] == n, f"line {lines}")  # type: ignore[misc]
        clock.advance(0.1)
    assert drained.result() is False
    assert lines >= 11  # the timeout came after 1 s of the clock (10 steps of 0.1 s), not before
    assert collector.store.count("scheduler_events") > 1  # what arrived was written all the same
    asked = clock.reads
    quiet = asyncio.create_task(collector.drain(timeout_s=1.0))
    await until(lambda: clock.reads > asked, "drain to take its start time")
    clock.advance(DRAIN_QUIET_S)
    assert await asyncio.wait_for(quiet, 10) is True
    assert collector.store.count("scheduler_events") == lines


class CountingLoad:
    """A load whose requests in flight the test sets."""

    inflight = 0


async def test_an_attached_load_shows_its_requests_in_flight_live(
        tmp_path: Path, start_collector: Start) -> None:
    """attach_load wires the in-process load's in-flight count into /v1/status, read each time."""
    log = tmp_path / "n0.log"
    log.touch()
    collector = await start_collector(config(tmp_path, {"n0": log}))
    assert collector.status().inflight is None
    load = CountingLoad()
    collector.attach_load(load)
    load.inflight = 3
    assert collector.status().inflight == 3


async def _answers(url: str, headers: dict[str, str]) -> tuple[int, str | None]:
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as resp:
        await resp.read()
        return resp.status, resp.headers.get("WWW-Authenticate")


async def test_agent_and_collector_check_the_bearer_token_by_the_same_rules(
        tmp_path: Path, start_collector: Start) -> None:
    """Same token, same requests, same answers: 401 with a Bearer challenge without the exact
    header (wrong token, no scheme), through with it, /healthz open on both."""
    agent = Agent(SimulatedSampler("n0", 1), AgentSettings(port=0, token="s3cret"), host="n0")
    await agent.start()
    try:
        log = tmp_path / "n0.log"
        log.touch()
        collector = await start_collector(config(tmp_path, {"n0": log}),
                                          options={"listen": "127.0.0.1:0", "http_token": "s3cret"})
        guarded = {"agent": f"http://127.0.0.1:{agent.port}/v1/info",
                   "collector": f"{collector.url}/v1/status"}
        seen: dict[str, list[tuple[int, bool]]] = {}
        for server, url in guarded.items():
            seen[server] = []
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                            {"Authorization": "Bearer s3cret"}):
                status, challenge = await _answers(url, headers)
                seen[server].append((status, bool(challenge and challenge.startswith("Bearer "))))
            status, _ = await _answers(url.rsplit("/v1/", 1)[0] + "/healthz", {})
            seen[server].append((401 if status == 401 else 200, False))  # 503 (stale) is open too
        assert seen["agent"] == seen["collector"] == [(401, True)] * 3 + [(200, False), (200, False)]
    finally:
        await agent.stop()


async def test_the_collector_healthz_without_the_token_says_only_whether(
        tmp_path: Path, start_collector: Start) -> None:
    """/healthz is open without the token, as the agent's is, and then carries no problem detail."""
    collector = await start_collector(config(tmp_path, {"n0": tmp_path / "missing.log"}),
                                      options={"listen": "127.0.0.1:0", "http_token": "s3cret",
                                               "ready_timeout_s": 0.5})
    # the follower reports the missing file shortly after start
    await until(lambda: collector.problems(), "the missing log among the problems")
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{collector.url}/healthz") as resp:
            assert resp.status == 503 and await resp.json() == {"ok": False}
        with_token = {"Authorization": "Bearer s3cret"}
        async with session.get(f"{collector.url}/healthz", headers=with_token) as resp:
            body = await resp.json()
    assert resp.status == 503 and "missing.log" in json.dumps(body["problems"])


def test_the_collector_does_not_import_the_agent_server() -> None:
    """The collector takes listen parsing and auth from gputrace.httpserver, not the agent."""
    code = "import sys, gputrace.collect; print('gputrace.agent.server' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


async def test_a_capture_takes_agent_samples_from_its_start_not_the_agents_history(
        tmp_path: Path, start_collector: Start) -> None:
    """[robust] 5: against an agent up for a while, the run holds samples from its start (less the
    stated margin), none of the agent's older ring, and no spurious gap (a 12 s capture had a
    910 s duration and agent_samples_missed)."""
    from gputrace.agent import client

    margin_s = getattr(client, "HISTORY_MARGIN_S", 2.0)  # the stated margin
    sampler = SimulatedSampler("n0", 4)
    agent = Agent(sampler, AgentSettings(port=0, interval_s=0.01, buffer_s=3.0), host="n0")
    # the agent up for a while: its ring filled as its sampling loop fills it, 4.5 s of ticks
    # (older history than the margin, and a ring full)
    now_ns = time.time_ns()
    for tick_ns in range(now_ns - int((margin_s + 2.5) * 1e9), now_ns, int(0.01e9)):
        agent.ring.extend(sampler.sample_rows(tick_ns), tick_ns)
    await agent.start()
    try:
        log = tmp_path / "n0.log"
        log.write_text(decode_lines(0, 3))
        started_ns = time.time_ns()
        collector = await start_collector(config(tmp_path, {"n0": log}, f"http://127.0.0.1:{agent.port}"))
        await until(lambda: collector.live.counts["gpu_samples"] > 100, "100 samples read")
        assert await collector.drain(timeout_s=20.0)
        first_ns, count = collector.store.sql("SELECT min(ts_ns), count(*) FROM gpu_samples")[0]
        agent_client = collector._hosts[0].agent
        assert agent_client is not None
        assert count > 100
        assert first_ns >= started_ns - int((margin_s + 0.2) * 1e9)
        # the margin is there: the first sample kept is from about the margin before first contact.
        # From the first sample kept on every one is kept (client._take_page), and a tick's rows
        # hold each GPU's driver samples, stamped at the driver period's edges before the tick: GPU
        # 1's may precede GPU 0's tick, the first kept, by up to one driver period (seen: 3 ms).
        min_ts_ns = getattr(agent_client, "min_ts_ns", None)
        period_ns = sampler.driver_period_ns
        assert min_ts_ns is not None
        assert min_ts_ns - period_ns <= first_ns <= min_ts_ns + int(0.5e9)
        assert agent_client.stats.gaps == 0 and agent_client.stats.missed_samples == 0
    finally:
        await agent.stop()


@pytest.mark.parametrize("authorization", [b"Bearer \xff\xfe", b"Bearer tok\xc3\xa9", b"\x80"])
async def test_a_non_utf8_token_or_a_deeply_nested_mark_is_a_4xx_without_a_traceback(
        tmp_path: Path, start_collector: Start, authorization: bytes,
        caplog: pytest.LogCaptureFixture) -> None:
    """[robust] 11: a non-UTF-8 Authorization header is a 401 and a mark nested 100,000 deep a 400,
    on a running collector, with nothing logged as an error (both were a 500 with a traceback,
    before authentication)."""
    log = tmp_path / "n0.log"
    log.write_text(decode_lines(0, 1))
    collector = await start_collector(config(tmp_path, {"n0": log}),
                                      options={"listen": "127.0.0.1:0", "http_token": "tok"})
    assert collector.url is not None
    port = int(collector.url.rsplit(":", 1)[1])

    async def post(auth: bytes, body: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/mark HTTP/1.1\r\nHost: c\r\nContent-Type: application/json\r\n"
                     b"Authorization: " + auth + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                     % len(body) + body)
        await writer.drain()
        answer = await reader.read()
        writer.close()
        return answer

    with caplog.at_level("ERROR"):
        refused = await post(authorization, b'{"label": "x"}')
        nested = await post(b"Bearer tok", b"[" * 100_000 + b"]" * 100_000)
        good = await post(b"Bearer tok", b'{"label": "C=8"}')
    assert refused.startswith(b"HTTP/1.1 401 "), refused[:200]
    assert nested.startswith(b"HTTP/1.1 400 ") and b"nested too deeply" in nested, nested[:300]
    assert good.startswith(b"HTTP/1.1 200 "), good[:300]
    assert [r.getMessage() for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")] == []
    assert collector.store.sql("SELECT label FROM markers") == [("C=8",)]


async def test_marks_and_problems_are_dated_and_named_by_the_injected_clock_and_hostname(
        tmp_path: Path, start_collector: Start) -> None:
    """A mark posted without a time or host is stored at the collector's clock under its hostname,
    a source's problem opens and closes at that clock's times, and the stop is stamped on it: a
    test reads them exactly (they were time.time_ns() and socket.gethostname())."""
    log = tmp_path / "later.log"
    clock = FakeClock(1_800_000_000 * 10**9)
    collector = await start_collector(config(tmp_path, {"n0": log}), clock_ns=clock, hostname="client-7",
                                      options={"listen": "127.0.0.1:0", "ready_timeout_s": 0.5})
    await until(lambda: collector.problems(), "the missing log among the problems")
    opened_ns = clock()
    clock.advance(5.0)
    log.write_text(decode_lines(0, 1))
    await until(lambda: not collector.problems(), "the log found")
    async with aiohttp.ClientSession() as session, \
            session.post(f"{collector.url}/v1/mark", json={"label": "C=4"}) as resp:
        assert resp.status == 200 and (await resp.json())["ts_ns"] == clock()
    assert collector.store.sql("SELECT host, ts_ns, label FROM markers") == [("client-7", clock(), "C=4")]
    (problem,) = collector.source_problems.seen
    assert (problem.source, problem.since_ns) == ("log n0", opened_ns)
    assert problem.until_ns == opened_ns + 5 * 10**9
    clock.advance(1.0)
    await collector.stop()
    assert collector.store.meta.extra["collector"]["stopped_ns"] == clock()
