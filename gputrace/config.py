"""``gputrace.toml``: hosts, how to reach them, their log source and agent, the topology and
the load. Validated fully on load; every error names the file, the key and what is wrong.

Example::

    [run]
    name = "pp8-c32"

    [[hosts]]
    name = "node0"
    ssh = "ubuntu@10.0.0.5:22"      # omit (or "local") to run on this machine
    identity_file = "~/.ssh/id_ed25519"
    agent = "127.0.0.1:9402"         # the agent's address on that host (its default port)
    gpus = [0, 1, 2, 3, 4, 5, 6, 7]

    [hosts.log]
    kind = "file"                    # file | journald | docker | command
    path = "/var/log/sglang/server.log"
    engine = "sglang"

    [hosts.engine_metrics]           # optional: the engine's own /metrics (SGLang --enable-metrics)
    url = "http://127.0.0.1:30000/metrics"   # as seen from that host (forwarded over SSH)
    token_file = "~/.config/gputrace/engine-token"   # optional bearer token

    [topology]
    pp_size = 8
    tp_size = 1

    [load]
    url = "http://10.0.0.5:30000"
    model = "default"
    concurrency = [1, 8, 32, 64]
    max_tokens = 512
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import ipaddress
import math
import resource
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from gputrace.engines import ENGINE_WORDS, engine_words
from gputrace.engines.common import EngineWords
from gputrace.errors import ConfigError
from gputrace.topology import MAX_GPU_INDEX, MAX_GPUS, MAX_PARALLEL_SIZE, Placement

TomlValue: TypeAlias = (str | int | float | bool | dt.datetime | dt.date | dt.time | list["TomlValue"]
                        | dict[str, "TomlValue"])
TomlTable: TypeAlias = dict[str, TomlValue]
"""A TOML table as tomllib reads it: the config file as written, before ``_Section`` checks each key."""

LOG_KINDS = ("file", "journald", "docker", "command")
# A request in flight holds one connection to the server (gputrace load opens one per request),
# so a level cannot exceed the TCP ports of one client address; 10^6 grew `load` to 3 GB of
# waiting coroutines in 30 s with nothing printed.
MAX_CONCURRENCY = 65_535
# File descriptors kept for what is not a request: the store, logs, marker posts, the event loop.
_FDS_KEPT = 64
ENGINES = tuple(ENGINE_WORDS)  # the engines a log source may name (gputrace/engines/)


@dataclass(frozen=True, slots=True)
class SshTarget:
    user: str | None
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class LogSource:
    kind: str  # file | journald | docker | command
    target: str  # the path, unit, container name or command
    engine: str = "sglang"
    timezone: str = "UTC"  # the zone the engine's log timestamps are written in


@dataclass(frozen=True, slots=True)
class EngineMetricsSource:
    url: str  # http(s)://host:port/path as seen from the engine's host
    token_file: str | None = None
    interval_s: float = 1.0
    timeout_s: float = 5.0


@dataclass(frozen=True, slots=True)
class HostConfig:
    name: str
    ssh: SshTarget | None  # None: this machine, through the local transport
    identity_file: str | None = None
    known_hosts: str | None = None
    agent: str | None = None  # host:port of the agent, as seen from that host
    gpus: tuple[int, ...] | None = None
    log: LogSource | None = None
    node_rank: int = 0
    engine_metrics: EngineMetricsSource | None = None


@dataclass(frozen=True, slots=True)
class TopologyConfig:
    pp_size: int = 1
    tp_size: int = 1
    dp_size: int = 1
    nnodes: int = 1
    base_gpu_id: int = 0
    gpu_id_step: int = 1
    placements: tuple[Placement, ...] = ()  # explicit table ([[topology.map]]); overrides the formula


@dataclass(frozen=True, slots=True)
class LoadConfig:
    url: str
    model: str = "default"
    concurrency: tuple[int, ...] = (1, 8, 32, 64)
    max_tokens: int = 512
    requests_per_level: int | None = None
    duration_per_level_s: float | None = None
    prompts_file: str | None = None
    temperature: float = 0.0
    stream: bool = True
    ignore_eos: bool = False
    burst: bool = False  # each level's C requests at once; the level ends when the last is back


@dataclass(frozen=True, slots=True)
class Config:
    path: Path
    run_name: str | None
    hosts: tuple[HostConfig, ...]
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    load: LoadConfig | None = None
    raw: TomlTable = field(default_factory=dict)  # the file as read (meta.json's ``config``)

    @property
    def engine(self) -> EngineWords:
        """The engine the hosts' logs name (the first that names one gputrace knows; SGLang's
        where none does, as for a run whose log names none)."""
        named = [h.log.engine for h in self.hosts if h.log is not None and h.log.engine in ENGINE_WORDS]
        return engine_words(named[0] if named else None)

    @property
    def placement_source(self) -> str:
        """How the GPUs' ranks were found, as meta.json's topology.source says it."""
        return "explicit" if self.topology.placements else self.engine.placement_source

    def placements(self) -> list[Placement]:
        """The explicit table when the config has one, else the engine's rule per host's node_rank."""
        topo = self.topology
        if topo.placements:
            return list(topo.placements)
        return [p for host in self.hosts
                for p in self.engine.placements(host.name, pp_size=topo.pp_size, tp_size=topo.tp_size,
                                                nnodes=topo.nnodes, node_rank=host.node_rank,
                                                base_gpu_id=topo.base_gpu_id, gpu_id_step=topo.gpu_id_step)]


class _Section:
    """Reads typed keys from one TOML table and rejects keys nobody asked for."""

    def __init__(self, path: Path, prefix: str, table: Any):
        self.path = path
        self.prefix = prefix
        if not isinstance(table, dict):
            self.fail(prefix, f"must be a table, not {_type_name(table)}")
        self.table: TomlTable = table
        self.seen: set[str] = set()

    def fail(self, key: str, what: str) -> None:
        raise ConfigError(f"{self.path}: {key}: {what}")

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = None,
            required: bool = False) -> Any:
        self.seen.add(name)
        if name not in self.table:
            if required:
                self.fail(self.key(name), "required key is missing")
            return default
        value = self.table[name]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # TOML integers are acceptable where floats are; booleans are not integers here.
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        if not ok and float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            expected = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
            self.fail(self.key(name), f"expected {expected}, got {_type_name(value)} {value!r}")
        return value

    def int_list(self, name: str, default: Any = None, minimum: int = 0) -> tuple[int, ...] | None:
        value = self.get(name, list, default)
        if value is None or isinstance(value, tuple):
            return value
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, int) or item < minimum:
                self.fail(f"{self.key(name)}[{i}]", f"expected an integer >= {minimum}, got {item!r}")
        return tuple(value)

    def positive(self, name: str, default: int, minimum: int = 1, maximum: int | None = None) -> int:
        value: int = self.get(name, int, default)
        if value < minimum:
            self.fail(self.key(name), f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            self.fail(self.key(name), f"must be <= {maximum}, got {value}")
        return value

    def size(self, name: str) -> int:
        """A parallel size or node count: 1 to MAX_PARALLEL_SIZE (default 1)."""
        return self.positive(name, 1, minimum=1, maximum=MAX_PARALLEL_SIZE)

    def rank(self, name: str, size: int, size_name: str, required: bool = False) -> int:
        """A rank within its size: 0 to size - 1."""
        value: int = self.get(name, int, 0, required=required)
        if not 0 <= value < size:
            self.fail(self.key(name), f"must be from 0 to {size - 1} ({size_name}: {size}), got {value}")
        return value

    def number(self, name: str, default: float | None, minimum: float = 0.0,
               exclusive: bool = False) -> float | None:
        """A finite number >= ``minimum`` (> with ``exclusive``); TOML's nan and inf are refused."""
        value: float | None = self.get(name, float, default)
        if value is None:
            return None
        if not math.isfinite(value) or value < minimum or (exclusive and value == minimum):
            bound = f"> {minimum:g}" if exclusive else f">= {minimum:g}"
            self.fail(self.key(name), f"must be a finite number {bound}, got {value!r}")
        return value

    def done(self) -> None:
        unknown = sorted(set(self.table) - self.seen)
        if unknown:
            self.fail(self.key(unknown[0]), "unknown key" + _did_you_mean(unknown[0], self.seen))


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
               list: "an array", dict: "a table"}


def _type_name(value: Any) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def _did_you_mean(key: str, known: set[str]) -> str:
    import difflib

    close = difflib.get_close_matches(key, sorted(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(known))})"


def parse_ssh_target(text: str, path: Path, key: str) -> SshTarget | None:
    """``user@host:port`` (user and port optional; an IPv6 address in brackets when a port
    follows, ``root@[::1]:22``, bare otherwise); ``local`` means this machine."""
    if text in ("", "local"):
        return None
    user, _, hostport = text.rpartition("@")
    host, port_text = hostport, None
    if hostport.startswith("["):
        inside, bracket, rest = hostport[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ConfigError(f"{path}: {key}: {text!r}: an IPv6 address goes in brackets, "
                              "as in root@[::1]:22")
        host, port_text = inside, (rest[1:] if rest else None)
    elif hostport.count(":") == 1:
        host, _, port_text = hostport.partition(":")
    if host.count(":") > 0 and not _is_ipv6(host):
        raise ConfigError(f"{path}: {key}: {host!r} is not a host name or IP address")
    port = 22
    if port_text is not None:
        if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
            raise ConfigError(f"{path}: {key}: port must be 1-65535, got {port_text!r}")
        port = int(port_text)
    if not host:
        raise ConfigError(f"{path}: {key}: no host name in {text!r}")
    return SshTarget(user=user or None, host=host, port=port)


def _agent_address(sec: _Section, text: str | None) -> str | None:
    """``HOST:PORT``, ``[V6]:PORT`` or an http(s):// URL (a bad one made `collect` hang at start)."""
    if text is None:
        return None
    if text.startswith(("http://", "https://")):
        parts = urlsplit(text)
        try:
            ok = bool(parts.hostname) and parts.port != 0
        except ValueError:  # a port out of range
            ok = False
    else:
        host, sep, port = text.rpartition(":")
        ok = (sep == ":" and port.isdigit() and 0 < int(port) < 65536 and not any(c.isspace() for c in host)
              and (host.count(":") == 0 or (host.startswith("[") and host.endswith("]"))))
    if not ok:
        sec.fail(sec.key("agent"), f"expected HOST:PORT (port 1-65535) or an http(s):// URL, got {text!r}")
    return text


def max_concurrency() -> int:
    """The most requests this process can keep in flight: its open-file limit (``ulimit -n``)
    less what it needs for itself, and never more than MAX_CONCURRENCY."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONCURRENCY
    return max(1, min(MAX_CONCURRENCY, soft - _FDS_KEPT))


def concurrency_problem(level: int) -> str | None:
    """Why this machine cannot keep ``level`` requests in flight, or None when it can."""
    limit = max_concurrency()
    if level <= limit:
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    why = (f"its open-file limit is {soft}: raise it with ulimit -n" if limit < MAX_CONCURRENCY
           else f"one client address has {MAX_CONCURRENCY} TCP ports")
    return (f"{level} requests in flight need as many open connections; this machine can hold "
            f"at most {limit} ({why})")


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def ssh_target_text(target: SshTarget) -> str:
    """``user@host:port`` as the config writes it (an IPv6 address in brackets)."""
    host = f"[{target.host}]" if ":" in target.host else target.host
    return f"{target.user + '@' if target.user else ''}{host}:{target.port}"


def _parse_host(path: Path, index: int, table: Any) -> HostConfig:
    sec = _Section(path, f"hosts[{index}]", table)
    name = sec.get("name", str, required=True)
    if not name.strip():
        # the name labels every sample and the topology's rows: an empty one matches nothing
        sec.fail(sec.key("name"), "must not be empty (a name for this host, e.g. node0)")
    ssh = parse_ssh_target(sec.get("ssh", str, "local"), path, sec.key("ssh"))
    log_table = sec.get("log", dict)
    log = _parse_log(path, sec.key("log"), log_table) if log_table is not None else None
    metrics_table = sec.get("engine_metrics", dict)
    metrics = (_parse_engine_metrics(path, sec.key("engine_metrics"), metrics_table)
               if metrics_table is not None else None)
    gpus = sec.int_list("gpus")
    listed = gpus or ()
    for i, gpu in enumerate(listed):
        if gpu in listed[:i]:
            sec.fail(f"{sec.key('gpus')}[{i}]",
                     f"GPU {gpu} is listed twice (also at gpus[{listed.index(gpu)}])")
    host = HostConfig(
        name=name,
        ssh=ssh,
        identity_file=sec.get("identity_file", str),
        known_hosts=sec.get("known_hosts", str),
        agent=_agent_address(sec, sec.get("agent", str)),
        gpus=gpus,
        log=log,
        node_rank=sec.positive("node_rank", 0, minimum=0),
        engine_metrics=metrics,
    )
    sec.done()
    return host


def _parse_engine_metrics(path: Path, prefix: str, table: Any) -> EngineMetricsSource:
    sec = _Section(path, prefix, table)
    url = sec.get("url", str, required=True)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        sec.fail(sec.key("url"), f"must be an http:// or https:// URL with a host, got {url!r}")
    try:
        parts.port  # noqa: B018  # raises for a port out of range
    except ValueError:
        sec.fail(sec.key("url"), f"bad port in {url!r}")
    interval = sec.get("interval_s", float, 1.0)
    timeout = sec.get("timeout_s", float, 5.0)
    for name, value in (("interval_s", interval), ("timeout_s", timeout)):
        if not 0.05 <= value <= 3600:
            sec.fail(sec.key(name), f"must be from 0.05 to 3600 seconds, got {value}")
    source = EngineMetricsSource(url=url, token_file=sec.get("token_file", str), interval_s=interval,
                                 timeout_s=timeout)
    sec.done()
    return source


def _parse_log(path: Path, prefix: str, table: Any) -> LogSource:
    sec = _Section(path, prefix, table)
    kind = sec.get("kind", str, "file")
    if kind not in LOG_KINDS:
        sec.fail(sec.key("kind"), f"must be one of {', '.join(LOG_KINDS)}, got {kind!r}")
    target_key = {"file": "path", "journald": "unit", "docker": "container", "command": "command"}
    target = sec.get(target_key[kind], str, required=True)
    engine = sec.get("engine", str, "sglang")
    if engine not in ENGINES:
        sec.fail(sec.key("engine"), f"must be one of {', '.join(ENGINES)}, got {engine!r}")
    timezone = sec.get("timezone", str, "UTC")
    if not _is_timezone(timezone):
        sec.fail(sec.key("timezone"),
                 f"unknown timezone {timezone!r} (an IANA name like Europe/Berlin, or UTC)")
    sec.done()
    return LogSource(kind=kind, target=target, engine=engine, timezone=timezone)


def _is_timezone(name: str) -> bool:
    """Whether the engine's log clock (engines.common.LogClock) takes this zone name."""
    if name.upper() in ("UTC", "Z"):
        return True
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):  # OSError: "America" is a directory
        return False
    return True


def _parse_topology(path: Path, table: Any, host_names: set[str]) -> TopologyConfig:
    sec = _Section(path, "topology", table)
    rows = sec.get("map", list, [])
    topo = TopologyConfig(
        pp_size=sec.size("pp_size"),
        tp_size=sec.size("tp_size"),
        dp_size=sec.size("dp_size"),
        nnodes=sec.size("nnodes"),
        base_gpu_id=sec.positive("base_gpu_id", 0, minimum=0, maximum=MAX_GPU_INDEX),
        gpu_id_step=sec.positive("gpu_id_step", 1, maximum=MAX_GPU_INDEX),
    )
    gpus = topo.pp_size * topo.tp_size * topo.dp_size
    if gpus > MAX_GPUS:
        sec.fail("topology", f"pp_size x tp_size x dp_size = {gpus} GPUs, more than gputrace "
                             f"handles ({MAX_GPUS})")
    placements: list[Placement] = []
    mapped: dict[tuple[str, int], int] = {}
    for i, row in enumerate(rows):
        rs = _Section(path, f"topology.map[{i}]", row)
        host = rs.get("host", str, required=True)
        if host not in host_names:
            rs.fail(rs.key("host"), f"no host named {host!r} in [[hosts]]")
        placement = Placement(
            host=host,
            gpu_index=rs.positive("gpu", 0, minimum=0, maximum=MAX_GPU_INDEX),
            pp_rank=rs.rank("pp_rank", topo.pp_size, "pp_size", required=True),
            # tp and dp ranks only within the largest size: a table may be given without tp/dp sizes
            tp_rank=rs.rank("tp_rank", MAX_PARALLEL_SIZE, "the largest size"),
            dp_rank=rs.rank("dp_rank", MAX_PARALLEL_SIZE, "the largest size"),
        )
        rs.done()
        first = mapped.setdefault((host, placement.gpu_index), i)
        if first != i:
            rs.fail(rs.key("gpu"), f"GPU {placement.gpu_index} of host {host!r} is mapped twice "
                                   f"(also in topology.map[{first}])")
        placements.append(placement)
    sec.done()
    return dataclasses.replace(topo, placements=tuple(placements))


def _parse_load(path: Path, table: Any) -> LoadConfig:
    sec = _Section(path, "load", table)
    load = LoadConfig(
        url=sec.get("url", str, required=True),
        model=sec.get("model", str, "default"),
        concurrency=sec.int_list("concurrency", (1, 8, 32, 64), minimum=1) or (1,),
        max_tokens=sec.positive("max_tokens", 512),
        requests_per_level=(None if sec.get("requests_per_level", int) is None
                            else sec.positive("requests_per_level", 1)),
        duration_per_level_s=sec.number("duration_per_level_s", None, exclusive=True),
        prompts_file=sec.get("prompts_file", str),
        temperature=sec.number("temperature", 0.0) or 0.0,
        stream=sec.get("stream", bool, True),
        ignore_eos=sec.get("ignore_eos", bool, False),
        burst=sec.get("burst", bool, False),
    )
    for i, level in enumerate(load.concurrency):
        if (problem := concurrency_problem(level)) is not None:
            sec.fail(f"{sec.key('concurrency')}[{i}]", problem)
    if not load.url.startswith(("http://", "https://")):
        sec.fail(sec.key("url"), f"must start with http:// or https://, got {load.url!r}")
    sec.done()
    return load


def parse_config(text: str, path: Path) -> Config:
    """Validate the text of a gputrace.toml; ``path`` is only used in messages."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    except RecursionError:  # tomllib recurses per level of nested arrays and inline tables
        raise ConfigError(f"{path}: not a gputrace.toml: arrays or tables nested too deeply") from None
    top = _Section(path, "", raw)
    run = top.get("run", dict, {})
    run_sec = _Section(path, "run", run)
    run_name = run_sec.get("name", str)
    run_sec.done()
    host_tables = top.get("hosts", list, required=True)
    if not host_tables:
        top.fail("hosts", "at least one [[hosts]] entry is required")
    hosts = tuple(_parse_host(path, i, t) for i, t in enumerate(host_tables))
    names: set[str] = set()
    for i, h in enumerate(hosts):
        if h.name in names:
            top.fail(f"hosts[{i}].name", f"duplicate host name {h.name!r}")
        names.add(h.name)
    topo_table = top.get("topology", dict)
    topology = _parse_topology(path, topo_table, names) if topo_table is not None else TopologyConfig()
    for i, h in enumerate(hosts):
        if h.node_rank >= topology.nnodes:
            top.fail(f"hosts[{i}].node_rank", f"must be below topology.nnodes ({topology.nnodes}), "
                                              f"got {h.node_rank}")
    load_table = top.get("load", dict)
    load = _parse_load(path, load_table) if load_table is not None else None
    top.done()
    return Config(path=path, run_name=run_name, hosts=hosts, topology=topology, load=load, raw=raw)


def load_config(path: str | Path) -> Config:
    """Read and validate a gputrace.toml file."""
    p = Path(path).expanduser()
    try:
        text = p.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{p}: is a directory, expected a gputrace.toml file") from None
    except PermissionError:
        raise ConfigError(f"{p}: permission denied") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML: not UTF-8 text ({exc.reason})") from exc
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror}") from exc
    return parse_config(text, p)
