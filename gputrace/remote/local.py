"""The local transport: commands on this machine as asyncio subprocesses (no shell involved)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections import deque
from collections.abc import Sequence

from gputrace.errors import TransportError
from gputrace.remote.transport import CommandResult, watched_argv

_LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0"})


class LocalStream:
    """A subprocess in its own session; closing it ends the whole process group."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._proc = proc
        self._stderr: deque[bytes] = deque(maxlen=64)
        self._stderr_task = asyncio.create_task(self._drain_stderr())

    async def _drain_stderr(self) -> None:
        # Read stderr continuously so that a chatty command never blocks on a full pipe.
        if self._proc.stderr is None:
            return
        while chunk := await self._proc.stderr.read(4096):
            self._stderr.append(chunk)

    async def read(self, max_bytes: int = 65536) -> bytes:
        assert self._proc.stdout is not None
        return await self._proc.stdout.read(max_bytes)

    async def write(self, data: bytes) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(data)
            await self._proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise TransportError(f"local: the command's stdin closed: {exc}") from exc

    def exit_status(self) -> int | None:
        code = self._proc.returncode
        return code if code is not None and code >= 0 else None

    def stderr_tail(self) -> str:
        return b"".join(self._stderr).decode("utf-8", "replace")[-4096:]

    @property
    def running(self) -> bool:
        return self._proc.returncode is None

    async def close(self) -> None:
        if self._proc.stdin is not None and not self._proc.stdin.is_closing():
            self._proc.stdin.close()
        try:
            await asyncio.wait_for(self._proc.wait(), timeout=2.0)
        except TimeoutError:
            # The watchdog should have ended it; make sure, group and all.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            await self._proc.wait()
        try:
            await asyncio.wait_for(self._stderr_task, timeout=1.0)
        except (asyncio.CancelledError, TimeoutError):
            # the drain's own end is not ours to report; a cancel of this task is (it was
            # swallowed here: a collector asked to stop kept following, SIGTERM did nothing)
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise


def _kill_spawned(spawn: asyncio.Future[asyncio.subprocess.Process]) -> None:
    if not spawn.cancelled() and spawn.exception() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(spawn.result().pid, signal.SIGKILL)


class LocalTransport:
    """Runs commands on this machine; the same interface as the SSH transport."""

    def __init__(self, host: str = "localhost", *, python: str | None = None) -> None:
        self.host = host
        self.python = python or sys.executable
        self._streams: set[LocalStream] = set()

    async def run(self, argv: Sequence[str], *, timeout_s: float = 30.0,
                  stdin: bytes | None = None) -> CommandResult:
        proc = await self._spawn(argv)
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin), timeout=timeout_s)
        except TimeoutError as exc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise TransportError(f"{self.host}: {argv[0]!r} did not finish within {timeout_s:g} s") from exc
        code = proc.returncode
        return CommandResult(code if code is not None and code >= 0 else None, out, err)

    async def open_stream(self, argv: Sequence[str], *, watchdog: bool = True,
                          merge_stderr: bool = False) -> LocalStream:
        if watchdog:
            argv = watched_argv(argv, merge_stderr=merge_stderr)
        stream = LocalStream(await self._spawn(argv))
        self._streams = {s for s in self._streams if s.running}
        self._streams.add(stream)
        return stream

    async def _spawn(self, argv: Sequence[str]) -> asyncio.subprocess.Process:
        # Shielded: asyncio (3.11) cancelled while it starts a process can wait forever for that
        # process to exit (a collector stopped at start never ended); cancelled, the process is
        # left to start and then killed, group and all.
        spawn = asyncio.ensure_future(asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True,
        ))
        try:
            return await asyncio.shield(spawn)
        except OSError as exc:
            raise TransportError(f"{self.host}: cannot run {argv[0]!r}: {exc}") from exc
        except asyncio.CancelledError:
            spawn.add_done_callback(_kill_spawned)
            raise

    async def forward_local_port(self, remote_host: str, remote_port: int) -> int:
        # The "remote" host is this machine: its loopback is ours, no forward needed.
        if remote_host not in _LOOPBACK_NAMES:
            raise TransportError(
                f"{self.host}: the local transport reaches only loopback addresses, not {remote_host!r}"
            )
        return remote_port

    async def close(self) -> None:
        streams, self._streams = self._streams, set()
        for stream in streams:
            await stream.close()
