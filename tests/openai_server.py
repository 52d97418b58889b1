"""A real aiohttp server that speaks the OpenAI chat-completions protocol the way SGLang and vLLM do
(SSE ``data:`` chunks, ``stream_options.include_usage``, a final usage chunk, ``data: [DONE]``) and
counts how many requests it holds at once. Used by the load tests until the simulator's server is
there, and by bench/load.py (``python tests/openai_server.py`` runs it as its own process)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class ServerBehaviour:
    token_interval_s: float = 0.002  # decode step
    ttft_s: float = 0.005  # prefill
    max_active: int | None = None  # refuse (HTTP 429) beyond this many requests at once
    fail_every: int | None = None  # every Nth request answers HTTP 500
    send_usage: bool = True  # False: a server that ignores include_usage (tokens must be counted)
    tokens_per_chunk: int = 1
    cut_after_tokens: int | None = None  # close the stream early, as a crashing server does
    # answers no server should send, that the client must survive: "choices" (each chunk's or the
    # answer's "choices": [1]), "usage" (the usage counts as strings)
    malformed: str | None = None
    raw_answer: bytes | None = None  # send exactly these bytes as the 200 answer's body


@dataclass
class ServerStats:
    active: int = 0
    max_active: int = 0
    requests: int = 0
    refused: int = 0
    markers: list[dict[str, Any]] = field(default_factory=list)
    connections: set[Any] = field(default_factory=set)  # the client's (address, port) of each request
    # (epoch ns, active after the change): the server's view of concurrency.
    timeline: list[tuple[int, int]] = field(default_factory=list)

    def change(self, delta: int) -> None:
        self.active += delta
        self.max_active = max(self.max_active, self.active)
        self.timeline.append((time.time_ns(), self.active))

    def mean_active(self, t0: int, t1: int) -> float:
        """Time-weighted mean of concurrent requests between two epoch-ns times."""
        total = 0.0
        prev_t, prev_c = t0, 0
        for t, c in self.timeline:
            if t <= t0:
                prev_c = c
                continue
            if t >= t1:
                break
            total += prev_c * (t - prev_t)
            prev_t, prev_c = t, c
        total += prev_c * (t1 - prev_t)
        return total / (t1 - t0)

    def max_active_in(self, t0: int, t1: int) -> int:
        """The most requests held at once between two epoch-ns times."""
        before = [c for t, c in self.timeline if t <= t0]
        inside = [c for t, c in self.timeline if t0 < t < t1]
        return max([before[-1] if before else 0, *inside])


def make_app(behaviour: ServerBehaviour, stats: ServerStats) -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        stats.requests += 1
        if request.transport is not None:
            stats.connections.add(request.transport.get_extra_info("peername"))
        n = stats.requests
        if behaviour.max_active is not None and stats.active >= behaviour.max_active:
            stats.refused += 1
            return web.json_response(
                {"object": "error", "message": "too many requests", "type": "BadRequestError", "code": 429},
                status=429,
            )
        if behaviour.fail_every and n % behaviour.fail_every == 0:
            err = {"object": "error", "message": "internal error", "code": 500}
            return web.json_response(err, status=500)
        stats.change(+1)
        try:
            return await _answer(request, body, behaviour, n)
        finally:
            stats.change(-1)

    async def mark(request: web.Request) -> web.Response:
        stats.markers.append(await request.json())
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/mark", mark)
    return app


async def _answer(
    request: web.Request, body: dict[str, Any], b: ServerBehaviour, n: int
) -> web.StreamResponse:
    max_tokens = int(body.get("max_tokens") or 16)
    prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in body.get("messages", []))
    rid = f"chatcmpl-{n}"
    created = int(time.time())
    model = body.get("model", "default")
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                             "total_tokens": prompt_tokens + max_tokens}
    if b.malformed == "usage":
        usage = {k: str(v) for k, v in usage.items()}
    if b.raw_answer is not None:
        kind = "text/event-stream" if body.get("stream") else "application/json"
        return web.Response(body=b.raw_answer, headers={"Content-Type": kind})
    if not body.get("stream"):
        await asyncio.sleep(b.ttft_s + b.token_interval_s * max_tokens)
        message = {"role": "assistant", "content": " ".join(["tok"] * max_tokens)}
        answer = {
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [1] if b.malformed == "choices" else
            [{"index": 0, "message": message, "finish_reason": "length"}],
        }
        if b.send_usage:
            answer["usage"] = usage
        return web.json_response(answer)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice: Any = 1 if b.malformed == "choices" else {"index": 0, "delta": delta, "logprobs": None,
                                                          "finish_reason": finish}
        obj = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [choice]}
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    await asyncio.sleep(b.ttft_s)
    await resp.write(chunk({"role": "assistant", "content": ""}))
    sent = 0
    while sent < max_tokens:
        k = min(b.tokens_per_chunk, max_tokens - sent)
        sent += k
        await resp.write(chunk({"content": " tok" * k}, "length" if sent >= max_tokens else None))
        if b.cut_after_tokens is not None and sent >= b.cut_after_tokens:
            await resp.write_eof()
            return resp
        if sent < max_tokens:
            await asyncio.sleep(b.token_interval_s)
    if b.send_usage and (body.get("stream_options") or {}).get("include_usage"):
        final = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                 "choices": [], "usage": usage}
        await resp.write(b"data: " + json.dumps(final).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def start_server(
    behaviour: ServerBehaviour | None = None, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, str, ServerStats]:
    """Start on a free port; returns (runner, base URL, stats). Call ``runner.cleanup()`` to stop."""
    stats = ServerStats()
    runner = web.AppRunner(make_app(behaviour or ServerBehaviour(), stats), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    sockets = site._server.sockets if site._server else []  # type: ignore[union-attr]
    bound = sockets[0].getsockname()[1]
    return runner, f"http://{host}:{bound}", stats


async def _serve_forever(args: argparse.Namespace) -> None:
    b = ServerBehaviour(token_interval_s=args.token_interval, ttft_s=args.ttft)
    runner, url, _ = await start_server(b, port=args.port)
    print(url, flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token-interval", type=float, default=0.02)
    parser.add_argument("--ttft", type=float, default=0.05)
    asyncio.run(_serve_forever(parser.parse_args()))
