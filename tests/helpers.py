"""Helpers the test modules share (one of each): a free loopback port, the CLI run in-process,
a run store analysed."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path

from click.testing import CliRunner, Result

from gputrace.analysis.result import Analysis, analyse_store
from gputrace.cli import cli as gputrace_cli
from gputrace.store import Store


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cli(args: Sequence[str]) -> Result:
    """`gputrace ARGS` run in-process by click's runner (exit code, output, exception)."""
    return CliRunner().invoke(gputrace_cli, list(args))


def analyse(run: Path | str) -> Analysis:
    """The run store at ``run`` read and analysed (no what-if effects: ``analyse_run`` adds them)."""
    with Store.open(run, read_only=True) as store:
        return analyse_store(store)
