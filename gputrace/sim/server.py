"""The simulator in (scaled) real time behind an OpenAI-compatible aiohttp server: clients drive
the load, the scheduler log is written as the engine runs, and the GPUs' kernel-busy intervals go
to the feed file that ``gputrace agent --backend sim`` serves (FEED.md).

Entry points: ``await start_sim_server(params, ...)`` (in-process, returns a running SimServer)
and ``serve_forever(...)`` (the ``gputrace sim serve`` command).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from gputrace.engines.simulated import MetricSnapshot, StepFields, StepRecord
from gputrace.errors import SourceError
from gputrace.exposition import metrics_handler
from gputrace.httpserver import web
from gputrace.json_types import JsonObject
from gputrace.logsetup import get_logger
from gputrace.sim.engine import EngineTrace, PipelineEngine, SimRequest
from gputrace.sim.engine_exposition import SnapshotCollector
from gputrace.sim.nodes import FEED_KIND, NodeFiles, NodeLayout, NodeRecord, NodeRelay
from gputrace.sim.params import SimParams

log = get_logger("sim.server")

__all__ = ["FEED_KIND", "RealtimeSim", "SimServer", "serve_forever", "start_sim_server"]
TICK_S = 0.01  # how often the engine catches up with the wall clock (and files are flushed)
_WORDS = ("the", "pipeline", "stage", "token", "batch", "GPU", "idle", "busy", "layer", "cache")


class _Stream:
    """A request's token events, delivered at their wall-clock time."""

    def __init__(self, sim: RealtimeSim):
        self.sim = sim
        self.arrival_s = 0.0
        self.queue: asyncio.Queue[int | None] = asyncio.Queue()
        self._due: deque[int | None] = deque()

    def tokens(self, t_s: float, generated: int) -> None:
        self._due.append(generated)
        self.sim.deliver(t_s, self._release)

    def finished(self, t_s: float) -> None:
        self.sim.e2e_latency_sum_s += t_s - self.arrival_s
        self.sim.e2e_count += 1
        self._due.append(None)
        self.sim.deliver(t_s, self._release)

    def _release(self) -> None:
        # Timers due at the same instant fire in no set order: each releases the oldest event.
        self.queue.put_nowait(self._due.popleft())


class RealtimeSim:
    """The engine model tied to the wall clock: virtual t = (wall - start) * speed."""

    def __init__(self, params: SimParams, log_path: str | os.PathLike[str],
                 feed_path: str | os.PathLike[str] | None, speed: float = 1.0,
                 relay: NodeRelay | None = None):
        self.p = params
        self.speed = speed
        self.wall0_ns = time.time_ns()
        self.mono0 = time.monotonic()
        self._lines: list[StepRecord] = []
        self.engine = PipelineEngine(params, on_log=self._on_log)
        self._rng = np.random.default_rng(params.seed)
        self._next_rid = 0
        self._iv_done = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        # what the engine's /metrics says: per rank the newest logged values, the counters
        self._stage_fields: list[dict[str, float]] = [{} for _ in range(params.pp_size)]
        simulated = params.engine_spec.simulated
        self._rank_gauges = frozenset() if simulated is None else simulated.rank_gauges
        self._tokens_total = 0.0
        self.e2e_latency_sum_s = 0.0  # finished requests: end-to-end latencies summed, and counted
        self.e2e_count = 0
        self._tok_done = 0
        self._forward_s = [0.0] * params.pp_size
        # this process is node 0; the ranks SGLang places on other nodes go to them through relay
        self.relay = relay
        self.layout = NodeLayout.of(params, 1 + (len(relay.writers) if relay else 0))
        self._files = NodeFiles(params, self.layout, 0, log_path, feed_path, self.wall0_ns, speed)
        if relay is not None:
            relay.start(self.now_s(), speed)

    # -- clocks --------------------------------------------------------------------------------

    def now_s(self) -> float:
        return (time.monotonic() - self.mono0) * self.speed

    def wall_ns(self, t_s: float) -> int:
        return self.wall0_ns + round(t_s / self.speed * 1e9)

    def deliver(self, t_s: float, release: Callable[[], None]) -> None:
        """Call ``release`` when the wall clock reaches simulated time ``t_s``."""
        assert self._loop is not None
        when = self._loop.time() + max(t_s - self.now_s(), 0.0) / self.speed
        self._loop.call_at(when, release)

    # -- requests ------------------------------------------------------------------------------

    def submit(self, prompt_tokens: int, max_tokens: int) -> tuple[SimRequest, _Stream]:
        p = self.p
        n_out = max_tokens
        if p.output_tokens_jitter:
            n_out = max(1, round(n_out * self._rng.uniform(1 - p.output_tokens_jitter, 1.0)))
        stream = _Stream(self)
        stream.arrival_s = self.now_s()
        req = SimRequest(rid=self._next_rid, arrival_s=self.now_s(), input_tokens=max(1, prompt_tokens),
                         output_tokens=n_out, listener=stream)
        self._next_rid += 1
        self.engine.add_arrival(req)
        return req, stream

    # -- the engine loop -----------------------------------------------------------------------

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        while True:
            self.step()
            await asyncio.sleep(TICK_S)

    def step(self) -> None:
        """Catch the engine up with the wall clock and write what it produced."""
        target = self.now_s()
        self.engine.run_until(target)
        self._flush_log(target)
        self._count_tokens(target)
        self._flush_feed()

    def _count_tokens(self, upto_s: float) -> None:
        """Tokens out of the last stage by ``upto_s`` (batches are issued in order, so their
        exit times grow)."""
        tr = self.engine.trace
        i = self._tok_done
        while i < len(tr.tok_t) and tr.tok_t[i] <= upto_s:
            self._tokens_total += tr.tok_n[i]
            i += 1
        self._tok_done = i

    def metric_snapshot(self) -> MetricSnapshot:
        """The engine's metrics now (its rank gauges hold each rank's newest logged values)."""
        e = self.engine
        return MetricSnapshot(stage_fields=[dict(f) for f in self._stage_fields],
                              tokens_total=self._tokens_total, forward_s=list(self._forward_s),
                              running=e.running, waiting=len(e.waiting),
                              kv_usage_ratio=e.kv_used / self.p.max_total_num_tokens,
                              e2e_latency_sum_s=self.e2e_latency_sum_s, e2e_count=self.e2e_count)

    def _on_log(self, t_s: float, stage: int, kind: str, fields: StepFields) -> None:
        self._lines.append(StepRecord(t_s, len(self._lines), stage, kind, fields))

    def _flush_log(self, upto_s: float) -> None:
        if not self._lines:
            return
        self._lines.sort(key=lambda r: (r[0], r[1]))
        cut = 0
        by_node: list[list[NodeRecord]] = [[] for _ in range(self.layout.nnodes)]
        for t_s, _, stage, kind, fields in self._lines:
            if t_s > upto_s:
                break
            cut += 1
            self._stage_fields[stage].update(
                {f: float(v) for f, v in fields.items() if f in self._rank_gauges})
            by_node[self.layout.node_of_stage(stage)].append((t_s, stage, kind, fields))
        if cut:
            del self._lines[:cut]
            self._files.write_log(by_node[0])
            for node in range(1, self.layout.nnodes):
                if self.relay is not None:
                    self.relay.send(node, by_node[node], [])

    def _flush_feed(self) -> None:
        tr = self.engine.trace
        n = len(tr.iv_start)
        for i in range(self._iv_done, n):  # counted when issued: at most a pipeline's pass early
            self._forward_s[tr.interval_stage(i)] += tr.iv_end[i] - tr.iv_start[i]
        if n > self._iv_done:
            tp = self.p.tp_size
            by_node: list[list[tuple[float, float, int, int, int]]] = [[] for _ in range(self.layout.nnodes)]
            for i in range(self._iv_done, n):
                stage = tr.interval_stage(i)
                tx, rx = tr.interval_bytes(i)
                for rank in range(tp):
                    node, gpu = self.layout.gpu_of[(stage, rank)]
                    by_node[node].append((tr.iv_start[i], tr.iv_end[i], gpu, int(tx), int(rx)))
            self._files.write_feed(by_node[0])
            for node in range(1, self.layout.nnodes):
                if self.relay is not None:
                    self.relay.send(node, [], by_node[node])
        self._iv_done = n
        if n > 100_000:  # a long serve must not keep every interval: the feed file has them
            self._tokens_total += sum(tr.tok_n[self._tok_done:])  # a few batches early
            self.engine.trace = EngineTrace(self.p.pp_size)
            self._iv_done = 0
            self._tok_done = 0

    def close(self) -> None:
        self._flush_log(float("inf"))
        self._files.close()


# -- HTTP --------------------------------------------------------------------------------------


def _prompt_text(body: JsonObject) -> str:
    if "messages" in body:
        parts = []
        messages = body.get("messages")
        for m in messages if isinstance(messages, list) else []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = " ".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
            parts.append(str(content or ""))
        return "\n".join(parts)
    prompt = body.get("prompt", "")
    return " ".join(map(str, prompt)) if isinstance(prompt, list) else str(prompt)


def _count_tokens(text: str) -> int:
    """About four characters per token, as tokenizers of English text give."""
    return max(1, math.ceil(len(text) / 4))


class SimServer:
    """A running simulator server; ``url`` is its base (``http://host:port``)."""

    def __init__(self, sim: RealtimeSim, runner: web.AppRunner, task: asyncio.Task[None], url: str):
        self.sim = sim
        self.runner = runner
        self.task = task
        self.url = url

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await self.runner.cleanup()
        self.sim.close()
        if self.sim.relay is not None:
            await self.sim.relay.close()


def build_app(sim: RealtimeSim) -> web.Application:
    model = sim.p.model_path
    created = sim.wall0_ns // 1_000_000_000

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": model, "object": "model", "created": created, "owned_by": "gputrace-sim"}]})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def completions(request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or sim.p.max_tokens)
            if max_tokens < 1:
                raise ValueError("max_tokens must be >= 1")
        except (ValueError, TypeError) as exc:
            error = {"message": f"bad request: {exc}", "type": "invalid_request_error"}
            return web.json_response({"error": error}, status=400)
        prompt_tokens = _count_tokens(_prompt_text(body))
        limit = min(sim.p.context_len, sim.p.max_total_num_tokens)
        if prompt_tokens + max_tokens > limit:
            error = {"message": f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds "
                                f"the {limit}-token limit", "type": "invalid_request_error"}
            return web.json_response({"error": error}, status=400)
        req, stream = sim.submit(prompt_tokens, max_tokens)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-sim{req.rid}"
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}

        def finish_usage() -> dict[str, int]:
            usage["completion_tokens"] = req.generated
            usage["total_tokens"] = prompt_tokens + req.generated
            return usage

        if not body.get("stream"):
            words = []
            while (item := await stream.queue.get()) is not None:
                words.append(_WORDS[item % len(_WORDS)])
            text = " ".join(words)
            choice: JsonObject = {"index": 0, "finish_reason": "length", "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            return web.json_response({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                      "created": created, "model": model, "choices": [choice],
                                      "usage": finish_usage()})
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        kind = "chat.completion.chunk" if chat else "text_completion"

        sent = 0  # chunks written so far

        def chunk(delta_text: str | None, finish: str | None) -> bytes:
            if chat:
                delta: JsonObject = {} if delta_text is None else {"content": delta_text}
                if sent == 0 and delta_text is not None:
                    delta["role"] = "assistant"
                choice: JsonObject = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
            obj: JsonObject = {"id": rid, "object": kind, "created": created, "model": model,
                                   "choices": [choice]}
            if include_usage:
                obj["usage"] = None
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        try:
            while (item := await stream.queue.get()) is not None:
                await resp.write(chunk(_WORDS[item % len(_WORDS)] + " ", None))
                sent += 1
            await resp.write(chunk(None, "length"))
            if include_usage:
                final = {"id": rid, "object": kind, "created": created, "model": model, "choices": [],
                         "usage": finish_usage()}
                await resp.write(b"data: " + json.dumps(final).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            # the client went away mid-stream (a load generator closes the requests still in flight
            # when its last level ends): SGLang aborts such a request, and so does the simulator,
            # at its next token. Unhandled, aiohttp logged each with a traceback (64 per demo run),
            # and the abandoned requests ran on, logging, past the collector's drain.
            req.aborted = True
        return resp

    app = web.Application()
    app.router.add_get("/metrics", metrics_handler(SnapshotCollector(sim.p, sim.metric_snapshot),
                                                    auto_describe=True))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)
    return app


async def start_sim_server(params: SimParams, *, host: str = "127.0.0.1", port: int = 0,
                           log_path: str | os.PathLike[str], feed_path: str | os.PathLike[str] | None = None,
                           speed: float = 1.0, nnodes: int = 1,
                           dist_init_addr: tuple[str, int] | None = None) -> SimServer:
    """Start the real-time simulator and its HTTP server on the running loop (port 0: a free one).
    With ``nnodes`` > 1 this is node 0: it waits on ``dist_init_addr`` for the other nodes
    (``gputrace sim serve --node-rank r``), which write their ranks' log and GPU feed."""
    relay = None
    if nnodes > 1:
        if dist_init_addr is None:
            raise SourceError("simulator: a multi-node engine needs --dist-init-addr")
        relay = await NodeRelay.accept(*dist_init_addr, nnodes)
    sim = RealtimeSim(params, log_path, feed_path, speed, relay)
    runner = web.AppRunner(build_app(sim), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        sim.close()
        if relay is not None:
            await relay.close()
        raise SourceError(f"simulator: cannot listen on {host}:{port}: {exc.strerror}") from exc
    bound = int(runner.addresses[0][1]) if runner.addresses else port
    task = asyncio.create_task(sim.run())
    log.info("simulator_serving", host=host, port=bound, speed=speed)
    return SimServer(sim, runner, task, f"http://{host}:{bound}")


def serve_forever(params: SimParams, *, host: str, port: int, log_path: str, feed_path: str | None,
                  speed: float, announce: Callable[[str], None] | None = None, nnodes: int = 1,
                  dist_init_addr: tuple[str, int] | None = None) -> None:
    """Run the server until SIGINT/SIGTERM (``gputrace sim serve``)."""

    async def main() -> None:
        server = await start_sim_server(params, host=host, port=port, log_path=log_path,
                                        feed_path=feed_path, speed=speed, nnodes=nnodes,
                                        dist_init_addr=dist_init_addr)
        if announce is not None:
            announce(server.url)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await server.close()

    asyncio.run(main())
