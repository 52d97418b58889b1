"""Shared fixtures. System binaries (sshd, prometheus, chromium, tmux) are real: a test that needs
one skips with the reason when it is missing, unless GPUTRACE_REQUIRE_SYSTEM_TESTS=1 (CI), where
a missing binary fails the test instead."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from testhosts import TestHost, libfaketime


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


class SmallDisk:
    """A real filesystem of a few MiB (tmpfs) that a test fills up and frees again."""

    def __init__(self, root: Path):
        self.root = root
        self.filler = root / "filler"

    def fill(self) -> None:
        """Write the filler until the filesystem refuses another byte (ENOSPC)."""
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            for size in (1 << 16, 1 << 10, 1):  # then what is left under a block, to the last byte
                with contextlib.suppress(OSError):
                    while os.write(fd, b"\0" * size):
                        pass
        finally:
            os.close(fd)

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[SmallDisk]:
    """An 8 MiB tmpfs mounted for the test (skipped where mounting is not permitted: not root, or
    a container without CAP_SYS_ADMIN)."""
    root = tmp_path / "small-disk"
    root.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(root)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here to fill a disk: {mounted.stderr.strip() or 'not root'}")
    try:
        yield SmallDisk(root)
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True)


@pytest.fixture
def test_hosts(tmp_path: Path) -> Iterator[Callable[[Sequence[float]], list[TestHost]]]:
    """Call with clock offsets in seconds: that many test hosts (testhosts.py), each its own sshd on
    127.0.0.2.., its own directory and, under libfaketime, its own clock; all stopped afterwards."""
    from testhosts import running_test_hosts

    sshd = require_binary("/usr/sbin/sshd", "sshd")
    require_binary("faketime")  # the package that brings libfaketime.so.1
    library = libfaketime()
    if library is None:
        pytest.fail("faketime is installed but libfaketime.so.1 was not found")
    with contextlib.ExitStack() as stack:
        made = 0

        def make(offsets_s: Sequence[float]) -> list[TestHost]:
            nonlocal made
            root = tmp_path / f"hosts{made}"
            made += 1
            root.mkdir()
            return stack.enter_context(running_test_hosts(root, offsets_s, library=library, sshd=sshd))

        yield make


@pytest.fixture(scope="session")
def motivating_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The motivating deployment (SGLang PP8, max_running_requests 64) simulated in virtual time,
    seed 0, as a run store: read-only for the tests that share it."""
    from gputrace.sim.outputs import write_store
    from gputrace.sim.virtual import run_scenario

    out = tmp_path_factory.mktemp("motivating") / "run"
    write_store(run_scenario("motivating", 0), out)
    return out


# GPUTRACE_TEST_CPU_LOG=FILE: each test's CPU seconds (its process and the children it waited for,
# setup to teardown) appended to FILE as "nodeid<TAB>cpu_s<TAB>wall_s" lines, to find where the
# suite's CPU goes (its parallel pass is CPU-bound on a 2-core machine).
_CPU_LOG = os.environ.get("GPUTRACE_TEST_CPU_LOG")


def _cpu_s() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


if _CPU_LOG:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
        import time

        cpu0, wall0 = _cpu_s(), time.monotonic()
        yield
        with open(_CPU_LOG, "a") as log:
            log.write(f"{item.nodeid}\t{_cpu_s() - cpu0:.2f}\t{time.monotonic() - wall0:.2f}\n")
