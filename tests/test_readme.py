"""The README's guide and the reference in docs/ are run as written: every block fenced as
```sh runnable in README.md or docs/*.md is executed, each in a fresh bash (errexit) in a scratch
directory holding the clone's examples/, with this Python's gputrace first on PATH. The guide's
default ports (30000 the engine, 9401 the collector, 9402 the agent) are swapped for free ones so
the test runs beside other captures on the machine. The quick demo's block is run by
tests/test_demo.py, which checks what it wrote (one demo run, not two)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import DOCS, README, REPO, readme_block_sources, readme_blocks, run_readme_block

TIMEOUT_S = 600  # the live capture: about a minute on an idle machine
DEMO = "gputrace demo --quick"
GUIDE_MAX_LINES = 300


def test_the_readme_has_runnable_blocks_for_the_guide() -> None:
    """The guide's demo, its live capture against `gputrace sim serve` and the config checks are
    marked runnable (a block that lost its marker would silently stop being tested)."""
    guide = [block for doc, block in readme_block_sources() if doc == README]
    joined = "\n".join(guide)
    assert len(guide) >= 3
    for command in (DEMO, "gputrace sim serve", "gputrace run --config",
                    "gputrace check-config examples/gputrace-multinode.toml"):
        assert command in joined, command
    assert sum(DEMO in b for b in readme_blocks()) == 1  # the one tests/test_demo.py runs


def test_the_readme_is_a_guide_and_links_every_reference_page() -> None:
    """[ux] The README stays a guide (under 300 lines) and links each page of docs/; every link
    between the documents points at a file that is there."""
    lines = README.read_text().splitlines()
    assert len(lines) < GUIDE_MAX_LINES, len(lines)
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    assert len(pages) >= 5, pages
    text = README.read_text()
    for page in pages:
        assert f"(docs/{page})" in text, f"README does not link docs/{page}"
    for doc in [README, *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.relative_to(REPO)} links {target}, absent"


def test_the_reference_has_a_runnable_block() -> None:
    """docs/ is run too: at least one of its blocks is marked runnable (so the test reads it)."""
    assert any(doc.parent == DOCS for doc, _ in readme_block_sources())


def _block_id(i: int) -> str:
    doc, _ = readme_block_sources()[i]
    return f"{doc.relative_to(REPO)}:{i}"


@pytest.mark.slow
@pytest.mark.parametrize("index", [i for i, b in enumerate(readme_blocks()) if DEMO not in b], ids=_block_id)
def test_readme_block_runs(index: int, tmp_path: Path) -> None:
    """Block ``index`` exits 0; its background processes are ended with it."""
    doc, block = readme_block_sources()[index]
    returncode, out = run_readme_block(block, tmp_path, TIMEOUT_S)
    assert returncode == 0, (f"{doc.relative_to(REPO)} block {index} failed:\n{block}\n"
                             f"--- output ---\n{out[-4000:]}")
