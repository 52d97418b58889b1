"""Test hosts on this one machine: each its own real OpenSSH sshd on its own loopback address
(127.0.0.2, 127.0.0.3, ...: Linux routes all of 127/8 to lo, so binding needs no set-up), its own
directory for its engine log and GPU feed, and its own clock: every process of the host (every
session sshd starts: the collector's clock probe and log follower; the agent; the simulator node
writing the log) runs under libfaketime with the host's offset, so the skew is real to every
program that reads the wall clock. The sshd listener itself does not (its sessions get the library
through SetEnv): libfaketime rereads its offset file every CLOCK_RELOAD_S, and when that fell in
sshd's seccomp-sandboxed pre-authentication child, the sandbox killed it (SIGSYS, "preauth child
terminated by signal 31" in sshd.log) and the client's connection dropped: ~1 connection in 10
on a busy machine (CI, stop 31, twice). libfaketime fakes the monotonic clock too (it reads as the faked
wall clock; it still only moves forward at the real rate, which is all asyncio needs):
DONT_FAKE_MONOTONIC=1 would keep it, but libfaketime 0.9.10 then fails Python's time.sleep with
EINVAL (its clock_nanosleep wrapper mixes the clocks).

Use the ``test_hosts`` fixture (conftest) or ``running_test_hosts``; ``TestHost.spawn`` starts a
process of the host under its clock; ``gputrace_argv`` is how to run gputrace there.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sshd import SshServer, running_sshd

LIBFAKETIME_CANDIDATES = ("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
                          "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
                          "/usr/lib/faketime/libfaketime.so.1")
FIRST_ADDRESS = 2  # 127.0.0.2: 127.0.0.1 stays the collector's


def libfaketime() -> str | None:
    return next((p for p in LIBFAKETIME_CANDIDATES if Path(p).exists()), None)


CLOCK_RELOAD_S = 1  # how often each process of a host rereads its clock's offset (set_offset)


def faketime_env(spec_file: Path, library: str) -> dict[str, str]:
    """What puts a process (and its children) off the real wall clock by the offset written in
    ``spec_file`` (libfaketime's syntax, ``+2.5s``), reread every CLOCK_RELOAD_S."""
    return {"LD_PRELOAD": library, "FAKETIME_TIMESTAMP_FILE": str(spec_file),
            "FAKETIME_CACHE_DURATION": str(CLOCK_RELOAD_S)}


def write_offset(spec_file: Path, offset_s: float) -> None:
    tmp = spec_file.with_suffix(".tmp")
    tmp.write_text(f"{offset_s:+.6f}s\n")
    tmp.replace(spec_file)  # a process rereading it never sees half a line


def gputrace_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "gputrace", *args]


@dataclass
class TestHost:
    """One test host: its name, loopback address, clock offset, sshd and working directory."""

    __test__ = False  # not a test class, whatever pytest thinks of the name

    name: str
    address: str
    offset_s: float
    root: Path
    sshd: SshServer
    env: dict[str, str]  # the faketime variables every process of this host gets
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    # (real time.time_ns() when set, offset_s): the host's clock history, for set_offset
    offsets: list[tuple[int, float]] = field(default_factory=list)

    def set_offset(self, offset_s: float) -> None:
        """Step this host's clock to ``offset_s`` off the real one: every process of the host
        (running ones too) follows within CLOCK_RELOAD_S."""
        write_offset(self.root / "faketime", offset_s)
        self.offset_s = offset_s
        self.offsets.append((time.time_ns(), offset_s))

    def offset_at(self, real_ns: int) -> float | None:
        """The offset set at real time ``real_ns``; None within CLOCK_RELOAD_S after a change
        (processes of the host disagree then)."""
        current = None
        for since_ns, offset_s in self.offsets:
            if real_ns < since_ns:
                break
            if real_ns < since_ns + (CLOCK_RELOAD_S + 0.5) * 1e9 and current is not None:
                return None
            current = offset_s
        return current

    @property
    def log_path(self) -> Path:
        return self.root / "sglang.log"

    @property
    def feed_path(self) -> Path:
        return self.root / "gpu-feed.ndjson"

    def spawn(self, argv: Sequence[str], name: str) -> subprocess.Popen[bytes]:
        """Start ``argv`` as a process of this host (under its clock); output to ``root/name.out``."""
        with open(self.root / f"{name}.out", "ab") as out:
            proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, **self.env}, start_new_session=True)
        self.procs.append(proc)
        return proc

    def spawn_agent(self, port: int, *, interval_s: float = 0.1, topology: str | None = None,
                    feed: bool = True, gpus: int = 8) -> subprocess.Popen[bytes]:
        """The sim-backend agent of this host, on its address: serving the simulator node's feed, or
        (``feed=False``) ``gpus`` GPUs of the simulated backend's own pattern."""
        source = ["--sim-feed", str(self.feed_path)] if feed else ["--sim-gpus", str(gpus)]
        args = ["agent", "--backend", "sim", *source, "--listen", f"{self.address}:{port}",
                "--interval", str(interval_s), "--host-name", self.name]
        return self.spawn(gputrace_argv(*args, *(["--topology", topology] if topology else [])), "agent")

    def host_toml(self, *, agent_port: int | None, node_rank: int = 0, log: bool = True) -> str:
        """This host's [[hosts]] table for a gputrace.toml (reached over its sshd)."""
        text = (f'[[hosts]]\nname = "{self.name}"\nssh = "root@{self.address}:{self.sshd.port}"\n'
                f"identity_file = {json.dumps(str(self.sshd.client_key_path))}\n"
                f"known_hosts = {json.dumps(str(self.sshd.known_hosts_path))}\n"
                f"node_rank = {node_rank}\n")
        if agent_port is not None:
            text += f'agent = "{self.address}:{agent_port}"\n'
        if log:
            text += f'\n[hosts.log]\nkind = "file"\npath = {json.dumps(str(self.log_path))}\n'
        return text + "\n"

    def restart_sshd(self) -> None:
        """Kill this host's sshd (the listener and every session: each SSH connection drops) and
        start it again on the same address, port and host key."""
        self.sshd.stop()
        try:
            self.sshd.restart()  # the same argv: its listener runs without libfaketime
        except RuntimeError:
            raise RuntimeError(
                f"{self.name}: sshd did not come back on {self.address}:{self.sshd.port}") from None

    def stop(self) -> None:
        """SIGTERM every process this host started (their whole session), SIGKILL what stays."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@contextlib.contextmanager
def running_test_hosts(root: Path, offsets_s: Sequence[float], *, library: str,
                       sshd: str = "/usr/sbin/sshd") -> Iterator[list[TestHost]]:
    """len(offsets_s) test hosts ``node0``.. on 127.0.0.2.. with those clock offsets (seconds)."""
    if len(offsets_s) > 250:
        raise ValueError("at most 250 test hosts (127.0.0.2 .. 127.0.0.251)")
    hosts: list[TestHost] = []
    with contextlib.ExitStack() as stack:
        for i, offset_s in enumerate(offsets_s):
            host_root = root / f"node{i}"
            host_root.mkdir(parents=True)
            write_offset(host_root / "faketime", offset_s)
            env = faketime_env(host_root / "faketime", library)
            server = stack.enter_context(running_sshd(
                host_root, sshd, address=f"127.0.0.{FIRST_ADDRESS + i}", session_env=env))
            host = TestHost(f"node{i}", server.address, offset_s, host_root, server, env,
                            offsets=[(0, offset_s)])
            stack.callback(host.stop)
            hosts.append(host)
        yield hosts
