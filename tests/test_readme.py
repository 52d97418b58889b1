"""The README's guide is run as written: every block fenced as ```sh runnable is executed, each in
a fresh bash (errexit) in a scratch directory holding the clone's examples/, with this Python's
gputrace first on PATH. The guide's default ports (30000 the engine, 9401 the collector, 9402 the
agent) are swapped for free ones so the test runs beside other captures on the machine."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
_BLOCK = re.compile(r"^```sh runnable\n(.*?)^```$", re.M | re.S)
DEFAULT_PORTS = ("30000", "9401", "9402")
TIMEOUT_S = 600  # the quick demo: about 80 s on an idle machine, three minutes on a busy 2-core one


def runnable_blocks(text: str) -> list[str]:
    """The ```sh runnable blocks of a Markdown text, in order."""
    return [m.group(1) for m in _BLOCK.finditer(text)]


def test_the_readme_has_runnable_blocks_for_the_guide() -> None:
    """The guide's demo, its live capture against `gputrace sim serve` and the config checks are
    marked runnable (a block that lost its marker would silently stop being tested)."""
    blocks = runnable_blocks(README.read_text())
    joined = "\n".join(blocks)
    assert len(blocks) >= 3
    for command in ("gputrace demo --quick", "gputrace sim serve", "gputrace run --config",
                    "gputrace check-config examples/gputrace-multinode.toml"):
        assert command in joined, command


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(runnable_blocks(README.read_text()))))
def test_readme_block_runs(index: int, tmp_path: Path) -> None:
    """Block ``index`` exits 0; its background processes are ended with it."""
    block = runnable_blocks(README.read_text())[index]
    for port in DEFAULT_PORTS:
        block = re.sub(rf"(?<![\d.]){port}(?!\d)", str(free_port()), block)
    (tmp_path / "examples").symlink_to(REPO / "examples")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(["bash", "-e", "-c", block], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        # what the block left running in the background (it should have ended it itself)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"README block {index} failed:\n{block}\n--- output ---\n{out[-4000:]}"
