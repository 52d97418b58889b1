"""A real OpenSSH sshd on 127.0.0.1 for tests (and benches): random port, temporary host key,
authorized_keys and config; a client key and a known_hosts file that trusts the host key.

Use the ``sshd_server`` fixture (module scope: one server per test module; import
``sshd_server_fixture`` into the test module to register it) or ``running_sshd``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncssh
import pytest
from helpers import free_port

from gputrace.remote.ssh import HostKeyPolicy, SshOptions

SSHD_CANDIDATES = ("/usr/sbin/sshd", "sshd")


@dataclass
class SshServer:
    """A running sshd and what a client needs to reach it."""

    proc: subprocess.Popen[bytes]
    port: int
    root: Path
    host_key_path: Path
    client_key_path: Path
    known_hosts_path: Path
    address: str = "127.0.0.1"

    def options(self, *, known_hosts: Path | None = None,
                policy: HostKeyPolicy = HostKeyPolicy.VERIFY) -> SshOptions:
        """Client options for this server (as root, with the test client key)."""
        return SshOptions(
            host=self.address, port=self.port, username="root",
            identity_files=(str(self.client_key_path),),
            known_hosts_path=str(known_hosts or self.known_hosts_path), host_key_policy=policy,
            keepalive_interval_s=2.0, connect_timeout_s=10.0,
            extra={"agent_path": None, "config": ()},
        )

    def host_key_line(self) -> str:
        """The known_hosts line that trusts this server's host key."""
        key = Path(str(self.host_key_path) + ".pub").read_text().split()
        return f"[{self.address}]:{self.port} {key[0]} {key[1]}\n"

    def session_pids(self) -> list[int]:
        """The sshd processes serving connections (the children of the listener, and theirs)."""
        return [pid for pid in _descendants(self.proc.pid) if _is_sshd(pid)]

    def kill_sessions(self) -> int:
        """SIGKILL every sshd process serving a connection; the listener keeps listening."""
        pids = self.session_pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def kill(self) -> None:
        """SIGKILL sshd, the listener and every session (an outage: nothing answers on the port)."""
        self.kill_sessions()
        self.proc.kill()
        self.proc.wait()
        if self.proc.stderr is not None:  # restart() starts another with its own pipe
            self.proc.stderr.close()

    def restart(self, timeout_s: float = 10.0) -> None:
        """Start sshd again on the same port, keys and config (after ``kill``)."""
        argv = [str(a) for a in self.proc.args]  # type: ignore[union-attr]
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE)
        if not wait_listening(self.port, self.proc, timeout_s, address=self.address):
            raise RuntimeError("sshd did not start again")

    def stop(self) -> None:
        self.kill_sessions()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stderr is not None:  # the pipe kept for a failed start's message
            self.proc.stderr.close()


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _is_sshd(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sshd")
    except OSError:
        return False


def processes_matching(marker: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process whose command line contains ``marker``."""
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                "utf-8", "replace")
        except OSError:
            continue
        if marker in cmdline:
            found.append((int(entry), cmdline))
    return found


def wait_no_processes(marker: str, timeout_s: float = 5.0) -> list[tuple[int, str]]:
    """Wait until no process mentions ``marker``; returns those still left at the timeout."""
    deadline = time.monotonic() + timeout_s
    while (left := processes_matching(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def write_key(path: Path, alg: str = "ssh-ed25519") -> Path:
    key = asyncssh.generate_private_key(alg)
    key.write_private_key(str(path))
    key.write_public_key(str(path) + ".pub")
    path.chmod(0o600)
    return path


@contextlib.contextmanager
def running_sshd(root: Path, sshd: str = "/usr/sbin/sshd", *, address: str = "127.0.0.1",
                 env: dict[str, str] | None = None,
                 session_env: dict[str, str] | None = None) -> Iterator[SshServer]:
    """Start sshd under ``root`` (a temporary directory) on ``address`` (a loopback address) and
    stop it afterwards. ``env``: the listener's environment; ``session_env``: set in every session
    (sshd builds a session's environment afresh, so a preloaded library must be named here too)."""
    root.mkdir(parents=True, exist_ok=True)
    host_key = write_key(root / "host_ed25519")
    client_key = write_key(root / "client_ed25519")
    authorized = root / "authorized_keys"
    authorized.write_text(Path(str(client_key) + ".pub").read_text())
    # sshd refuses to start without its privilege-separation directory.
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    failed = ""
    for _attempt in range(5):
        port = free_port(address)
        set_env = " ".join(f'"{k}={v}"' for k, v in (session_env or {}).items())
        config = root / "sshd_config"
        listen_address = f"[{address}]" if ":" in address else address
        config.write_text(
            (f"SetEnv {set_env}\n" if set_env else "")
            + f"ListenAddress {listen_address}:{port}\nHostKey {host_key}\nPidFile {root / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {authorized}\nUsePAM no\nStrictModes no\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nAllowTcpForwarding yes\nX11Forwarding no\n"
            "PrintMotd no\nMaxSessions 100\nMaxStartups 100\nLogLevel VERBOSE\n"
        )
        # -E: sshd's own account of each connection, kept for a test that sees one dropped
        proc = subprocess.Popen([sshd, "-D", "-E", str(root / "sshd.log"), "-f", str(config)],
                                stderr=subprocess.PIPE,
                                env=env)
        if wait_listening(port, proc, address=address):
            known = root / "known_hosts"
            server = SshServer(proc, port, root, host_key, client_key, known, address)
            known.write_text(server.host_key_line())
            try:
                yield server
            finally:
                server.stop()
            return
        proc.kill()
        proc.wait()
        if proc.stderr is not None:
            log = root / "sshd.log"
            failed = proc.stderr.read().decode() + (log.read_text()[-2000:] if log.exists() else "")
            proc.stderr.close()
    raise RuntimeError("sshd did not start: " + failed)


def wait_listening(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 10.0,
                    address: str = "127.0.0.1") -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as sock:
            if sock.connect_ex((address, port)) == 0:
                return True
        time.sleep(0.02)
    return False


@pytest.fixture(scope="module", name="sshd_server")
def sshd_server_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshServer]:
    """A real sshd for the test module (skips when sshd is not installed)."""
    from conftest import require_binary

    sshd = require_binary(*SSHD_CANDIDATES)
    with running_sshd(tmp_path_factory.mktemp("sshd"), sshd) as server:
        yield server
