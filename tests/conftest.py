"""Shared fixtures. System binaries (sshd, prometheus, chromium, tmux) are real: a test that needs
one skips with the reason when it is missing, unless GPUTRACE_REQUIRE_SYSTEM_TESTS=1 (CI), where
a missing binary fails the test instead."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


def require_binary(*candidates: str) -> str:
    """The path of the first binary found; skip (or fail under CI) when none is installed."""
    for name in candidates:
        found = shutil.which(name) or (name if os.path.isabs(name) and os.access(name, os.X_OK) else None)
        if found:
            return found
    reason = f"needs {' or '.join(candidates)} (install it: see .ci/run)"
    if os.environ.get("GPUTRACE_REQUIRE_SYSTEM_TESTS") == "1":
        pytest.fail(reason + "; GPUTRACE_REQUIRE_SYSTEM_TESTS=1 makes this a failure")
    pytest.skip(reason)
    raise AssertionError("unreachable")


def shared_data(relative: str) -> Path:
    """A file of the team's shared data (``shared/data/...``): the checkout's sibling ``shared/``
    when present (the freshest), else /work/shared, else the verbatim copy in tests/data/shared/."""
    here = Path(__file__).resolve().parent
    for root in (here.parents[1] / "shared" / "data", Path("/work/shared/data"), here / "data" / "shared"):
        if (root / relative).is_file():
            return root / relative
    raise FileNotFoundError(f"shared data {relative} not found")
