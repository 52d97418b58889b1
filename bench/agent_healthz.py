"""Does /healthz stay quick while clients pull large /v1/samples pages?

An agent (simulated GPUs, its ring filled with ``--fill`` samples) runs in its own process. A
prober in this process asks /healthz every 10 ms for ``--seconds`` and reports p50/p99 latency,
first against the idle agent (the same-run reference), then while ``--clients`` clients in a third
process pull ``/v1/samples?limit=10000`` from random cursors as fast as they are answered.
Target (issue #15 item 12): p99 under 50 ms with 10 such clients (before: p50 2.1 s, p99 3.1 s).
Last, the ring's lookup of the newest full page (at --fill and at --lookup-fill samples) beside a
walk of the same rows from the start (how it was found before).

    python bench/agent_healthz.py [--fill 115000] [--clients 10] [--seconds 5] [--lookup-fill 1000000]
                                  [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from collections import deque
from itertools import islice

import aiohttp

from gputrace.agent.sampling import SampleRing
from gputrace.agent.server import MAX_PAGE_LIMIT, Agent, AgentSettings
from gputrace.gpu.simulated import SimulatedSampler
from gputrace.logsetup import configure_logging

_INTERVAL_S = 0.1


def fill_ring(sampler: SimulatedSampler, ring: SampleRing, fill: int) -> None:
    """``fill`` samples of past ticks, the newest now."""
    step_ns = int(_INTERVAL_S * 1e9)
    t_ns = time.time_ns() - (fill // len(sampler.devices()) + 1) * step_ns
    while len(ring) < fill:
        ring.extend(sampler.sample_rows(t_ns), t_ns)
        t_ns += step_ns


def lookup_figures(fill: int) -> str:
    """The last full page's lookup in the ring, beside a walk of the same rows from the start
    (how the ring found a seq before)."""
    sampler = SimulatedSampler("bench", 8, pattern="square")
    ring = SampleRing(retention_ns=24 * 3600 * 10**9)
    fill_ring(sampler, ring, fill)
    since = ring.newest_seq - MAX_PAGE_LIMIT
    rows = deque(ring.rows_after(0, len(ring)))
    ours, walk = [], []
    for _ in range(20):
        started = time.perf_counter()
        page = ring.rows_after(since, MAX_PAGE_LIMIT)
        ours.append(time.perf_counter() - started)
        started = time.perf_counter()
        walked = list(islice(rows, since, since + MAX_PAGE_LIMIT))
        walk.append(time.perf_counter() - started)
    assert page == walked
    return (f"last page of a {fill}-sample ring: lookup median {statistics.median(ours) * 1e3:.3f} ms, "
            f"walk from the start (reference) {statistics.median(walk) * 1e3:.3f} ms")


async def serve(fill: int) -> None:
    """The agent process: fill the ring with past ticks, serve, print the port, stop at EOF."""
    configure_logging(level="warning")  # stdout carries the port
    sampler = SimulatedSampler("bench", 8, pattern="square")
    agent = Agent(sampler, AgentSettings(port=0, interval_s=_INTERVAL_S, buffer_s=24 * 3600.0), "bench")
    fill_ring(sampler, agent.ring, fill)
    port = await agent.start()
    print(port, agent.ring.newest_seq, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await agent.stop()


async def hammer(url: str, clients: int, newest_seq: int) -> None:
    """The load process: ``clients`` loops pulling full pages until stdin closes; prints pages/s."""
    pages = 0
    stop = asyncio.Event()

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal pages
        while not stop.is_set():
            since = random.randrange(max(1, newest_seq - MAX_PAGE_LIMIT))
            query = {"since": since, "limit": MAX_PAGE_LIMIT}
            async with session.get(f"{url}/v1/samples", params=query) as r:
                await r.read()
                r.raise_for_status()
            pages += 1

    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(one(session)) for _ in range(clients)]
        started = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        stop.set()
        await asyncio.gather(*tasks)
    print(json.dumps({"pages_per_s": pages / (time.perf_counter() - started)}), flush=True)


async def probe(url: str, seconds: float) -> list[float]:
    """/healthz latencies in seconds, one request every 10 ms (one keep-alive connection)."""
    latencies: list[float] = []
    async with aiohttp.ClientSession() as session:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            started = time.perf_counter()
            async with session.get(f"{url}/healthz") as r:
                await r.read()
            latencies.append(time.perf_counter() - started)
            await asyncio.sleep(0.01)
    return latencies


def _summary(name: str, latencies: list[float]) -> str:
    cuts = statistics.quantiles(latencies, n=100)
    return f"{name:<34} n={len(latencies):5d}  p50 {cuts[49] * 1e3:7.2f} ms  p99 {cuts[98] * 1e3:7.2f} ms"


async def main(fill: int, clients: int, seconds: float, lookup_fill: int) -> None:
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(fill)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert server.stdin is not None and server.stdout is not None
    try:
        port, newest_seq = (int(x) for x in server.stdout.readline().split())
        url = f"http://127.0.0.1:{port}"
        idle = await probe(url, seconds)
        load = subprocess.Popen([sys.executable, __file__, "--hammer", url, str(clients), str(newest_seq)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert load.stdin is not None and load.stdout is not None
        await asyncio.sleep(1.0)  # every client has a page in flight
        loaded = await probe(url, seconds)
        load.stdin.close()
        pages_per_s = json.loads(load.stdout.readline())["pages_per_s"]
        load.wait(timeout=60)
    finally:
        server.stdin.close()
        server.wait(timeout=30)
    print(f"ring {newest_seq} samples, {clients} clients pulling {MAX_PAGE_LIMIT}-row pages "
          f"({pages_per_s:.1f} pages/s answered)")
    print(_summary("/healthz, idle agent (reference)", idle))
    print(_summary(f"/healthz, {clients} clients paging", loaded))
    print(lookup_figures(fill))
    if lookup_fill != fill:
        print(lookup_figures(lookup_fill))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        asyncio.run(serve(int(sys.argv[2])))
    elif sys.argv[1:2] == ["--hammer"]:
        asyncio.run(hammer(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    else:
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("--fill", type=int, default=115_000, help="samples in the ring")
        parser.add_argument("--clients", type=int, default=10)
        parser.add_argument("--seconds", type=float, default=5.0, help="per prober phase")
        parser.add_argument("--lookup-fill", type=int, default=1_000_000,
                            help="samples in the ring for the lookup figures too (the ring's cap)")
        parser.add_argument("--quick", action="store_true",
                            help="small inputs, one repeat: the users' code path (tests/test_bench_quick.py)")
        args = parser.parse_args()
        if args.quick:
            args.fill, args.clients, args.seconds, args.lookup_fill = 12_000, 2, 0.5, 12_000  # > a page
        asyncio.run(main(args.fill, args.clients, args.seconds, args.lookup_fill))
