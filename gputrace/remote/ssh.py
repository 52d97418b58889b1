"""The SSH transport (the only module that imports asyncssh): one connection per host with
keepalive, many channels on it, host keys verified against known_hosts unless told otherwise."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

# cryptography 51 deprecates DSA and asyncssh (2.24) touches its key classes at import: users of
# collect/run/watch saw about ten lines of this warning before any output. gputrace never offers or
# accepts DSA keys, so the warning says nothing to them; silence exactly it, here, at the adapter.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="DSA is deprecated", category=UserWarning)
    import asyncssh

from gputrace.errors import HostKeyError, TransportError
from gputrace.logsetup import get_logger
from gputrace.remote.transport import CommandResult, shell_command, watched_argv

log = get_logger("remote.ssh")


class HostKeyPolicy(enum.StrEnum):
    """How an SSH host key is checked against known_hosts."""

    VERIFY = "verify"  # the key must be in known_hosts (the default)
    ACCEPT_NEW = "accept-new"  # learn unknown hosts' keys into known_hosts; refuse changed keys
    INSECURE_SKIP = "insecure-skip"  # accept any key (--insecure-skip-host-key-check)


@dataclass(frozen=True, slots=True)
class SshOptions:
    """How to reach one host over SSH."""

    host: str
    port: int = 22
    username: str | None = None
    identity_files: tuple[str, ...] = ()  # empty: the user's default keys and ssh-agent
    known_hosts_path: str | None = None  # None: ~/.ssh/known_hosts
    host_key_policy: HostKeyPolicy = HostKeyPolicy.VERIFY
    keepalive_interval_s: float = 5.0
    keepalive_count_max: int = 3
    connect_timeout_s: float = 10.0
    extra: dict[str, object] = field(default_factory=dict)  # passed to asyncssh.connect (tests)

    @property
    def known_hosts(self) -> Path:
        return Path(self.known_hosts_path or "~/.ssh/known_hosts").expanduser()

    @property
    def host_pattern(self) -> str:
        """The host as known_hosts writes it."""
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"


class _Client(asyncssh.SSHClient):
    """Decides about host keys that known_hosts does not list, per the policy."""

    def __init__(self, options: SshOptions, known: asyncssh.SSHKnownHosts | None,
                 on_lost: asyncio.Event) -> None:
        self._options = options
        self._known = known
        self._on_lost = on_lost
        self.refusal: str | None = None

    def validate_host_public_key(self, host: str, addr: str, port: int, key: asyncssh.SSHKey) -> bool:
        opts = self._options
        fingerprint = key.get_fingerprint()
        if opts.host_key_policy is HostKeyPolicy.INSECURE_SKIP:
            log.warning("ssh_host_key_not_checked", host=opts.host_pattern, fingerprint=fingerprint,
                        why="--insecure-skip-host-key-check: the connection can be intercepted")
            return True
        if _lists_host(self._known, host, addr, port):
            self.refusal = (
                f"{opts.host_pattern}: the SSH host key has CHANGED ({fingerprint}) and does not match "
                f"{opts.known_hosts}; if the host was reinstalled, remove the old key with "
                f"`ssh-keygen -R '{opts.host_pattern}' -f {opts.known_hosts}` and connect again"
            )
            return False
        if opts.host_key_policy is HostKeyPolicy.ACCEPT_NEW:
            _learn_key(opts, key)
            log.warning("ssh_host_key_learned", host=opts.host_pattern, fingerprint=fingerprint,
                        known_hosts=str(opts.known_hosts), why="--accept-new-host-keys")
            return True
        self.refusal = (
            f"{opts.host_pattern}: the SSH host key ({fingerprint}) is not in {opts.known_hosts}; "
            f"check it and add it (`ssh-keyscan -p {opts.port} {opts.host} >> {opts.known_hosts}`) "
            "or pass --accept-new-host-keys"
        )
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost.set()


def _learn_key(opts: SshOptions, key: asyncssh.SSHKey) -> None:
    path = opts.known_hosts
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key_text = key.export_public_key("openssh").decode().split()
    line = f"{opts.host_pattern} {key_text[0]} {key_text[1]}\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a") as handle:
        handle.write(line)


def _lists_host(known: asyncssh.SSHKnownHosts | None, host: str, addr: str, port: int) -> bool:
    """Whether known_hosts has any key (or CA) for this host, by name or address."""
    if known is None:
        return False
    matched = asyncssh.match_known_hosts(known, host, addr, port if port != 22 else None)
    return bool(matched[0] or matched[1])


def _read_known_hosts(opts: SshOptions) -> asyncssh.SSHKnownHosts | None:
    """The parsed known_hosts file; None when it is missing or empty."""
    path = opts.known_hosts
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TransportError(f"{opts.host_pattern}: cannot read {path}: {exc}") from exc
    if not data.strip():
        return None
    try:
        return asyncssh.import_known_hosts(data.decode("utf-8", "replace"))
    except (ValueError, asyncssh.KeyImportError) as exc:
        raise TransportError(f"{path}: not a valid known_hosts file: {exc}") from exc


class SshStream:
    """One channel running one command."""

    def __init__(self, host: str, process: asyncssh.SSHClientProcess[bytes]) -> None:
        self._host = host
        self._process = process
        self._stderr: deque[bytes] = deque(maxlen=64)
        self._stderr_task = asyncio.create_task(self._drain_stderr())

    async def _drain_stderr(self) -> None:
        with contextlib.suppress(asyncssh.Error, OSError):
            while chunk := await self._process.stderr.read(4096):
                self._stderr.append(chunk)

    async def read(self, max_bytes: int = 65536) -> bytes:
        try:
            return await self._process.stdout.read(max_bytes)
        except (asyncssh.Error, OSError) as exc:
            raise TransportError(f"{self._host}: the SSH channel broke: {exc}") from exc

    async def write(self, data: bytes) -> None:
        try:
            self._process.stdin.write(data)
            await self._process.stdin.drain()
        except (asyncssh.Error, OSError, BrokenPipeError) as exc:
            raise TransportError(f"{self._host}: the SSH channel broke: {exc}") from exc

    def exit_status(self) -> int | None:
        status = self._process.exit_status
        return status if status is not None and status >= 0 else None

    def stderr_tail(self) -> str:
        return b"".join(self._stderr).decode("utf-8", "replace")[-4096:]

    async def close(self) -> None:
        self._process.close()
        with contextlib.suppress(asyncssh.Error, OSError, TimeoutError):
            await asyncio.wait_for(self._process.wait_closed(), timeout=2.0)
        self._stderr_task.cancel()
        try:
            await self._stderr_task
        except asyncio.CancelledError:
            # the drain's, not ours: a cancel of this task (a collector stopping) goes on up
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise


class SshTransport:
    """One SSH connection to one host; reconnects on the next call after the connection is lost.

    A port forward is this side's own listener: each connection accepted on it opens a channel on
    the live SSH connection (made again if lost), so a forward outlives any number of reconnects
    on the same local port. (asyncssh's listener died with its connection, and nothing re-made it
    unless another call happened to reconnect: a capture lost a host's agent for the whole run.)
    """

    python = "python3"

    def __init__(self, options: SshOptions, *, name: str | None = None) -> None:
        self.options = options
        self.host = name or options.host
        self._conn: asyncssh.SSHClientConnection | None = None
        self._lost = asyncio.Event()
        self._lock = asyncio.Lock()
        self._forwards: list[asyncio.Server] = []
        self._pipes: set[asyncio.Task[None]] = set()
        self.connects = 0  # how many times a connection was made (reconnects show here)

    async def connection(self) -> asyncssh.SSHClientConnection:
        """The live connection, made (again) if there is none."""
        if self._conn is not None and not self._lost.is_set():
            return self._conn
        async with self._lock:
            if self._conn is None or self._lost.is_set():
                await self._reconnect()
            assert self._conn is not None
            return self._conn

    async def _reconnect(self) -> None:
        if self._conn is not None:
            self._conn.abort()
            self._conn = None
        opts = self.options
        known = _read_known_hosts(opts)
        had_keys = _lists_host(known, opts.host, opts.host, opts.port)
        lost = asyncio.Event()
        client = _Client(opts, known, lost)
        kwargs: dict[str, object] = dict(opts.extra)
        if opts.identity_files:
            kwargs["client_keys"] = [str(Path(p).expanduser()) for p in opts.identity_files]
        try:
            conn, _ = await asyncio.wait_for(
                asyncssh.create_connection(
                    lambda: client, opts.host, port=opts.port, username=opts.username,
                    known_hosts=known if known is not None else ([], [], []),
                    keepalive_interval=opts.keepalive_interval_s,
                    keepalive_count_max=opts.keepalive_count_max, **kwargs,
                ),
                timeout=opts.connect_timeout_s,
            )
        except asyncssh.HostKeyNotVerifiable as exc:
            raise HostKeyError(client.refusal or f"{opts.host_pattern}: host key refused: {exc}") from exc
        except asyncssh.KeyExchangeFailed as exc:
            if had_keys:
                raise HostKeyError(
                    f"{opts.host_pattern}: the server offers none of the host key types listed for it in "
                    f"{opts.known_hosts} (was the host reinstalled? `ssh-keygen -R '{opts.host_pattern}' "
                    f"-f {opts.known_hosts}`): {exc}"
                ) from exc
            raise TransportError(f"{opts.host_pattern}: SSH key exchange failed: {exc}") from exc
        except asyncssh.PermissionDenied as exc:
            raise TransportError(f"{opts.host_pattern}: SSH authentication failed: {exc}") from exc
        except (asyncssh.Error, OSError) as exc:
            raise TransportError(f"{opts.host_pattern}: cannot connect over SSH: {exc}") from exc
        except TimeoutError as exc:
            raise TransportError(
                f"{opts.host_pattern}: SSH connection timed out after {opts.connect_timeout_s:g} s"
            ) from exc
        self._conn, self._lost = conn, lost
        self.connects += 1
        if self.connects > 1:
            log.info("ssh_reconnected", host=self.host, connects=self.connects)

    def _channel_error(self, exc: BaseException) -> TransportError:
        # A refused channel (e.g. the server's MaxSessions) leaves the connection and its other
        # channels alive; only a dead connection is dropped (asyncssh also reports it via connection_lost).
        if isinstance(exc, asyncssh.DisconnectError | ConnectionError):
            self._lost.set()
        return TransportError(f"{self.host}: SSH channel failed: {exc}")

    async def run(self, argv: Sequence[str], *, timeout_s: float = 30.0,
                  stdin: bytes | None = None) -> CommandResult:
        conn = await self.connection()
        try:
            result = await conn.run(shell_command(argv), check=False, encoding=None,
                                    input=stdin, timeout=timeout_s)
        except asyncssh.TimeoutError as exc:
            raise TransportError(f"{self.host}: {argv[0]!r} did not finish within {timeout_s:g} s") from exc
        except (asyncssh.Error, OSError) as exc:
            raise self._channel_error(exc) from exc
        out = result.stdout if isinstance(result.stdout, bytes) else b""
        err = result.stderr if isinstance(result.stderr, bytes) else b""
        status = result.exit_status
        return CommandResult(status if status is not None and status >= 0 else None, out, err)

    async def open_stream(self, argv: Sequence[str], *, watchdog: bool = True,
                          merge_stderr: bool = False) -> SshStream:
        if watchdog:
            argv = watched_argv(argv, merge_stderr=merge_stderr)
        conn = await self.connection()
        try:
            process = await conn.create_process(shell_command(argv), encoding=None)
        except (asyncssh.Error, OSError) as exc:
            raise self._channel_error(exc) from exc
        return SshStream(self.host, process)

    async def forward_local_port(self, remote_host: str, remote_port: int) -> int:
        await self.connection()  # an unreachable host fails here, not at the first use

        def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            # its own task, so that close() cancels the piping, not asyncio's accept callback
            pipe = asyncio.create_task(self._pipe_through_channel(reader, writer, remote_host, remote_port))
            self._pipes.add(pipe)
            pipe.add_done_callback(self._pipes.discard)

        try:
            server = await asyncio.start_server(accepted, "127.0.0.1", 0)
        except OSError as exc:
            raise TransportError(f"{self.host}: cannot listen on a local port for a forward: {exc}") from exc
        self._forwards.append(server)
        return int(server.sockets[0].getsockname()[1])

    async def _open_channel(self, remote_host: str, remote_port: int
                            ) -> tuple[asyncssh.SSHReader[bytes], asyncssh.SSHWriter[bytes]]:
        # One retry: a connection lost before asyncssh noticed fails the first channel.
        for attempt in (1, 2):
            conn = await self.connection()
            try:
                return await conn.open_connection(remote_host, remote_port, encoding=None)
            except asyncssh.ChannelOpenError as exc:  # the host refused this channel; the connection lives
                raise TransportError(f"{self.host}: forward to {remote_host}:{remote_port} refused: "
                                     f"{exc.reason}") from exc
            except (asyncssh.Error, OSError) as exc:
                error = self._channel_error(exc)
                if attempt == 2:
                    raise error from exc
        raise AssertionError("unreachable")

    async def _pipe_through_channel(self, local_r: asyncio.StreamReader, local_w: asyncio.StreamWriter,
                                    remote_host: str, remote_port: int) -> None:
        try:
            try:
                remote_r, remote_w = await self._open_channel(remote_host, remote_port)
            except TransportError as exc:
                log.warning("ssh_forward_failed", host=self.host, to=f"{remote_host}:{remote_port}",
                            error=str(exc))
                return
            try:
                await asyncio.gather(_copy(local_r, remote_w), _copy(remote_r, local_w))
            except (asyncssh.Error, OSError):
                pass  # either end went away: the other is closed below, as a TCP peer would see it
            finally:
                remote_w.close()
        finally:
            local_w.close()

    async def close(self) -> None:
        for server in self._forwards:
            server.close()
        self._forwards.clear()
        pipes, self._pipes = self._pipes, set()
        for pipe in pipes:
            pipe.cancel()
        await asyncio.gather(*pipes, return_exceptions=True)
        if self._conn is not None:
            self._conn.close()
            with contextlib.suppress(asyncssh.Error, OSError):
                await self._conn.wait_closed()
            self._conn = None


async def _copy(reader: asyncio.StreamReader | asyncssh.SSHReader[bytes],
                writer: asyncio.StreamWriter | asyncssh.SSHWriter[bytes]) -> None:
    """Bytes from one end of a forward to the other, then the end of the stream."""
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()


async def connect_ssh(options: SshOptions, *, name: str | None = None) -> SshTransport:
    """Connect now (so that a bad key or an unreachable host fails here) and return the transport."""
    if options.host_key_policy is HostKeyPolicy.INSECURE_SKIP:
        log.warning("ssh_host_key_check_disabled", host=options.host_pattern,
                    why="--insecure-skip-host-key-check: any host key is accepted")
    transport = SshTransport(options, name=name)
    await transport.connection()
    return transport
