"""[robust] #45: the loss classes of following a log through rotation, over a real sshd, rotated by
the real `logrotate` (copytruncate, create, compress) with a config written here. Each counted
against the lines written: nothing lost, nothing twice; where the file is gone, the gap recorded."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from live_chain import free_port, http_ok, wait_until
from sshd import SshServer, sshd_server_fixture  # noqa: F401
from test_remote_follow import Collector, log_line

from gputrace.config import LogSource
from gputrace.remote.follow import FollowGap
from gputrace.remote.ssh import connect_ssh
from gputrace.store import Store

pytestmark = pytest.mark.system


def logrotate(tmp_path: Path, log: Path, *directives: str) -> None:
    """Rotate ``log`` now with the real logrotate and a config holding ``directives``."""
    from conftest import require_binary

    binary = require_binary("logrotate", "/usr/sbin/logrotate")
    conf = tmp_path / "logrotate.conf"
    conf.write_text(f"{log} {{\n  rotate 5\n  missingok\n" + "".join(f"  {d}\n" for d in directives) + "}\n")
    conf.chmod(0o644)
    subprocess.run([binary, "--force", "--state", str(tmp_path / "logrotate.state"), str(conf)],
                   check=True, capture_output=True, timeout=60)


class Engine(threading.Thread):
    """Writes numbered lines to ``path`` every ``period_s`` (whole lines; ``lock`` held while it
    writes one, so a rotation taken under the lock cuts no line: what copytruncate loses between
    its copy and its truncation is no follower's to find). ``reopen()``: as an engine told to
    reopen its log (logrotate's postrotate)."""

    def __init__(self, path: Path, period_s: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.path, self.period_s = path, period_s
        self.written: list[str] = []
        self.lock = threading.RLock()
        self.stop_event = threading.Event()
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def burst(self, lines: int) -> None:
        with self.lock:
            start = len(self.written)
            batch = [log_line(i) for i in range(start, start + lines)]
            os.write(self.fd, "".join(f"{text}\n" for text in batch).encode())
            self.written += batch

    def reopen(self) -> None:
        with self.lock:
            os.close(self.fd)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.burst(1)
            time.sleep(self.period_s)


async def until(predicate: object, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:  # type: ignore[operator]
        await asyncio.sleep(0.02)


async def collect_all(collector: Collector, written: list[str], timeout_s: float = 60.0) -> None:
    """Wait until every line written arrived (or the timeout), then a little longer: none twice."""
    await until(lambda: len(collector.lines) >= len(written) or written[-1] in collector.texts[-1:],
                timeout_s)
    await asyncio.sleep(0.5)
    await collector.stop()


def lost_and_doubled(collector: Collector, written: list[str]) -> tuple[int, int]:
    got = collector.texts
    return len(set(written) - set(got)), len(got) - len(set(got))


async def test_two_copytruncates_during_one_outage_lose_nothing(sshd_server: SshServer,
                                                                tmp_path: Path) -> None:
    """Class 1: sshd down; logrotate copytruncate twice (the first copy becomes server.log.2, the
    second server.log.1); sshd back: both copies are read on, in order, then the live file
    (before: the lines only in server.log.1 were lost, 245 of 2,688)."""
    path = tmp_path / "server.log"
    engine = Engine(path)
    engine.start()
    transport = await connect_ssh(sshd_server.options())
    collector = Collector(transport, LogSource("file", str(path)))
    await until(lambda: len(collector.lines) > 100)
    sshd_server.kill()
    for _ in range(2):
        await asyncio.sleep(0.6)
        with engine.lock:
            logrotate(tmp_path, path, "copytruncate")
    old_size = (tmp_path / "server.log.1").stat().st_size
    await until(lambda: path.stat().st_size > old_size + 4096)  # written past the old offset
    sshd_server.restart()
    await asyncio.sleep(1.0)
    engine.stop_event.set()
    await asyncio.to_thread(engine.join)
    await collect_all(collector, engine.written)
    await transport.close()
    assert (tmp_path / "server.log.2").exists()
    assert lost_and_doubled(collector, engine.written) == (0, 0)
    assert collector.texts == engine.written


async def test_copytruncate_after_each_burst_with_the_follower_behind(sshd_server: SshServer,
                                                                     tmp_path: Path) -> None:
    """Class 1, live: three bursts of 40,000 lines, each followed at once by logrotate copytruncate
    while the follower is still reading the first (before: 220,000 of 360,000 lost)."""
    path = tmp_path / "server.log"
    engine = Engine(path)
    transport = await connect_ssh(sshd_server.options())
    collector = Collector(transport, LogSource("file", str(path)))
    engine.burst(1)
    await until(lambda: len(collector.lines) == 1)
    for _ in range(3):
        engine.burst(40_000)
        logrotate(tmp_path, path, "copytruncate")
    behind = len(collector.lines) < len(engine.written)
    engine.burst(10)
    await collect_all(collector, engine.written)
    await transport.close()
    assert behind, "the follower kept up: the test did not test what it says"
    assert lost_and_doubled(collector, engine.written) == (0, 0)
    assert collector.texts == engine.written


@pytest.mark.parametrize("rotation", ["create-compress", "replaced", "removed"])
async def test_a_new_inode_during_an_outage(sshd_server: SshServer, tmp_path: Path, rotation: str) -> None:
    """Class 3: during an outage the log is renamed and gzipped (logrotate create + compress), or
    replaced by a copy (a new inode holding the same content), or rotated and the old file removed:
    the first two lose nothing (read on from the .gz, from the new file at the old offset); the
    third records the gap (the byte it begins at, its time span) in what the follower reports
    (before: 245 lost, said only on stderr)."""
    path = tmp_path / "server.log"
    engine = Engine(path)
    engine.start()
    transport = await connect_ssh(sshd_server.options())
    gaps: list[FollowGap] = []
    collector = Collector(transport, LogSource("file", str(path)), on_gap=gaps.append)
    await until(lambda: len(collector.lines) > 100)
    sshd_server.kill()
    await asyncio.sleep(0.6)  # written while the collector is away
    with engine.lock:
        if rotation == "create-compress":
            logrotate(tmp_path, path, "create", "compress")
        elif rotation == "replaced":
            shutil.copyfile(path, tmp_path / "server.log.new")
            os.replace(tmp_path / "server.log.new", path)
        else:
            logrotate(tmp_path, path, "create")
        unreadable = len(engine.written)
        if rotation == "removed":
            (tmp_path / "server.log.1").unlink()
        engine.reopen()
    await asyncio.sleep(0.5)
    sshd_server.restart()
    await asyncio.sleep(1.0)
    engine.stop_event.set()
    await asyncio.to_thread(engine.join)
    await collect_all(collector, engine.written)
    await transport.close()
    lost, doubled = lost_and_doubled(collector, engine.written)
    assert doubled == 0
    if rotation == "create-compress":
        assert (tmp_path / "server.log.1.gz").exists() and not (tmp_path / "server.log.1").exists()
    if rotation != "removed":
        assert lost == 0 and gaps == []
        assert collector.texts == engine.written
        return
    missing = sorted(set(engine.written) - set(collector.texts), key=engine.written.index)
    assert lost > 20 and all(engine.written.index(m) < unreadable for m in missing)
    assert len(gaps) == 1 and gaps[0].after_byte is not None and gaps[0].after_byte > 0
    assert gaps[0].since_ns is not None and gaps[0].found_ns - gaps[0].since_ns > 0.5e9
    assert "rotated away" in gaps[0].reason


async def test_renamed_while_python_logging_keeps_writing_to_it(sshd_server: SshServer,
                                                               tmp_path: Path) -> None:
    """Class 6: Python's logging.FileHandler keeps its file open; logrotate (create, no
    copytruncate) renames it twice: every line is still written to the renamed file and read
    from it (before: 4,833 of 5,758 lost)."""
    path = tmp_path / "server.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger(f"engine-{os.getpid()}")
    logger.propagate = False
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    written: list[str] = []
    stop = threading.Event()

    def engine() -> None:
        while not stop.is_set():
            written.append(log_line(len(written)))
            logger.info(written[-1])
            time.sleep(0.001)

    writer = threading.Thread(target=engine, daemon=True)
    transport = await connect_ssh(sshd_server.options())
    collector = Collector(transport, LogSource("file", str(path)))
    writer.start()
    await until(lambda: len(collector.lines) > 100)
    for _ in range(2):
        await asyncio.sleep(0.5)
        logrotate(tmp_path, path, "create")
    await asyncio.sleep(0.5)
    sshd_server.kill_sessions()  # a reconnect finds the renamed file by its inode
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.to_thread(writer.join)
    handler.close()
    await collect_all(collector, written)
    await transport.close()
    assert path.stat().st_size == 0 and (tmp_path / "server.log.2").stat().st_size > 0
    assert lost_and_doubled(collector, written) == (0, 0)
    assert collector.texts == written


async def test_copytruncate_while_the_follower_is_mid_read(sshd_server: SshServer, tmp_path: Path) -> None:
    """Class 5: a 15 MB burst; logrotate copytruncate while the follower is still reading it; a
    second burst regrows the file past the follower's offset: the rest of the first is read from
    the copy, the second from its start (before: 100,841 of 121,000 lost, the regrown file read as
    if it continued the old one)."""
    path = tmp_path / "server.log"
    engine = Engine(path)
    transport = await connect_ssh(sshd_server.options())
    collector = Collector(transport, LogSource("file", str(path)))
    engine.burst(1)
    await until(lambda: len(collector.lines) == 1)
    engine.burst(121_000)
    await until(lambda: len(collector.lines) > 5_000)
    with engine.lock:
        logrotate(tmp_path, path, "copytruncate")
    mid_read = len(collector.lines) < 100_000
    engine.burst(60_000)
    await collect_all(collector, engine.written, timeout_s=120)
    await transport.close()
    assert mid_read, "the follower had read the burst already: the test did not test what it says"
    assert lost_and_doubled(collector, engine.written) == (0, 0)
    assert collector.texts == engine.written


def test_collect_records_a_removed_rotated_file_in_meta_json(sshd_server: SshServer, tmp_path: Path) -> None:
    """Class 3 as users run it: `gputrace collect` over SSH; during an outage the log is rotated
    (logrotate create) and the rotated file removed before it was read to its end: meta.json's
    log_gaps names the file, the byte the gap begins at and its time span, and source_problems
    carries it to the report (before: only a warning on stderr)."""
    path = tmp_path / "server.log"
    engine = Engine(path)
    engine.start()
    cfg = tmp_path / "gputrace.toml"
    cfg.write_text(f'[[hosts]]\nname = "node0"\nssh = "root@127.0.0.1:{sshd_server.port}"\n'
                   f'identity_file = "{sshd_server.client_key_path}"\n'
                   f'known_hosts = "{sshd_server.known_hosts_path}"\n'
                   f'[hosts.log]\nkind = "file"\npath = {json.dumps(str(path))}\n')
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gputrace", "collect", "--config", str(cfg), "--out",
                             str(tmp_path / "run"), "--listen", f"127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/healthz"), timeout_s=60)
        time.sleep(1.0)
        sshd_server.kill()
        time.sleep(0.5)
        with engine.lock:
            logrotate(tmp_path, path, "create")
            (tmp_path / "server.log.1").unlink()
            engine.reopen()
        time.sleep(0.5)
        sshd_server.restart()
        wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/healthz"), timeout_s=60)
        time.sleep(1.0)
    finally:
        engine.stop_event.set()
        engine.join()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()[-2000:]
    with Store.open(tmp_path / "run", read_only=True) as store:
        collector = store.meta.extra["collector"]
    gaps = collector["log_gaps"]
    assert len(gaps) == 1 and gaps[0]["source"] == "log node0" and gaps[0]["after_byte"] > 0
    assert gaps[0]["found_ns"] - gaps[0]["since_ns"] > 0.5e9
    assert any("rotated away" in p["reason"] and p["since_ns"] == gaps[0]["since_ns"]
               for p in collector["source_problems"])
