"""The README's guide is run as written: every block fenced as ```sh runnable is executed, each in
a fresh bash (errexit) in a scratch directory holding the clone's examples/, with this Python's
gputrace first on PATH. The guide's default ports (30000 the engine, 9401 the collector, 9402 the
agent) are swapped for free ones so the test runs beside other captures on the machine. The
quick demo's block is run by tests/test_demo.py, which checks what it wrote (one demo run, not two)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import readme_blocks, run_readme_block

TIMEOUT_S = 600  # the live capture: about a minute on an idle machine
DEMO = "gputrace demo --quick"


def test_the_readme_has_runnable_blocks_for_the_guide() -> None:
    """The guide's demo, its live capture against `gputrace sim serve` and the config checks are
    marked runnable (a block that lost its marker would silently stop being tested)."""
    blocks = readme_blocks()
    joined = "\n".join(blocks)
    assert len(blocks) >= 3
    for command in (DEMO, "gputrace sim serve", "gputrace run --config",
                    "gputrace check-config examples/gputrace-multinode.toml"):
        assert command in joined, command
    assert sum(DEMO in b for b in blocks) == 1  # the one tests/test_demo.py runs


@pytest.mark.slow
@pytest.mark.parametrize("index", [i for i, b in enumerate(readme_blocks()) if DEMO not in b])
def test_readme_block_runs(index: int, tmp_path: Path) -> None:
    """Block ``index`` exits 0; its background processes are ended with it."""
    block = readme_blocks()[index]
    returncode, out = run_readme_block(block, tmp_path, TIMEOUT_S)
    assert returncode == 0, f"README block {index} failed:\n{block}\n--- output ---\n{out[-4000:]}"
