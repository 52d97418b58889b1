"""Helpers the test modules share (one of each): a free loopback port, the CLI run in-process or
as its own process, a run store analysed."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from click.testing import CliRunner, Result

from gputrace.analyse import analyse_run
from gputrace.analysis.result import Analysis
from gputrace.cli import cli as gputrace_cli
from gputrace.store import Store


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port on ``address`` that nothing listens on now (the OS picks it; a test host's sshd
    may hold one that 127.0.0.1 has free, so a test host's own address is asked)."""
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def open_paths() -> set[str]:
    """The paths this process holds open now (Linux: its /proc/self/fd links)."""
    fds = Path("/proc/self/fd")
    paths = set()
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):  # the listing's own fd is gone by now
            paths.add(os.readlink(fd))
    return paths


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
        return analyse_run(store, effects=False)


REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
_RUNNABLE_BLOCK = re.compile(r"^```sh runnable\n(.*?)^```$", re.M | re.S)
# the guide's default ports: the engine, the collector, the agent
README_DEFAULT_PORTS = ("30000", "9401", "9402")


def guide_documents() -> list[Path]:
    """The README (the guide) and the reference pages in docs/, in the order they are read."""
    return [README, *sorted(DOCS.glob("*.md"))]


def readme_block_sources() -> list[tuple[Path, str]]:
    """(document, block) for every ```sh runnable block of the README and of docs/*.md, in order."""
    return [(doc, m.group(1)) for doc in guide_documents()
            for m in _RUNNABLE_BLOCK.finditer(doc.read_text())]


def readme_blocks() -> list[str]:
    """The ```sh runnable blocks of the README and docs/, in order."""
    return [block for _, block in readme_block_sources()]


def run_readme_block(block: str, cwd: Path, timeout_s: float) -> tuple[int, str]:
    """A README block as written, in a fresh bash (errexit) in ``cwd`` holding the clone's
    examples/, with this Python's gputrace first on PATH and the guide's default ports swapped
    for free ones (the test runs beside other captures); what it left running in the background
    is ended with it. Its exit status and output."""
    for port in README_DEFAULT_PORTS:
        block = re.sub(rf"(?<![\d.]){port}(?!\d)", str(free_port()), block)
    (cwd / "examples").symlink_to(REPO / "examples")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(["bash", "-e", "-c", block], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out


def json_strings(obj: object) -> list[str]:
    """Every string value of a JSON document (its keys are the schema, the same for every engine)."""
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in json_strings(v)]
    if isinstance(obj, list):
        return [s for v in obj for s in json_strings(v)]
    return []
