"""The transport seam: run commands and stream their output on one host, locally or over SSH.

Commands are argv lists; a transport that hands them to a shell quotes every word with
``shlex.quote`` (``shell_command``), so a path or unit name is never interpreted by the shell.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

# Runs "$@" with stdin from /dev/null and its own copy of the channel's stdin read by a watchdog:
# when the channel closes (the collector stops, the SSH session dies, sshd is killed) the watchdog
# sees EOF and kills the whole process group, so no `tail`/`journalctl` is left behind on the host.
# sshd makes each session its own process group (setsid); the local transport does the same.
_WATCHDOG_SH = (
    'exec 3<&0; { cat <&3 >/dev/null 2>&1; kill -TERM 0; } >/dev/null 2>&1 </dev/null & '
    'exec 3<&-; exec "$@" </dev/null'
)
_WATCHDOG_MERGED_SH = (
    'exec 3<&0; { cat <&3 >/dev/null 2>&1; kill -TERM 0; } >/dev/null 2>&1 </dev/null & '
    'exec 3<&-; exec "$@" </dev/null 2>&1'
)


def shell_command(argv: Sequence[str]) -> str:
    """One shell command line that runs exactly ``argv`` (every word quoted)."""
    if not argv:
        raise ValueError("empty command")
    return " ".join(shlex.quote(word) for word in argv)


def watched_argv(argv: Sequence[str], *, merge_stderr: bool = False) -> list[str]:
    """``argv`` wrapped so that it ends (with its children) when its stdin channel closes."""
    script = _WATCHDOG_MERGED_SH if merge_stderr else _WATCHDOG_SH
    return ["sh", "-c", script, "gputrace-watchdog", *argv]


@dataclass(frozen=True, slots=True)
class CommandResult:
    """What a finished command returned; ``exit_status`` is None when it was killed by a signal."""

    exit_status: int | None
    stdout: bytes
    stderr: bytes

    @property
    def ok(self) -> bool:
        return self.exit_status == 0


class StreamedCommand(Protocol):
    """A long-running command whose stdout is read as it comes."""

    async def read(self, max_bytes: int = 65536) -> bytes:
        """The next bytes of stdout; ``b""`` once stdout has ended (or the channel closed)."""
        ...

    async def write(self, data: bytes) -> None:
        """Send bytes to the command's stdin (only for streams opened with ``watchdog=False``)."""
        ...

    def exit_status(self) -> int | None:
        """The exit status once known; None while running, or when the channel was lost."""
        ...

    def stderr_tail(self) -> str:
        """The last few KiB the command wrote to stderr, for error messages."""
        ...

    async def close(self) -> None:
        """Close the channel; the command and its children end on the host."""
        ...


class Transport(Protocol):
    """Runs commands on one host. ``host`` names it in records and messages."""

    host: str
    python: str  # the Python interpreter on that host, for the small helper scripts

    async def run(self, argv: Sequence[str], *, timeout_s: float = 30.0,
                  stdin: bytes | None = None) -> CommandResult:
        """Run ``argv`` to completion; raises TransportError when the host cannot be reached."""
        ...

    async def open_stream(self, argv: Sequence[str], *, watchdog: bool = True,
                          merge_stderr: bool = False) -> StreamedCommand:
        """Start ``argv`` and stream its stdout. With ``watchdog`` it ends when the stream closes."""
        ...

    async def forward_local_port(self, remote_host: str, remote_port: int) -> int:
        """A port on this machine's loopback that reaches ``remote_host:remote_port`` as seen
        from the host (e.g. the agent on the host's own loopback)."""
        ...

    async def close(self) -> None:
        """Close every channel, forward and the connection."""
        ...
