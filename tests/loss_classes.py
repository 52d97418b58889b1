"""The loss classes of [robust] #45 as scenarios over a real sshd, rotated by the real `logrotate`
(copytruncate, create, compress) with a config written here: each returns the lines written, those
the follower delivered and the gaps it recorded. tests/test_remote_follow_rotation.py asserts on
them; bench/robust.py prints them (its --quick mode with smaller bursts)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sshd import SshServer
from test_remote_follow import Collector, log_line

from gputrace.config import LogSource
from gputrace.remote.follow import FollowGap
from gputrace.remote.ssh import SshTransport, connect_ssh


def logrotate(root: Path, log: Path, *directives: str) -> None:
    """Rotate ``log`` now with the real logrotate and a config holding ``directives``."""
    from conftest import require_binary

    binary = require_binary("logrotate", "/usr/sbin/logrotate")
    conf = root / "logrotate.conf"
    conf.write_text(f"{log} {{\n  rotate 5\n  missingok\n" + "".join(f"  {d}\n" for d in directives) + "}\n")
    conf.chmod(0o644)
    subprocess.run([binary, "--force", "--state", str(root / "logrotate.state"), str(conf)],
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

    async def finish(self) -> None:
        self.stop_event.set()
        await asyncio.to_thread(self.join)


async def follow(sshd: SshServer, source: LogSource) -> tuple[SshTransport, list[FollowGap], Collector]:
    """An SSH connection to ``sshd`` and a Collector following ``source`` over it, its gaps kept."""
    transport = await connect_ssh(sshd.options())
    gaps: list[FollowGap] = []
    return transport, gaps, Collector(transport, source, on_gap=gaps.append)


async def until(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


async def collect_all(collector: Collector, written: list[str], timeout_s: float = 60.0) -> None:
    """Wait until every line written arrived (or the timeout), then a little longer: none twice."""
    await until(lambda: len(collector.lines) >= len(written) or written[-1] in collector.texts[-1:],
                timeout_s)
    await asyncio.sleep(0.5)
    await collector.stop()


def write_lines(path: Path, lines: list[str], mode: str = "a") -> None:
    with path.open(mode) as fh:
        fh.writelines(f"{text}\n" for text in lines)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one scenario wrote and what the follower made of it. ``expected``: the lines it must
    deliver, in order (all written, unless some were gone before it could read them); ``tested``:
    the scenario's condition held (the follower was behind, mid-read), so it tested what it says."""

    written: list[str]
    got: list[str]
    gaps: list[FollowGap]
    expected: list[str]
    tested: bool = True
    gone_bytes: int | None = None  # the bytes of the lines lost, where the scenario knows them

    @property
    def lost(self) -> int:
        return len(set(self.written) - set(self.got))

    @property
    def doubled(self) -> int:
        return len(self.got) - len(set(self.got))

    def summary(self) -> str:
        """written, delivered, lost, recorded as lost, doubled: one line."""
        recorded = "; ".join(
            (f"after line {g.after_line}" if g.after_line is not None else f"after byte {g.after_byte}")
            + (f" (at least {g.lost_bytes:,} bytes)" if g.lost_bytes is not None else " (size unknown)")
            for g in self.gaps)
        return (f"written {len(self.written):,}, stored {len(set(self.got)):,}, lost {self.lost:,}"
                + (f" ({self.gone_bytes:,} bytes)" if self.gone_bytes is not None else "") + ", "
                f"recorded as lost: {len(self.gaps)} gap{'s' * (len(self.gaps) != 1)}"
                f"{' ' + recorded if recorded else ''}, doubled {self.doubled:,}"
                + ("" if self.tested else " (the scenario's condition did not hold: not tested)"))


async def two_copytruncates_in_one_outage(sshd: SshServer, root: Path) -> Outcome:
    """Class 1: sshd down; logrotate copytruncate twice (the first copy becomes server.log.2, the
    second server.log.1); sshd back: both copies are to be read on, in order, then the live file."""
    path = root / "server.log"
    engine = Engine(path)
    engine.start()
    transport, gaps, collector = await follow(sshd, LogSource("file", str(path)))
    await until(lambda: len(collector.lines) > 100)
    sshd.kill()
    for _ in range(2):
        await asyncio.sleep(0.6)
        with engine.lock:
            logrotate(root, path, "copytruncate")
    old_size = (root / "server.log.1").stat().st_size
    await until(lambda: path.stat().st_size > old_size + 4096)  # written past the old offset
    sshd.restart()
    await asyncio.sleep(1.0)
    await engine.finish()
    await collect_all(collector, engine.written)
    await transport.close()
    return Outcome(engine.written, collector.texts, gaps, engine.written, (root / "server.log.2").exists())


async def copytruncate_after_each_burst(sshd: SshServer, root: Path, burst: int = 40_000) -> Outcome:
    """Class 1, live: three bursts of ``burst`` lines, each followed at once by logrotate
    copytruncate while the follower is still reading the first."""
    path = root / "server.log"
    engine = Engine(path)
    transport, gaps, collector = await follow(sshd, LogSource("file", str(path)))
    engine.burst(1)
    await until(lambda: len(collector.lines) == 1)
    for _ in range(3):
        engine.burst(burst)
        logrotate(root, path, "copytruncate")
    behind = len(collector.lines) < len(engine.written)
    engine.burst(10)
    await collect_all(collector, engine.written)
    await transport.close()
    return Outcome(engine.written, collector.texts, gaps, engine.written, behind)


async def command_log_rewritten_in_an_outage(sshd: SshServer, root: Path, case: str) -> Outcome:
    """Class 2: a command source (`tail -n +1 -f`, as `kubectl logs -f`: rerun after the outage, it
    prints the log from its start) whose log was truncated and rewritten during an SSH outage, 50
    lines written in the outage truncated away unread. ``truncated``: new lines only; ``restarted``:
    an engine restarted into the same 10-line banner, then new lines; ``shorter``: only the banner
    when the rerun starts (its output stops short of what was read), new lines after it."""
    path = root / "server.log"
    old = [log_line(i) for i in range(300)]
    write_lines(path, old, "w")
    transport, gaps, collector = await follow(sshd, LogSource("command", f"tail -n +1 -f {path}"))
    await until(lambda: len(collector.lines) == len(old))
    sshd.kill()
    unread = [log_line(1000 + i) for i in range(50)]
    write_lines(path, unread)
    new = [log_line(100_000 + i) for i in range(2 * len(old))]
    rewritten, later = {"truncated": (new, []), "restarted": (old[:10] + new, []),
                        "shorter": (old[:10], new[:30])}[case]
    write_lines(path, rewritten, "w")
    sshd.restart()
    if later:
        await until(lambda: len(gaps) == 1)
        write_lines(path, later)
    expected = old + [text for text in rewritten + later if text not in old]
    await until(lambda: len(collector.lines) >= len(expected))
    await asyncio.sleep(0.5)
    await collector.stop()
    await transport.close()
    return Outcome(old + unread + rewritten + later, collector.texts, gaps, expected)


async def new_inode_in_an_outage(sshd: SshServer, root: Path, rotation: str) -> Outcome:
    """Class 3: during an outage the log is renamed and gzipped (``create-compress``: logrotate
    create + compress), or ``replaced`` by a copy (a new inode holding the same content), or rotated
    and the old file ``removed``: the first two are to lose nothing; the third to record the gap.
    ``expected`` holds the lines that were still on disk."""
    path = root / "server.log"
    engine = Engine(path)
    engine.start()
    transport, gaps, collector = await follow(sshd, LogSource("file", str(path)))
    await until(lambda: len(collector.lines) > 100)
    sshd.kill()
    await asyncio.sleep(0.6)  # written while the collector is away
    with engine.lock:
        if rotation == "create-compress":
            logrotate(root, path, "create", "compress")
        elif rotation == "replaced":
            shutil.copyfile(path, root / "server.log.new")
            os.replace(root / "server.log.new", path)
        else:
            logrotate(root, path, "create")
        read_before = len(collector.lines)
        unreadable = len(engine.written)
        if rotation == "removed":
            (root / "server.log.1").unlink()
        engine.reopen()
    await asyncio.sleep(0.5)
    sshd.restart()
    await asyncio.sleep(1.0)
    await engine.finish()
    await collect_all(collector, engine.written)
    await transport.close()
    gone = engine.written[read_before:unreadable] if rotation == "removed" else []
    tested = rotation != "create-compress" or ((root / "server.log.1.gz").exists()
                                               and not (root / "server.log.1").exists())
    return Outcome(engine.written, collector.texts, gaps,
                   [text for text in engine.written if text not in set(gone)], tested)


async def gone_in_an_outage_while_behind(sshd: SshServer, root: Path, how: str,
                                         burst: int = 100_000) -> Outcome:
    """Class 3 with the follower behind: a burst (12 MB at 100,000 lines) it is still reading when
    sshd goes down; in the outage the file is rotated and the rotated file ``removed``, or
    ``truncated`` in place with no copy; ten new lines; sshd back. The unread rest of the burst is
    gone: ``gone_bytes``, the bytes it held, is what the gap is to record."""
    path = root / "server.log"
    engine = Engine(path)
    transport, gaps, collector = await follow(sshd, LogSource("file", str(path)))
    engine.burst(1)
    await until(lambda: len(collector.lines) == 1)
    engine.burst(burst)
    # a reader may see a write under way (the file's size grows as its pages are copied): the
    # follower has seen the burst's whole size once lines read after the write arrive, past the 3 MB
    # (25,000 lines) that may be under way in pipes and the SSH channel's window
    read_by_then = len(collector.lines)
    await until(lambda: len(collector.lines) > read_by_then + 25_000)
    sshd.kill()
    await asyncio.sleep(0.5)  # what was under way arrives
    read_before = len(collector.lines)
    with engine.lock:
        if how == "removed":
            logrotate(root, path, "create")
            (root / "server.log.1").unlink()
            engine.reopen()
        else:
            os.truncate(path, 0)
    engine.burst(10)
    sshd.restart()
    await collect_all(collector, engine.written)
    await transport.close()
    gone = engine.written[read_before:burst + 1]
    kept = engine.written[:read_before] + engine.written[burst + 1:]
    return Outcome(engine.written, collector.texts, gaps, kept, read_before < burst * 0.8,
                   sum(len(t) + 1 for t in gone))


async def written_between_copy_and_truncation(sshd: SshServer, root: Path,
                                              burst: int = 100_000) -> Outcome:
    """Class 1, where copytruncate does lose lines: the follower is mid-read of a 12 MB burst; the
    log is copied (as logrotate's copytruncate), 100 lines are written, the follower reads on (it
    sees the file's new size), then the log is truncated: those 100 lines are in no file
    (``gone_bytes``)."""
    path = root / "server.log"
    engine = Engine(path)
    transport, gaps, collector = await follow(sshd, LogSource("file", str(path)))
    engine.burst(1)
    await until(lambda: len(collector.lines) == 1)
    engine.burst(burst)
    await until(lambda: len(collector.lines) > 1_000)
    shutil.copyfile(path, root / "server.log.1")
    engine.burst(100)
    read_by_then = len(collector.lines)  # the follower stats the file at every 64 KiB it reads
    await until(lambda: len(collector.lines) > read_by_then + 25_000)
    os.truncate(path, 0)
    behind = len(collector.lines) < burst * 0.8
    engine.burst(10)
    await collect_all(collector, engine.written, timeout_s=120)
    await transport.close()
    gone = engine.written[burst + 1:burst + 101]
    kept = engine.written[:burst + 1] + engine.written[burst + 101:]
    return Outcome(engine.written, collector.texts, gaps, kept, behind, sum(len(t) + 1 for t in gone))


async def renamed_while_python_logging_writes(sshd: SshServer, root: Path) -> Outcome:
    """Class 6: Python's logging.FileHandler keeps its file open; logrotate (create, no
    copytruncate) renames it twice: every line is still written to the renamed file."""
    path = root / "server.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger(f"engine-{os.getpid()}-{id(root)}")
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
    transport, gaps, collector = await follow(sshd, LogSource("file", str(path)))
    writer.start()
    await until(lambda: len(collector.lines) > 100)
    for _ in range(2):
        await asyncio.sleep(0.5)
        logrotate(root, path, "create")
    await asyncio.sleep(0.5)
    sshd.kill_sessions()  # a reconnect finds the renamed file by its inode
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.to_thread(writer.join)
    handler.close()
    logger.removeHandler(handler)
    await collect_all(collector, written)
    await transport.close()
    tested = path.stat().st_size == 0 and (root / "server.log.2").stat().st_size > 0
    return Outcome(written, collector.texts, gaps, written, tested)


async def copytruncate_mid_read(sshd: SshServer, root: Path, burst: int = 121_000) -> Outcome:
    """Class 5: a burst (15 MB at 121,000 lines); logrotate copytruncate while the follower is
    still reading it; a second burst half as long regrows the file past the follower's offset."""
    path = root / "server.log"
    engine = Engine(path)
    transport, gaps, collector = await follow(sshd, LogSource("file", str(path)))
    engine.burst(1)
    await until(lambda: len(collector.lines) == 1)
    engine.burst(burst)
    await until(lambda: len(collector.lines) > burst // 24)
    with engine.lock:
        logrotate(root, path, "copytruncate")
    mid_read = len(collector.lines) < burst * 0.8
    engine.burst(burst // 2)
    await collect_all(collector, engine.written, timeout_s=120)
    await transport.close()
    return Outcome(engine.written, collector.texts, gaps, engine.written, mid_read)
