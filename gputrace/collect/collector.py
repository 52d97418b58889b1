"""The collector: for one run, per host one transport (SSH or local) that follows the engine log,
pulls the agent's samples and probes the clock; everything goes to the run store in batches at
least once a second, and a small HTTP server serves live metrics, phase marks and status.

The collector reads the time and its host's name from what it is given (``clock_ns``,
``hostname``), as the agent client, the live view and the load generator do: a test drives it on
a clock of its own instead of sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from gputrace.agent.client import HISTORY_MARGIN_S, AgentClient
from gputrace.collect.http_api import CollectorApi
from gputrace.collect.marks import MarkWriter
from gputrace.collect.problems import SourceProblems
from gputrace.collect.run_store import log_clocks, lost_on_stop
from gputrace.config import Config, HostConfig
from gputrace.engines import LogParser
from gputrace.errors import ConfigError, GputraceError, SourceError, StoreWriteError, UsageError
from gputrace.httpserver import (
    HttpLimits,
    HttpListener,
    is_loopback,
    parse_listen,
)
from gputrace.json_types import JsonObject
from gputrace.live import LiveState
from gputrace.logsetup import get_logger
from gputrace.model import DeviceInfo, EngineConfig, Marker, RequestRecord, SchedulerEvent
from gputrace.remote.clock import probe_clock
from gputrace.remote.connect import TransportFactory, connect_host
from gputrace.remote.engine_scrape import MetricsEndpoint, ScrapeStats, follow_metrics
from gputrace.remote.follow import follow_log_batches
from gputrace.remote.ssh import HostKeyPolicy
from gputrace.remote.transport import Transport
from gputrace.store import REJECTS_FILE, BatchingWriter, Store, warm_up
from gputrace.token_file import read_token
from gputrace.topology import topology_to_meta
from gputrace.vocabulary import CaptureProblem, LiveStatus

log = get_logger("collect")
DEFAULT_LISTEN = "127.0.0.1:9401"
# The file follower polls every 20 ms and an SSH hop adds milliseconds: a log silent this long after
# a drain began has delivered every line written before it.
DRAIN_QUIET_S = 0.3
# each step of stop() (sources ending, connections closing) is bounded by this: SIGTERM must end
# the process within 5 s
STOP_STEP_S = 1.0


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
    ``ssh`` says, under the options' host-key policy). ``clock_ns`` (epoch ns) stamps what the
    collector dates itself (receipts, problems, marks without a time, the stop) and measures
    ``drain``'s quiet and timeout; ``hostname`` is the host a mark without one is filed under."""

    def __init__(self, cfg: Config, store: Store, options: CollectOptions | None = None,
                 connect: TransportFactory | None = None, *, clock_ns: Callable[[], int] = time.time_ns,
                 hostname: str | None = None):
        self.cfg = cfg
        self.store = store
        self.options = options or CollectOptions()
        self._connect = connect or self._connect_configured
        self.placements = cfg.placements()
        self.clock_ns = clock_ns
        self.live = LiveState(store.meta.name, self.placements, clock_ns=clock_ns)
        self.writer = BatchingWriter(store, flush_s=self.options.flush_s, on_reject=self._rejected)
        self._hosts = [_HostTasks(h) for h in cfg.hosts]
        self._tasks: list[asyncio.Task[None]] = []
        self._listener: HttpListener | None = None
        self.url: str | None = None
        self.client_host = hostname if hostname is not None else socket.gethostname()
        self._failures: list[str] = []
        self._ready: dict[str, asyncio.Event] = {}
        self.source_problems = SourceProblems(clock_ns)
        self._last_log_batch_ns: dict[str, int] = {}  # per log source, when its newest lines came
        self.marks = MarkWriter(store, self.live, self.client_host, clock_ns)
        # set by ``stop`` when records could not be written: the one line the command ends with
        self.lost_on_stop: str | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.to_thread(warm_up)  # not on the loop once requests and records come
        topo = self.cfg.topology
        self.store.update_meta(topology=topology_to_meta(
            topo.pp_size, topo.tp_size, topo.dp_size, self.placements, self.cfg.placement_source))
        if self.options.listen:
            api = CollectorApi(self.live, self.marks, self.status, self.problems, self._failures,
                               token=self.options.http_token, insecure=self.options.insecure,
                               limits=self.options.http_limits)
            self._listener, self.url = await api.start(self.options.listen)
        # The writer flushes from the first record: the first hosts deliver while the others connect
        # (32 hosts connected one after another on a busy 2-core box held 67,000 rows unwritten).
        self._tasks.append(self._spawn(self._flush_loop(), "flush"))
        self._tasks.append(self._spawn(self.marks.run(), "marks"))
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
                                   history_margin_s=HISTORY_MARGIN_S, clock_ns=self.clock_ns)
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
        asked_ns = self.clock_ns()
        deadline_ns = asked_ns + int(timeout_s * 1e9)
        while waiting := self._not_drained(asked_ns):
            if self.clock_ns() >= deadline_ns:
                log.warning("drain timed out; stopping with what arrived", waiting_for=waiting,
                            timeout_s=timeout_s)
                self.writer.flush()
                return False
            await asyncio.sleep(0.02)
        return self.writer.flush()

    def _not_drained(self, asked_ns: int) -> list[str]:
        """The sources still delivering what they held at ``asked_ns``."""
        now_ns = self.clock_ns()
        open_problems = self.source_problems.open_sources()
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
        stopped_ns = self.clock_ns()
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
                "source_problems": [p.to_dict() for p in self.source_problems.seen],
                "store_outages": outages, "log_gaps": self.source_problems.log_gaps,
                "dropped_records": dict(writer.dropped), "unwritten_records": unwritten,
                "stopped_ns": stopped_ns,
                "log_clock": log_clocks(self.store)}})
        except StoreWriteError as exc:
            meta_error = str(exc)
            log.error("meta_not_updated", error=meta_error)
        if unwritten:
            self.lost_on_stop = lost_on_stop(self.store.path, unwritten, writer.write_error, meta_error)
        log.info("collector_stopped", run=str(self.store.path), **self.live.counts)

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
                self.source_problems.note(name, f"stopped: {exc}")
                log.error("source_failed", source=name, error=str(exc))
            except Exception as exc:  # a bug in one source must not stop the others
                self._failures.append(f"{name}: {type(exc).__name__}: {exc}")
                self.source_problems.note(name, f"stopped: {type(exc).__name__}: {exc}")
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
                           tz=src.timezone, year_until=self._today)
        name = f"log {ht.host.name}"
        ready = self._ready.setdefault(name, asyncio.Event())
        async for batch in follow_log_batches(ht.transport, src, from_start=self.options.log_from_start,
                                              on_caught_up=ready.set,
                                              on_problem=lambda why: self.source_problems.note(name, why),
                                              on_gap=lambda gap: self.source_problems.log_gap(name, gap)):
            self._last_log_batch_ns[name] = self.clock_ns()
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

    def _today(self) -> dt.date:
        """The collector's date (UTC): a line followed live was written by then."""
        return dt.datetime.fromtimestamp(self.clock_ns() / 1e9, dt.UTC).date()

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
                                           on_problem=lambda why: self.source_problems.note(name, why)):
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
                                          on_problem=lambda why: self.source_problems.note(name, why)):
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

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(min(self.options.flush_s, 0.25))
            self.writer.maybe_flush()

    def problems(self) -> list[CaptureProblem]:
        """What keeps the capture from being complete right now: failing sources, the store."""
        current = self.source_problems.current()
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


@contextlib.contextmanager
def _naming(key: str) -> Iterator[None]:
    """A failure at start names the configuration entry it came from (the same error class)."""
    try:
        yield
    except ConfigError:
        raise
    except GputraceError as exc:
        raise type(exc)(f"{key}: {exc}") from exc


def _devices_from_info(host: str, info: JsonObject) -> list[DeviceInfo]:
    """The devices of an agent's /v1/info (those with a GPU index); a field of the wrong type is
    taken as not reported."""
    devices = info.get("devices")
    if not isinstance(devices, list):
        return []
    return [d for dev in devices if isinstance(dev, dict) and (d := _device(host, dev)) is not None]


def _count(obj: JsonObject, name: str) -> int | None:
    value = obj.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _device(host: str, dev: JsonObject) -> DeviceInfo | None:
    """One /v1/info device, None without an integer ``gpu_index``."""
    def text(name: str) -> str | None:
        value = dev.get(name)
        return value if isinstance(value, str) else None

    index, limit_w = _count(dev, "gpu_index"), dev.get("power_limit_w")
    if index is None:
        return None
    return DeviceInfo(
        host, index, uuid=text("uuid"), name=text("name"), pci_bus_id=text("pci_bus_id"),
        pcie_max_gen=_count(dev, "pcie_max_gen"), pcie_max_width=_count(dev, "pcie_max_width"),
        power_limit_w=float(limit_w) if isinstance(limit_w, int | float) and not isinstance(limit_w, bool)
        else None,
        memory_total_bytes=_count(dev, "memory_total_bytes"))
