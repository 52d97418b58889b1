"""Helpers the test modules share (one of each): a free loopback port, the CLI run in-process or
as its own process, a run store analysed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from click.testing import CliRunner, Result

from gputrace.analysis.result import Analysis, analyse_store
from gputrace.cli import cli as gputrace_cli
from gputrace.store import Store


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port on ``address`` that nothing listens on now (the OS picks it; a test host's sshd
    may hold one that 127.0.0.1 has free, so a test host's own address is asked)."""
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def cli(args: Sequence[str]) -> Result:
    """`gputrace ARGS` run in-process by click's runner (exit code, output, exception)."""
    return CliRunner().invoke(gputrace_cli, list(args))


def gputrace_process(*args: str, timeout_s: float = 120, env: dict[str, str] | None = None,
                     cwd: Path | None = None, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """`gputrace ARGS` as its own process, as a user runs it (for what in-process cannot show: the
    console entry point, exit statuses through the interpreter, stdin, extra environment)."""
    return subprocess.run([sys.executable, "-m", "gputrace", *args], capture_output=True, text=True,
                          input=stdin, timeout=timeout_s, env={**os.environ, **env} if env else None,
                          cwd=cwd)


def analyse(run: Path | str) -> Analysis:
    """The run store at ``run`` read and analysed (no what-if effects: ``analyse_run`` adds them)."""
    with Store.open(run, read_only=True) as store:
        return analyse_store(store)
