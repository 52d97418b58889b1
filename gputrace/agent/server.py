"""The agent's HTTP server: /metrics, /v1/samples, /v1/time, /v1/info, /healthz (aiohttp).

Loopback by default; any other address needs a bearer token (or an explicit --insecure). The
sampling thread fills the ring; handlers only read it.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from gputrace import __version__
from gputrace.agent.exporter import GpuCollector
from gputrace.agent.sampling import CursorTooOld, SampleRing, SamplingLoop
from gputrace.errors import UsageError
from gputrace.exposition import metrics_handler
from gputrace.gpu.sampler import ROW_FIELDS, Sampler, SampleRow, sample_row
from gputrace.httpserver import (
    HttpLimits,
    HttpListener,
    bearer_auth,
    require_token_beyond_loopback,
    web,
)
from gputrace.logsetup import get_logger
from gputrace.model import GpuSample
from gputrace.topology import Placement

log = get_logger("agent.server")

DEFAULT_PORT = 9402
DEFAULT_PAGE_LIMIT = 1000
MAX_PAGE_LIMIT = 10_000
ENCODER_SWITCH_INTERVAL_S = 0.001  # the GIL slice of the page encoder (see Agent.start)


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """How the agent listens and samples (the `gputrace agent` options, parsed)."""

    listen_host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    interval_s: float = 0.1
    buffer_s: float = 900.0
    token: str | None = None
    insecure: bool = False
    tls_cert: str | None = None
    tls_key: str | None = None
    dcgm_compat: bool = False
    dcgm_schema: str = "4.8"  # the dcgm-exporter whose names --dcgm-compat serves (metric_names.DCGM_SCHEMAS)
    placements: Sequence[Placement] | None = None  # this host's GPUs' ranks (by gpu_index)
    http_limits: HttpLimits = field(default_factory=HttpLimits)


def check_exposure(settings: AgentSettings) -> None:
    """Refuse to listen beyond loopback without a token, unless --insecure says so explicitly."""
    if (settings.tls_cert is None) != (settings.tls_key is None):
        raise UsageError("--tls-cert and --tls-key go together")
    require_token_beyond_loopback(
        settings.listen_host, settings.token, settings.insecure,
        refusal=f"refusing to listen on {settings.listen_host} (not loopback) without --token-file; "
                "pass --insecure to expose the agent without authentication",
        warning="agent open to the network without authentication (--insecure)",
        listen=settings.listen_host)


def sample_line(seq: int, s: GpuSample) -> str:
    """One NDJSON line: the GpuSample's fields by name, with the ring's sequence number."""
    return row_line(seq, sample_row(s))


def row_line(seq: int, row: SampleRow) -> str:
    """``sample_line`` of the record a row stands for (the ring's seq comes last)."""
    obj = dict(zip(ROW_FIELDS, row, strict=True))
    del obj["seq"]
    obj["seq"] = seq
    return json.dumps(obj, separators=(",", ":"))


def page_body(since: int, rows: list[SampleRow]) -> bytes:
    """A /v1/samples body: the rows' NDJSON lines, the first numbered since + 1."""
    return "".join(row_line(seq, row) + "\n" for seq, row in enumerate(rows, since + 1)).encode()


class Agent:
    """A sampler, its ring and sampling thread, and the HTTP app serving them."""

    def __init__(self, sampler: Sampler, settings: AgentSettings, host: str) -> None:
        check_exposure(settings)
        self.sampler = sampler
        self.settings = settings
        self.host = host
        self.instance = uuid.uuid4().hex[:16]  # lets clients tell a restarted agent by its cursor
        self.ring = SampleRing(int(settings.buffer_s * 1e9))
        per_s = len(sampler.devices()) * (1.0 / settings.interval_s + 6.0)  # ticks + driver samples
        if per_s * settings.buffer_s > self.ring.max_samples:
            log.warning("sample_ring_capped",
                        max_samples=self.ring.max_samples, buffer_s=settings.buffer_s,
                        kept_s=round(self.ring.max_samples / per_s))
        self.loop = SamplingLoop(sampler, self.ring, settings.interval_s)
        self.devices = sampler.devices()
        self._metrics = metrics_handler(GpuCollector(self.loop.stats, self.ring, self.devices, host,
                                                     settings.placements, settings.dcgm_compat,
                                                     settings.dcgm_schema))
        self.app = self._make_app()
        self._listener = HttpListener(self.app, "agent", settings.http_limits)
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gputrace-encode")
        self.port: int | None = None

    def _make_app(self) -> web.Application:
        middlewares = [bearer_auth(self.settings.token, "gputrace-agent")] if self.settings.token else []
        app = web.Application(middlewares=middlewares)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/samples", self._samples)
        app.router.add_get("/v1/time", self._time)
        app.router.add_get("/v1/info", self._info)
        app.router.add_get("/healthz", self._healthz)
        return app

    def _headers(self) -> dict[str, str]:
        return {"X-Gputrace-Instance": self.instance,
                "X-Gputrace-Newest-Seq": str(self.ring.newest_seq)}

    async def _samples(self, request: web.Request) -> web.Response:
        try:
            since = int(request.query.get("since", "0"))
            limit = int(request.query.get("limit", str(DEFAULT_PAGE_LIMIT)))
        except ValueError:
            return web.json_response({"error": "since and limit must be integers"}, status=400)
        if since < 0 or not 1 <= limit <= MAX_PAGE_LIMIT:
            return web.json_response({"error": f"since must be >= 0 and limit in 1..{MAX_PAGE_LIMIT}"},
                                     status=400)
        try:
            page = self.ring.rows_after(since, limit)
        except CursorTooOld as exc:
            return web.json_response({"error": str(exc), "oldest_seq": exc.oldest_seq}, status=410,
                                     headers=self._headers())
        # Encoding a full page takes 120-160 ms: on the event loop it held every other answer
        # (/healthz p99 3 s under 10 such clients); one thread, since with the GIL more threads
        # would only take more turns from the loop
        body = await asyncio.get_running_loop().run_in_executor(self._encoder, page_body, since, page)
        return web.Response(body=body, content_type="application/x-ndjson", charset="utf-8",
                            headers=self._headers())

    async def _time(self, request: web.Request) -> web.Response:
        return web.json_response({"time_ns": time.time_ns(), "host": self.host})

    async def _info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "host": self.host, "backend": self.sampler.backend, "instance": self.instance,
            "gputrace_version": __version__, **self.sampler.versions(),
            "interval_s": self.settings.interval_s, "buffer_s": self.settings.buffer_s,
            "devices": [asdict(d) for d in self.devices],
            "placements": {str(p.gpu_index): {"pp_rank": p.pp_rank, "tp_rank": p.tp_rank}
                           for p in self.settings.placements or ()},
        }, headers=self._headers())

    async def _healthz(self, request: web.Request) -> web.Response:
        last = self.loop.stats.last_tick_ns
        age_s = (time.time_ns() - last) / 1e9 if last is not None else None
        healthy = age_s is not None and age_s < max(5 * self.settings.interval_s, 2.0)
        return web.json_response({"status": "ok" if healthy else "stale", "last_sample_age_s": age_s},
                                 status=200 if healthy else 503)

    def _ssl_context(self) -> ssl.SSLContext | None:
        if self.settings.tls_cert is None or self.settings.tls_key is None:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(self.settings.tls_cert, self.settings.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise UsageError(f"--tls-cert/--tls-key: cannot load: {exc}") from exc
        return ctx

    async def start(self) -> int:
        """Start sampling and serving; returns the bound port (useful with port 0)."""
        ssl_ctx = self._ssl_context()
        # Pages are encoded on a thread that holds the GIL for the whole switch interval at a time;
        # each step of a /healthz waits for it. Measured (bench/agent_healthz.py, 10 clients pulling
        # 10,000-row pages, 2 busy cores): /healthz p99 49-57 ms at the default 5 ms, 13-16 ms at
        # 1 ms, with more pages answered too. The agent is a process of its own.
        sys.setswitchinterval(min(sys.getswitchinterval(), ENCODER_SWITCH_INTERVAL_S))
        self.loop.start()
        try:
            self.port = await self._listener.start(self.settings.listen_host, self.settings.port, ssl_ctx)
        except OSError as exc:
            await self.stop()
            raise UsageError(f"cannot listen on {self.settings.listen_host}:{self.settings.port}: "
                             f"{exc.strerror or exc}") from exc
        return self.port

    async def stop(self) -> None:
        self.loop.stop()
        await self._listener.stop()
        self._encoder.shutdown(wait=False, cancel_futures=True)
        self.sampler.close()
