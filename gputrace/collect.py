"""The collector: for one run, per host one transport (SSH or local) that follows the engine log,
pulls the agent's samples and probes the clock; everything goes to the run store in batches at
least once a second, and a small HTTP server serves live metrics, phase marks and status.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import signal
import socket
import time
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from gputrace.agent.client import AgentClient
from gputrace.config import Config, HostConfig
from gputrace.engines import LogParser
from gputrace.engines.metrics_source import MetricsEndpoint, ScrapeStats, follow_metrics
from gputrace.errors import GputraceError, SourceError, StoreWriteError, UsageError
from gputrace.exposition import metrics_handler
from gputrace.httpserver import (
    HttpLimits,
    HttpListener,
    bearer_auth,
    has_token,
    is_loopback,
    parse_listen,
    require_token_beyond_loopback,
    web,
)
from gputrace.live import LiveCollector, LiveState
from gputrace.logsetup import get_logger
from gputrace.model import DeviceInfo, Marker, RequestRecord, SchedulerEvent
from gputrace.remote.clock import probe_clock
from gputrace.remote.connect import TransportFactory, connect_host
from gputrace.remote.follow import follow_log_batches
from gputrace.remote.ssh import HostKeyPolicy
from gputrace.remote.transport import Transport
from gputrace.store import REJECTS_FILE, BatchingWriter, Store
from gputrace.token_file import read_token
from gputrace.topology import topology_to_meta
from gputrace.vocabulary import CaptureProblem, LiveStatus

log = get_logger("collect")
MAX_CONCURRENCY = 1 << 31  # a phase's target: far above any real load, well inside int64

DEFAULT_LISTEN = "127.0.0.1:9401"
# The file follower polls every 20 ms and an SSH hop adds milliseconds: a log silent this long after
# a drain began has delivered every line written before it.
DRAIN_QUIET_S = 0.3


@dataclass
class CollectOptions:
    """How to collect; the CLI fills these from flags."""

    listen: str | None = DEFAULT_LISTEN  # None: no HTTP server
    host_key_policy: HostKeyPolicy = HostKeyPolicy.VERIFY
    agent_token: str | None = None
    flush_s: float = 0.5  # a killed collector loses at most this much (plus one batch in flight)
    probe_interval_s: float = 10.0
    agent_poll_s: float = 0.25
    http_token: str | None = None  # required when listening beyond loopback
    insecure: bool = False
    log_from_start: bool = True  # read the log from its beginning (startup config lines included)
    ready_timeout_s: float = 15.0  # how long start() waits for every source to be live
    http_limits: HttpLimits = field(default_factory=HttpLimits)


@dataclass
class _HostTasks:
    host: HostConfig
    transport: Transport | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    agent: AgentClient | None = None


class LoadInFlight(Protocol):
    """A load running in this process whose requests in flight the live view shows."""

    @property
    def inflight(self) -> int: ...


class Collector:
    """Collects one run into ``store``; ``start``, ``drain`` once the workload is over, then ``stop``
    (or ``run_until``). ``connect`` reaches each configured host (default: SSH or local, as its
    ``ssh`` says, under the options' host-key policy)."""

    def __init__(self, cfg: Config, store: Store, options: CollectOptions | None = None,
                 connect: TransportFactory | None = None):
        self.cfg = cfg
        self.store = store
        self.options = options or CollectOptions()
        self._connect = connect or self._connect_configured
        self.placements = cfg.placements()
        self.live = LiveState(store.meta.name, self.placements)
        self.writer = BatchingWriter(store, flush_s=self.options.flush_s, on_reject=self._rejected)
        self._hosts = [_HostTasks(h) for h in cfg.hosts]
        self._tasks: list[asyncio.Task[None]] = []
        self._listener: HttpListener | None = None
        self.url: str | None = None
        self.client_host = socket.gethostname()
        self._failures: list[str] = []
        self._ready: dict[str, asyncio.Event] = {}
        # per source, what keeps it from delivering (a log file not there, a lost connection, a
        # task that ended); the open ones (until_ns None) are current
        self._problems: list[CaptureProblem] = []
        self._last_log_batch_ns: dict[str, int] = {}  # per log source, when its newest lines came

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        topo = self.cfg.topology
        self.store.update_meta(topology=topology_to_meta(
            topo.pp_size, topo.tp_size, topo.dp_size, self.placements,
            "explicit" if topo.placements else "sglang-formula"))
        if self.options.listen:
            await self._start_http(self.options.listen)
        for ht in self._hosts:
            ht.transport = await self._connect(ht.host)
            if ht.host.log is not None:
                self._ready[f"log {ht.host.name}"] = asyncio.Event()
                ht.tasks.append(self._spawn(self._follow_log(ht), f"log {ht.host.name}"))
            if ht.host.agent:
                ht.agent = AgentClient(await self._agent_url(ht), token=self.options.agent_token,
                                       on_bad_line=self._bad_sample_line)
                self._ready[f"agent {ht.host.name}"] = asyncio.Event()
                ht.tasks.append(self._spawn(self._pull_agent(ht), f"agent {ht.host.name}"))
            if ht.host.engine_metrics is not None:
                source = f"engine metrics {ht.host.name}"
                self._ready[source] = asyncio.Event()
                ht.tasks.append(self._spawn(self._scrape_engine_metrics(ht), source))
            ht.tasks.append(self._spawn(self._probe_clocks(ht), f"clock {ht.host.name}"))
        self._tasks.append(self._spawn(self._flush_loop(), "flush"))
        await self._wait_ready()

    async def _wait_ready(self) -> None:
        """Return once every log follower has caught up and every agent answered once, so a load
        started next is seen live from its first request (bounded: a silent source only warns)."""
        waits = [asyncio.create_task(e.wait()) for e in self._ready.values()]
        if not waits:
            return
        _, pending = await asyncio.wait(waits, timeout=self.options.ready_timeout_s)
        for task in pending:
            task.cancel()
        late = [name for name, e in self._ready.items() if not e.is_set()]
        if late:
            log.warning("sources_not_ready", sources=late,
                        waited_s=self.options.ready_timeout_s)

    async def drain(self, timeout_s: float = 5.0) -> bool:
        """Wait until what the sources held when it was called is in the store: every log follower
        silent for DRAIN_QUIET_S, every agent asked again and read to the end of its ring, then the
        writer flushed. Engine /metrics scrapes come at their interval and are not waited for;
        failed sources and sources with a problem open are not either. False when the timeout
        came first or the store could not be written (then what is buffered stays in the backlog)."""
        asked_ns = time.time_ns()
        deadline = time.monotonic() + timeout_s
        while waiting := self._not_drained(asked_ns):
            if time.monotonic() >= deadline:
                log.warning("drain timed out; stopping with what arrived", waiting_for=waiting,
                            timeout_s=timeout_s)
                self.writer.flush()
                return False
            await asyncio.sleep(0.02)
        return self.writer.flush()

    def _not_drained(self, asked_ns: int) -> list[str]:
        """The sources still delivering what they held at ``asked_ns``."""
        now_ns = time.time_ns()
        open_problems = {p.source for p in self._problems if p.until_ns is None}
        running = {t.get_name() for ht in self._hosts for t in ht.tasks if not t.done()}
        waiting = []
        for ht in self._hosts:
            name = f"log {ht.host.name}"
            if name in running and name not in open_problems:
                since_ns = max(asked_ns, self._last_log_batch_ns.get(name, 0))
                if now_ns - since_ns < DRAIN_QUIET_S * 1e9:
                    waiting.append(name)
            name = f"agent {ht.host.name}"
            if ht.agent is not None and name in running and name not in open_problems:
                read_ns = ht.agent.stats.read_to_end_ns
                if read_ns is None or read_ns < asked_ns:
                    waiting.append(name)
        return waiting

    async def stop(self) -> None:
        """Stop every source, write what is buffered, close connections."""
        for task in [t for ht in self._hosts for t in ht.tasks] + self._tasks:
            task.cancel()
        for task in [t for ht in self._hosts for t in ht.tasks] + self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if not self.writer.flush():
            log.error("store_records_lost", rows=self.writer.backlog_rows,
                      error=self.writer.write_error)
        for ht in self._hosts:
            if ht.agent is not None:
                await ht.agent.close()
            if ht.transport is not None:
                with contextlib.suppress(Exception):
                    await ht.transport.close()
        if self._listener is not None:
            await self._listener.stop()
        stopped_ns = time.time_ns()
        writer = self.writer
        outages = [*writer.outages]
        if writer.write_error is not None:
            outages.append({"error": writer.write_error, "since_ns": writer.failing_since_ns,
                            "until_ns": None, "lost_rows": writer.backlog_rows})
        try:
            self.store.update_meta(extra={"collector": {
                "counts": dict(self.live.counts), "failures": self._failures,
                "source_problems": [p.to_dict() for p in self._problems], "store_outages": outages,
                "dropped_records": dict(writer.dropped), "stopped_ns": stopped_ns}})
        except StoreWriteError as exc:
            log.error("meta_not_updated", error=str(exc))
        log.info("collector_stopped", run=str(self.store.path), **self.live.counts)

    async def run_until(self, stop: asyncio.Event) -> None:
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.stop()

    def _spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except GputraceError as exc:
                self._failures.append(f"{name}: {exc}")
                self._source_problem(name, f"stopped: {exc}")
                log.error("source_failed", source=name, error=str(exc))
            except Exception as exc:  # a bug in one source must not stop the others
                self._failures.append(f"{name}: {type(exc).__name__}: {exc}")
                self._source_problem(name, f"stopped: {type(exc).__name__}: {exc}")
                log.exception("source_crashed", source=name)
        return asyncio.create_task(guarded(), name=name)

    # -- transports -----------------------------------------------------------------------------

    async def _connect_configured(self, host: HostConfig) -> Transport:
        return await connect_host(host, host_key_policy=self.options.host_key_policy)

    async def _agent_url(self, ht: _HostTasks) -> str:
        agent = ht.host.agent or ""
        if agent.startswith(("http://", "https://")):
            return agent
        host, port = parse_listen(agent)
        if ht.host.ssh is None or ht.transport is None:
            return f"http://{host}:{port}"
        local_port = await ht.transport.forward_local_port(host, port)
        return f"http://127.0.0.1:{local_port}"

    # -- sources --------------------------------------------------------------------------------

    async def _follow_log(self, ht: _HostTasks) -> None:
        assert ht.host.log is not None and ht.transport is not None
        src = ht.host.log
        # a line followed live was written by now: that dates vLLM's stamps, which have no year
        parser = LogParser(host=ht.host.name, source=f"{src.kind}:{src.target}", engine=src.engine,
                           tz=src.timezone, year_until=lambda: dt.datetime.now(dt.UTC).date())
        name = f"log {ht.host.name}"
        ready = self._ready.setdefault(name, asyncio.Event())
        async for batch in follow_log_batches(ht.transport, src, from_start=self.options.log_from_start,
                                              on_caught_up=ready.set,
                                              on_problem=lambda why: self._source_problem(name, why)):
            self._last_log_batch_ns[name] = time.time_ns()
            self.live.counts["log_lines"] += len(batch)
            for line in batch:
                record = parser.feed(line.text, recv_ts_ns=line.recv_ts_ns)
                if record is None:
                    self.live.counts["unrecognised_lines"] += 1
                    continue
                self.writer.add(record)
                if isinstance(record, SchedulerEvent):
                    self.live.on_event(record)

    async def _pull_agent(self, ht: _HostTasks) -> None:
        assert ht.agent is not None
        try:
            info = await ht.agent.info()
            self.writer.add_many(_devices_from_info(ht.host.name, info))
        except SourceError as exc:
            log.warning("agent_info_unavailable", host=ht.host.name, error=str(exc))
        ready = self._ready.setdefault(f"agent {ht.host.name}", asyncio.Event())
        told = False
        async for batch in ht.agent.follow(poll_s=self.options.agent_poll_s):
            ready.set()
            if ht.host.gpus is not None:
                batch = [s for s in batch if s.gpu_index in ht.host.gpus]
            # Samples belong to the host the collector reached the agent through: an agent whose
            # --host-name differs from [[hosts]].name had every sample dropped from the stages.
            other = {s.host for s in batch if s.host != ht.host.name}
            if other:
                if not told:
                    log.warning("agent names its host differently: its samples are filed under the "
                                "configured name", agent_host=sorted(other), host=ht.host.name)
                    told = True
                batch = [s if s.host == ht.host.name else dataclasses.replace(s, host=ht.host.name)
                         for s in batch]
            self.writer.add_many(batch)
            self.live.on_samples(batch, clock_host=ht.host.name)

    async def _engine_metrics_url(self, ht: _HostTasks) -> str:
        """The engine's /metrics as this machine reaches it: a loopback URL on a host reached by
        SSH goes through a forwarded port (the endpoint is not exposed beyond that host)."""
        assert ht.host.engine_metrics is not None
        url = ht.host.engine_metrics.url
        parts = urlsplit(url)
        if ht.host.ssh is None or ht.transport is None or not is_loopback(parts.hostname or ""):
            return url
        port = parts.port or (443 if parts.scheme == "https" else 80)
        local_port = await ht.transport.forward_local_port(parts.hostname or "127.0.0.1", port)
        return urlunsplit((parts.scheme, f"127.0.0.1:{local_port}", parts.path, parts.query, ""))

    async def _scrape_engine_metrics(self, ht: _HostTasks) -> None:
        src = ht.host.engine_metrics
        assert src is not None
        name = f"engine metrics {ht.host.name}"
        token = read_token(src.token_file, f"[hosts.engine_metrics] token_file of {ht.host.name}")
        endpoint = MetricsEndpoint(await self._engine_metrics_url(ht), token, src.interval_s, src.timeout_s)
        ready = self._ready.setdefault(name, asyncio.Event())
        stats = ScrapeStats()
        async for batch in follow_metrics(endpoint, ht.host.name, src.url, stats,
                                          on_problem=lambda why: self._source_problem(name, why)):
            ready.set()
            self.live.counts["engine_metric_samples"] += len(batch)
            self.writer.add_many(batch)

    async def _probe_clocks(self, ht: _HostTasks) -> None:
        while True:
            if ht.transport is not None and ht.host.ssh is not None:
                with contextlib.suppress(GputraceError):
                    self.writer.add(await probe_clock(ht.transport, ht.host.name))
            if ht.agent is not None:
                with contextlib.suppress(GputraceError):
                    probe = await ht.agent.probe_clock(ht.host.name)
                    self.writer.add(probe)
                    self.live.on_clock_probe(probe)  # the agent's clock is the samples' clock
            await asyncio.sleep(self.options.probe_interval_s)

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(min(self.options.flush_s, 0.25))
            self.writer.maybe_flush()

    def _source_problem(self, source: str, reason: str | None) -> None:
        """``source`` has a problem from now on (``reason``), or none any more (None)."""
        now = time.time_ns()
        for i, problem in enumerate(self._problems):
            if problem.source == source and problem.until_ns is None:
                if problem.reason == reason:
                    return
                self._problems[i] = dataclasses.replace(problem, until_ns=now)
        if reason is not None:
            self._problems.append(CaptureProblem(source, reason, now))

    def problems(self) -> list[CaptureProblem]:
        """What keeps the capture from being complete right now: failing sources, the store."""
        current = [p for p in self._problems if p.until_ns is None]
        if self.writer.write_error is not None:
            dropped = sum(self.writer.dropped.values())
            current.append(CaptureProblem(
                "store", f"cannot write ({self.writer.write_error}): {self.writer.backlog_rows} records "
                         f"waiting in memory, {dropped} dropped", self.writer.failing_since_ns))
        return current

    def status(self) -> LiveStatus:
        """/v1/status: the live view, the store's state and the current problems."""
        return dataclasses.replace(self.live.status(), store=self.writer.health(),
                                   problems=tuple(self.problems()))

    def _bad_sample_line(self, reason: str) -> None:
        self.live.counts["bad_sample_lines"] += 1

    def _rejected(self, record: Any, reason: str) -> None:
        """A record the store could not hold: counted; logged the first time per record type."""
        self.live.counts["rejected_records"] += 1
        name = type(record).__name__
        if self.writer.rejected.get(name) == 1:
            log.warning("record_set_aside", record_type=name, reason=reason,
                        rejects_file=str(self.store.path / REJECTS_FILE))

    # -- records from the load side (same process) ----------------------------------------------

    def attach_load(self, load: LoadInFlight) -> None:
        """Show ``load``'s requests in flight live (its records come through ``add_load_record``)."""
        self.live.inflight_probe = lambda: load.inflight

    def add_load_record(self, record: RequestRecord | Marker) -> None:
        """Sink for the built-in load generator."""
        self.writer.add(record)
        if isinstance(record, Marker):
            self.live.on_marker(record)
        else:
            self.live.on_request(record)

    # -- HTTP: /metrics, /v1/mark, /v1/status ---------------------------------------------------

    async def _start_http(self, listen: str) -> None:
        host, port = parse_listen(listen, example_port=9401)
        token = self.options.http_token or None
        require_token_beyond_loopback(
            host, token, self.options.insecure,
            refusal=f"--listen {listen}: listening beyond loopback needs a token (--token-file) or "
                    "--insecure",
            warning="collector endpoints open to the network without authentication (--insecure): "
                    "anyone who reaches the port can post marks", listen=listen)
        app = web.Application(middlewares=[bearer_auth(token, "gputrace-collector")] if token else [])
        app.router.add_get("/metrics", metrics_handler(LiveCollector(self.live), auto_describe=True))
        app.router.add_post("/v1/mark", self._mark)
        app.router.add_get("/v1/status", self._status)
        app.router.add_get("/healthz", self._healthz)
        listener = HttpListener(app, "collector", self.options.http_limits)
        try:
            bound = await listener.start(host, port)
        except OSError as exc:
            raise UsageError(f"--listen {listen}: cannot listen: {exc.strerror}") from exc
        self._listener = listener
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{bound}"
        log.info("collector_listening", url=self.url)

    async def _mark(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            marker = marker_from_json(body, default_host=self.client_host)
        except (ValueError, TypeError, KeyError) as exc:
            self.live.counts["bad_marks"] += 1
            return web.json_response({"error": f"bad marker: {exc}"}, status=400)
        self.add_load_record(marker)
        # a mark is rare and users expect it on disk at once; while the store cannot be written it
        # waits in the backlog with the rest
        stored = self.writer.flush()
        return web.json_response({"ok": True, "ts_ns": marker.ts_ns, "stored": stored})

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status().to_dict())

    async def _healthz(self, request: web.Request) -> web.Response:
        """200 while every source delivers and the store takes what they send; 503 with the
        problems otherwise (a full disk said ok while every sample was kept in memory only). Open
        without the token, as the agent's is; then it says only whether."""
        problems = self.problems()
        status = 503 if problems else 200
        if not has_token(request, self.options.http_token or None):
            return web.json_response({"ok": not problems}, status=status)
        return web.json_response({"ok": not problems, "problems": [p.to_dict() for p in problems],
                                  "failures": self._failures},
                                 status=status)


def marker_from_json(body: Any, default_host: str) -> Marker:
    """A Marker from the JSON body `gputrace mark` and the load generator post."""
    if not isinstance(body, dict):
        raise TypeError("body must be a JSON object")
    label = body["label"]
    if not isinstance(label, str) or not label:
        raise ValueError("label must be a non-empty string")
    kind = body.get("kind", "phase")
    if kind not in ("phase", "end", "note"):
        raise ValueError("kind must be phase, end or note")
    target = body.get("target_concurrency")
    # bool is an int in Python: true as a concurrency reached the store and stopped its writer
    if target is not None and (isinstance(target, bool) or not isinstance(target, int)
                               or not 0 <= target <= MAX_CONCURRENCY):
        raise ValueError(f"target_concurrency must be an integer from 0 to {MAX_CONCURRENCY}")
    ts_ns = body.get("ts_ns") or time.time_ns()
    if isinstance(ts_ns, bool) or not isinstance(ts_ns, int) or not 0 < ts_ns < 2**63:
        raise ValueError("ts_ns must be an integer of nanoseconds since the epoch")
    host = str(body.get("host") or default_host)
    for name, text in (("label", label), ("host", host)):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{name} is not valid Unicode (a lone surrogate)") from None
        if not text.isprintable() or len(text) > 200:
            raise ValueError(f"{name} must be printable text of at most 200 characters")
    return Marker(host=host, ts_ns=ts_ns, label=label, kind=kind, target_concurrency=target)


def _devices_from_info(host: str, info: dict[str, Any]) -> list[DeviceInfo]:
    known = {f for f in DeviceInfo.__dataclass_fields__}
    out = []
    for dev in info.get("devices", []):
        if isinstance(dev, dict) and "gpu_index" in dev:
            out.append(DeviceInfo(**{**{k: v for k, v in dev.items() if k in known}, "host": host}))
    return out


def install_stop_signals(stop: asyncio.Event) -> None:
    """SIGINT and SIGTERM set ``stop`` so the collector flushes and exits cleanly."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


@contextlib.contextmanager
def open_run_store(out: Path, cfg: Config) -> Iterator[Store]:
    """A new run directory for a capture (refuses to overwrite an existing run). A capture that
    fails before anything was stored (a refused listen, a host key, an unreachable host) leaves no
    run behind, so the retry can use the same --out."""
    store = Store.create(out, name=cfg.run_name or out.name,
                         config=json.loads(json.dumps(dict(cfg.raw), default=str)))
    try:
        yield store
    except BaseException:
        if store.is_empty():
            store.discard()
        else:
            store.close()
        raise
    store.close()
