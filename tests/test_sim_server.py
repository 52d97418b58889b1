"""The real-time simulator: OpenAI-compatible HTTP on loopback, scheduler log and GPU feed files."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from helpers import free_port

from gputrace.engines import LogParser
from gputrace.sim import scenario_params
from gputrace.sim.server import start_sim_server

SPEED = 20.0


@pytest.fixture
async def server(tmp_path):
    params = scenario_params("motivating", {"max_tokens": 16})
    srv = await start_sim_server(params, log_path=tmp_path / "sched.log", feed_path=tmp_path / "gpu.feed",
                                 speed=SPEED)
    yield srv
    await srv.close()


async def _sse(resp: aiohttp.ClientResponse) -> list[dict | str]:
    out: list[dict | str] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_models_lists_the_simulated_model(server):
    """GET /v1/models names the scenario's model."""
    async with aiohttp.ClientSession() as s, s.get(server.url + "/v1/models") as r:
        body = await r.json()
    assert r.status == 200 and body["data"][0]["id"] == "meta-llama/Llama-3.1-70B-Instruct"


async def test_chat_completion_without_streaming_fills_usage(server):
    """A plain chat completion returns max_tokens tokens and a filled usage."""
    payload = {"model": "m", "messages": [{"role": "user", "content": "Explain pipeline bubbles."}],
               "max_tokens": 12}
    async with aiohttp.ClientSession() as s, s.post(server.url + "/v1/chat/completions", json=payload) as r:
        body = await r.json()
    assert r.status == 200
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert len(body["choices"][0]["message"]["content"].split()) == 12
    usage = body["usage"]
    assert usage["completion_tokens"] == 12 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12


async def test_streaming_chat_sends_tokens_then_usage_when_asked(server):
    """Streaming SSE: one chunk per token, a finish chunk, the usage chunk (include_usage), [DONE]."""
    payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True,
               "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as s, s.post(server.url + "/v1/chat/completions", json=payload) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = await _sse(r)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    tokens = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(tokens) == 6 and tokens[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


async def test_streaming_completion_without_include_usage_has_no_usage(server):
    """/v1/completions streams text chunks; without include_usage no usage chunk is sent."""
    payload = {"prompt": "once upon a time", "max_tokens": 4, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(server.url + "/v1/completions", json=payload) as r:
        events = await _sse(r)
    chunks = [e for e in events if isinstance(e, dict)]
    assert all("usage" not in c for c in chunks)
    assert sum(1 for c in chunks if c["choices"][0]["text"]) == 4


async def test_bad_request_is_a_400(server):
    """A body that is not a JSON object, or a request longer than the context, is refused."""
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/v1/completions", data=b"[1]",
                          headers={"Content-Type": "application/json"}) as r:
            body = await r.json()
        assert r.status == 400 and body["error"]["type"] == "invalid_request_error"
        async with s.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 10**6}) as r:
            body = await r.json()
        assert r.status == 400 and "exceeds" in body["error"]["message"]


async def test_load_writes_parsable_log_and_feed(tmp_path):
    """72 requests against room for 64 (eight micro-batches of at most K = 64 // 8 = 8) run in
    micro-batches of 8 at most; the log and feed files follow as they run.

    The cap binds whatever the arrivals' spacing: each request lives about 64 rounds of the
    pipeline (about 1.3 s at speed 2), so the last of 72 arrives while 64 are still running, even
    on a loaded machine. (24 requests at speed 20 relied on arriving within one round: CI once saw
    them trickle in and fill micro-batches of 4.)"""
    max_tokens = 64
    params = scenario_params("motivating", {"max_tokens": max_tokens})
    srv = await start_sim_server(params, log_path=tmp_path / "sched.log", feed_path=tmp_path / "gpu.feed",
                                 speed=2.0)

    async def one(s: aiohttp.ClientSession) -> int:
        payload = {"messages": [{"role": "user", "content": "x"}], "max_tokens": max_tokens}
        async with s.post(srv.url + "/v1/chat/completions", json=payload) as r:
            return int((await r.json())["usage"]["completion_tokens"])

    try:
        async with aiohttp.ClientSession() as s:
            done = await asyncio.gather(*[one(s) for _ in range(72)])
        await asyncio.sleep(0.1)  # the engine's next tick writes the last lines
    finally:
        await srv.close()
    assert done == [max_tokens] * 72
    parser = LogParser(host="sim-node0", source="sim-log")
    records = [parser.feed(line) for line in (tmp_path / "sched.log").read_text().splitlines()]
    assert parser.counts.unrecognised == 0
    decode = [r for r in records if getattr(r, "kind", None) == "decode"]
    assert decode and max(r.running_req for r in decode) == 8
    assert max(r.queue_req for r in decode) > 0  # requests waited: the cap, not the arrivals, bound
    assert {r.pp_rank for r in decode} == set(range(8))
    feed = (tmp_path / "gpu.feed").read_text().splitlines()
    header = json.loads(feed[0])
    assert header["feed"] == "gputrace-sim-gpu" and header["gpus"] == 8
    intervals = [json.loads(line) for line in feed[1:]]
    assert {iv["gpu"] for iv in intervals} == set(range(8))
    for gpu in range(8):
        mine = [(iv["start_ns"], iv["end_ns"]) for iv in intervals if iv["gpu"] == gpu]
        assert all(a < b for a, b in mine)
        assert all(mine[i][1] <= mine[i + 1][0] for i in range(len(mine) - 1))


async def test_two_nodes_write_their_own_ranks_in_their_own_clock(tmp_path):
    """--nnodes 2: node 0 logs PP0-3 and feeds its GPUs 0-3; node 1 (a clock 3.7 s ahead) logs
    PP4-7 and feeds its GPUs 0-3, every stamp 3.7 s later than node 0 would have written it."""
    import time

    from gputrace.sim.nodes import NodeLayout, run_node

    params = scenario_params("motivating", {"max_tokens": 16})
    dist_port = free_port()
    stop = asyncio.Event()
    node1 = asyncio.create_task(run_node(
        params, NodeLayout.of(params, 2), 1, ("127.0.0.1", dist_port), str(tmp_path / "n1.log"),
        str(tmp_path / "n1.feed"), stop, clock_ns=lambda: time.time_ns() + 3_700_000_000))
    srv = await start_sim_server(params, log_path=tmp_path / "n0.log", feed_path=tmp_path / "n0.feed",
                                 speed=SPEED, nnodes=2, dist_init_addr=("127.0.0.1", dist_port))
    try:
        payload = {"model": "m", "prompt": "hello", "max_tokens": 8}
        async with aiohttp.ClientSession() as s, s.post(srv.url + "/v1/completions", json=payload) as r:
            assert r.status == 200
    finally:
        await srv.close()
    await asyncio.wait_for(node1, 10)  # node 1 ends with node 0
    stages = {}
    for node in (0, 1):
        parser = LogParser(host=f"n{node}", source="file", engine="sglang")
        events = [e for line in (tmp_path / f"n{node}.log").read_text().splitlines()
                  if (e := parser.feed(line)) is not None and hasattr(e, "pp_rank")]
        stages[node] = {e.pp_rank for e in events}
        feed = [json.loads(line) for line in (tmp_path / f"n{node}.feed").read_text().splitlines()]
        assert feed[0]["gpus"] == 4 and {f["gpu"] for f in feed[1:]} == {0, 1, 2, 3}
    assert stages == {0: {0, 1, 2, 3}, 1: {4, 5, 6, 7}}
    # the first request's pass: node 1's stage 4 starts 3.7 s (its clock) after node 0's stage 0,
    # plus four stages' hand-over and the hello's trip (this loop was busy starting node 0's server)
    first = {node: json.loads((tmp_path / f"n{node}.feed").read_text().splitlines()[1])["start_ns"]
             for node in (0, 1)}
    assert 3.7e9 < first[1] - first[0] < 4.2e9
