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

import numpy as np

from gputrace.agent.client import HISTORY_MARGIN_S, AgentClient
from gputrace.config import Config, HostConfig
from gputrace.engines import LogParser
from gputrace.errors import ConfigError, GputraceError, SourceError, StoreError, StoreWriteError, UsageError
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
from gputrace.log_clock import LogClockOffset, log_clock_offset
from gputrace.logsetup import get_logger
from gputrace.model import DeviceInfo, EngineConfig, Marker, RequestRecord, SchedulerEvent
from gputrace.remote.clock import probe_clock
from gputrace.remote.connect import TransportFactory, connect_host
from gputrace.remote.engine_scrape import MetricsEndpoint, ScrapeStats, follow_metrics
from gputrace.remote.follow import FollowGap, follow_log_batches
from gputrace.remote.ssh import HostKeyPolicy
from gputrace.remote.transport import Transport
from gputrace.store import REJECTS_FILE, BatchingWriter, Store, warm_up
from gputrace.token_file import read_token
from gputrace.topology import topology_to_meta
from gputrace.vocabulary import CaptureProblem, LiveStatus

log = get_logger("collect")
MAX_CONCURRENCY = 1 << 31  # a phase's target: far above any real load, well inside int64

DEFAULT_LISTEN = "127.0.0.1:9401"
# The file follower polls every 20 ms and an SSH hop adds milliseconds: a log silent this long after
# a drain began has delivered every line written before it.
DRAIN_QUIET_S = 0.3
# each step of stop() (sources ending, connections closing) is bounded by this: SIGTERM must end
# the process within 5 s
STOP_STEP_S = 1.0
# Marks posted together are written as one batch after this pause (a mark written alone flushed
# the store on the event loop: 1,000 marks/s timed out 5,493 of 10,000 clients, /healthz p50 633 ms).
# An append costs ~30 ms whatever its size (busy 2-core machine); at 10 ms the appends took most
# of the loop from the requests; a mark waits about this long for its answer.
MARK_BATCH_S = 0.05


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


_PendingMark = tuple[Marker, "asyncio.Future[str | None]", web.Request]  # its request waits on the future


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
        self._log_gaps: list[dict[str, object]] = []  # log content that could not be read (meta.json)
        # marks posted and not yet written, each with the future its request waits on (None: stored,
        # else why not)
        self._marks_pending: list[_PendingMark] = []
        self._marks_posted = asyncio.Event()
        # set by ``stop`` when records could not be written: the one line the command ends with
        self.lost_on_stop: str | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.to_thread(warm_up)  # not on the loop once requests and records come
        topo = self.cfg.topology
        self.store.update_meta(topology=topology_to_meta(
            topo.pp_size, topo.tp_size, topo.dp_size, self.placements,
            "explicit" if topo.placements else "sglang-formula"))
        if self.options.listen:
            await self._start_http(self.options.listen)
        # The writer flushes from the first record: the first hosts deliver while the others connect
        # (32 hosts connected one after another on a busy 2-core box held 67,000 rows unwritten).
        self._tasks.append(self._spawn(self._flush_loop(), "flush"))
        self._tasks.append(self._spawn(self._write_marks(), "marks"))
        # Hosts connect side by side; the first host (in config order) that fails is the error.
        starts = (self._start_host(index, ht) for index, ht in enumerate(self._hosts))
        results = await asyncio.gather(*starts, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        await self._wait_ready()

    async def _start_host(self, index: int, ht: _HostTasks) -> None:
        with _naming(f"hosts[{index}] ({ht.host.name!r})"):
            ht.transport = await self._connect(ht.host)
        if ht.host.log is not None:
            self._ready[f"log {ht.host.name}"] = asyncio.Event()
            ht.tasks.append(self._spawn(self._follow_log(ht), f"log {ht.host.name}"))
        if ht.host.agent:
            with _naming(f"hosts[{index}].agent"):
                url = await self._agent_url(ht)
            ht.agent = AgentClient(url, token=self.options.agent_token, on_bad_line=self._bad_sample_line,
                                   history_margin_s=HISTORY_MARGIN_S)
            self._ready[f"agent {ht.host.name}"] = asyncio.Event()
            ht.tasks.append(self._spawn(self._pull_agent(ht), f"agent {ht.host.name}"))
        if ht.host.engine_metrics is not None:
            source = f"engine metrics {ht.host.name}"
            self._ready[source] = asyncio.Event()
            ht.tasks.append(self._spawn(self._scrape_engine_metrics(ht), source))
        ht.tasks.append(self._spawn(self._probe_clocks(ht), f"clock {ht.host.name}"))

    async def _wait_ready(self) -> None:
        """Return once every log follower has caught up and every agent answered once, so a load
        started next is seen live from its first request (bounded: a silent source only warns)."""
        waits = [asyncio.create_task(e.wait()) for e in self._ready.values()]
        if not waits:
            return
        try:
            await asyncio.wait(waits, timeout=self.options.ready_timeout_s)
        finally:
            for task in waits:
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
        """Stop every source, write what is buffered, close connections (each step bounded: a
        process asked to stop ends within seconds)."""
        tasks = [t for ht in self._hosts for t in ht.tasks] + self._tasks
        for task in tasks:
            task.cancel()
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=STOP_STEP_S)
            if stuck:
                log.warning("sources_not_stopped", sources=sorted(t.get_name() for t in stuck),
                            waited_s=STOP_STEP_S)
        if not self.writer.flush(every_type=True):  # what fits goes in; the rest is recorded
            log.error("store_records_lost", rows=self.writer.backlog_rows,
                      error=self.writer.write_error)
        for ht in self._hosts:
            if ht.agent is not None:
                with contextlib.suppress(Exception, TimeoutError):
                    await asyncio.wait_for(ht.agent.close(), STOP_STEP_S)
            if ht.transport is not None:
                with contextlib.suppress(Exception, TimeoutError):
                    await asyncio.wait_for(ht.transport.close(), STOP_STEP_S)
        if self._listener is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._listener.stop(), STOP_STEP_S)
        stopped_ns = time.time_ns()
        writer = self.writer
        outages = [*writer.outages]
        if writer.write_error is not None:
            outages.append({"error": writer.write_error, "since_ns": writer.failing_since_ns,
                            "until_ns": None, "lost_rows": writer.backlog_rows})
        unwritten = writer.unwritten()
        meta_error = None
        try:
            self.store.update_meta(extra={"collector": {
                "counts": dict(self.live.counts), "failures": self._failures,
                "source_problems": [p.to_dict() for p in self._problems], "store_outages": outages,
                "log_gaps": self._log_gaps,
                "dropped_records": dict(writer.dropped), "unwritten_records": unwritten,
                "stopped_ns": stopped_ns,
                "log_clock": [found.to_dict() for found in self._log_clock_offsets()]}})
        except StoreWriteError as exc:
            meta_error = str(exc)
            log.error("meta_not_updated", error=meta_error)
        if unwritten:
            self.lost_on_stop = _lost_on_stop(self.store.path, unwritten, writer.write_error, meta_error)
        log.info("collector_stopped", run=str(self.store.path), **self.live.counts)

    def _log_clock_offsets(self) -> list[LogClockOffset]:
        """Each followed log whose stamps run more than a minute from when its lines arrived (an
        engine logging local time read as UTC put every line hours off, and nothing said so)."""
        try:
            table = self.store.log_and_receive_times()
        except StoreError as exc:
            log.warning("log_clock_not_checked", error=str(exc))
            return []
        if not table.num_rows:
            return []
        hosts = table.column("host").to_numpy(zero_copy_only=False)
        sources = table.column("source").to_numpy(zero_copy_only=False)
        log_ts = table.column("log_ts_ns").to_numpy().astype(np.float64)
        recv = table.column("recv_ts_ns").to_numpy().astype(np.float64)
        found = []
        for host, source in sorted(set(zip(hosts.tolist(), sources.tolist(), strict=True))):
            sel = (hosts == host) & (sources == source)
            offset = log_clock_offset(f"{host} {source}", log_ts[sel], recv[sel])
            if offset is not None:
                log.warning("log_clock_disagrees", source=offset.source, offset_s=round(offset.offset_s),
                            suggested_timezone=offset.suggested_timezone())
                found.append(offset)
        return found

    async def start_unless(self, stop: asyncio.Event) -> bool:
        """``start``, ended early when ``stop`` is set (the readiness wait included): False then.
        A start that fails raises; either way call ``stop()`` after (it ends what start began)."""
        starting = asyncio.ensure_future(self.start())
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (starting, stopping):
                task.cancel()
            await asyncio.wait({starting, stopping})
        if starting.cancelled():
            return False
        if (error := starting.exception()) is not None:
            raise error
        return True

    async def run_until(self, stop: asyncio.Event) -> None:
        """``start``, collect until ``stop`` is set, ``stop``; ``stop`` set while starting ends the
        start, and a start that fails stops what it began."""
        try:
            if await self.start_unless(stop):
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
        try:
            host, port = parse_listen(agent)
        except UsageError:
            raise ConfigError(f"{self.cfg.path}: hosts[{self._hosts.index(ht)}].agent: expected HOST:PORT "
                              f"(port 1-65535) or an http:// URL, got {agent!r}") from None
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
                                              on_problem=lambda why: self._source_problem(name, why),
                                              on_gap=lambda gap: self._log_gap(name, gap)):
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
                elif isinstance(record, EngineConfig):
                    self.live.on_config(record)  # K and the pool, for the live engine figures

    async def _pull_agent(self, ht: _HostTasks) -> None:
        assert ht.agent is not None
        try:
            info = await ht.agent.info()
            self.writer.add_many(_devices_from_info(ht.host.name, info))
        except SourceError as exc:
            log.warning("agent_info_unavailable", host=ht.host.name, error=str(exc))
        name = f"agent {ht.host.name}"
        ready = self._ready.setdefault(name, asyncio.Event())
        told = False
        async for batch in ht.agent.follow(poll_s=self.options.agent_poll_s,
                                           on_problem=lambda why: self._source_problem(name, why)):
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
            self.live.on_engine_metrics(batch)
            self.writer.add_many(batch)

    async def _probe_clocks(self, ht: _HostTasks) -> None:
        while True:
            if ht.transport is not None and ht.host.ssh is not None:
                with contextlib.suppress(GputraceError):
                    self.writer.add(await probe_clock(ht.transport, ht.host.name))
            if ht.agent is not None:
                refused = ht.agent.stats.bad_probes
                with contextlib.suppress(GputraceError):
                    probe = await ht.agent.probe_clock(ht.host.name)
                    self.writer.add(probe)
                    self.live.on_clock_probe(probe)  # the agent's clock is the samples' clock
                # an answer that is no time is refused and counted; probing goes on
                self.live.counts["bad_clock_probes"] += ht.agent.stats.bad_probes - refused
            await asyncio.sleep(self.options.probe_interval_s)

    async def _write_marks(self) -> None:
        """Write the marks posted, a batch at a time, and tell each request whether its mark is
        stored: a mark answered 200 is on disk, one answered with an error is not."""
        try:
            while True:
                await self._marks_posted.wait()
                await asyncio.sleep(MARK_BATCH_S)
                self._marks_posted.clear()
                batch, self._marks_pending = self._marks_pending, []
                self._store_marks(batch)
        finally:
            for _, future, _ in self._marks_pending:
                future.cancel()
            self._marks_pending = []

    def _store_marks(self, batch: list[_PendingMark]) -> None:
        live = []
        for marker, future, request in batch:
            if future.done():
                continue
            if request.transport is None or request.transport.is_closing():
                future.set_result("the client went away before it was stored")  # it saw no 200
            else:
                live.append((marker, future))
        if not live:
            return
        try:
            _, rejected = self.store.append_valid([m for m, _ in live])
        except StoreWriteError as exc:
            log.warning("marks_not_stored", marks=len(live), error=str(exc))
            for _, future in live:
                future.set_result(f"the store cannot be written ({exc})")
            return
        refused = {id(record): reason for record, reason in rejected}
        for marker, future in live:
            reason = refused.get(id(marker))
            if reason is None:
                self.live.on_marker(marker)
            else:
                self.live.counts["bad_marks"] += 1
            future.set_result(None if reason is None else f"bad marker: {reason}")

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

    def _log_gap(self, source: str, gap: FollowGap) -> None:
        """Log content ``source`` could not read: kept in meta.json with its position and size, and
        as a problem over at once spanning the time it covers (the report's notes say it)."""
        self._log_gaps.append({"source": source, **gap.to_dict()})
        self._problems.append(CaptureProblem(source, gap.reason, gap.since_ns or gap.found_ns, gap.found_ns))

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
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            self.live.counts["bad_marks"] += 1
            why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            return web.json_response({"error": f"bad marker: {why}"}, status=400)
        # queued and written with the marks posted with it; answered once it is on disk
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        entry = (marker, future, request)
        self._marks_pending.append(entry)
        self._marks_posted.set()
        try:
            why_not = await future
        except asyncio.CancelledError:
            # the request timed out or the collector stops: not stored, as its answer will say
            with contextlib.suppress(ValueError):
                self._marks_pending.remove(entry)
            raise
        if why_not is not None:
            status = 400 if why_not.startswith("bad marker") else 503
            return web.json_response({"error": why_not, "stored": False}, status=status)
        return web.json_response({"ok": True, "ts_ns": marker.ts_ns, "stored": True})

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


@contextlib.contextmanager
def _naming(key: str) -> Iterator[None]:
    """A failure at start names the configuration entry it came from (the same error class)."""
    try:
        yield
    except ConfigError:
        raise
    except GputraceError as exc:
        raise type(exc)(f"{key}: {exc}") from exc


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


def _lost_on_stop(run: Path, unwritten: dict[str, dict[str, Any]], error: str | None,
                  meta_error: str | None) -> str:
    """'stopped with N records not written (...)': the line a capture that lost its backlog ends with."""
    rows = sum(entry["rows"] for entry in unwritten.values())
    kinds = ", ".join(f"{entry['rows']} {name}" for name, entry in unwritten.items())
    spans = [(e["first_ns"], e["last_ns"]) for e in unwritten.values() if "first_ns" in e]
    span = ""
    if spans:
        first_s, last_s = min(a for a, _ in spans) / 1e9, max(b for _, b in spans) / 1e9
        span = (f", from {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(first_s))} to "
                f"{time.strftime('%H:%M:%S', time.gmtime(last_s))} UTC")
    where = (f"counted in {run / 'meta.json'} (collector.unwritten_records)" if meta_error is None
             else f"meta.json could not record them either ({meta_error.rsplit(': ', 1)[-1]})")
    # the reason, without the database's wording around it ("No space left on device")
    reason = (error or "unknown").rsplit(": ", 1)[-1]
    return (f"stopped with {rows} records not written ({kinds}{span}): the store cannot be written "
            f"({reason}); {where}")


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
        store.reserve_meta_space()  # so a stop on a full disk still records what it lost
        yield store
    except BaseException:
        if store.is_empty():
            store.discard()
        else:
            store.close()
        raise
    store.close()
