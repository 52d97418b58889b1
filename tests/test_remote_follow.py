"""Following logs with resume, over a real sshd and locally: no line lost, none twice, no orphans."""

from __future__ import annotations

import asyncio
import bz2
import contextlib
import gzip
import json
import lzma
import os
import random
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sshd import SshServer, processes_matching, sshd_server_fixture, wait_no_processes  # noqa: F401

from gputrace.config import LogSource
from gputrace.errors import SourceError
from gputrace.remote.file_follower import Source
from gputrace.remote.follow import (
    Backoff,
    CommandPosition,
    CursorPosition,
    FilePosition,
    FollowedLine,
    FollowGap,
    _decoder_for,
    follow_log,
    follow_log_batches,
    parse_docker_timestamp,
)
from gputrace.remote.local import LocalTransport
from gputrace.remote.ssh import connect_ssh
from gputrace.remote.transport import Transport

FAST = Backoff(initial_s=0.02, max_s=0.5)
pytestmark = pytest.mark.system  # most tests here run a real sshd


def log_line(i: int) -> str:
    stamp = f"[2026-06-24 12:00:{i % 60:02d} PP{i % 8}]"
    return f"{stamp} Decode batch, #running-req: {i % 64}, seq {i}{'x' * (i % 37)}"


class LogWriter(threading.Thread):
    """Appends numbered lines (often in two writes, so partial lines are on disk) until stopped."""

    def __init__(self, path: Path, *, interval_s: float = 0.0005, min_lines: int = 0,
                 rotate_every: int = 0, rotate: Callable[[LogWriter], None] | None = None) -> None:
        super().__init__(daemon=True)
        self.path, self.interval_s, self.min_lines = path, interval_s, min_lines
        self.rotate_every, self.rotate = rotate_every, rotate
        self.written: list[str] = []
        self.stop_event = threading.Event()
        self.go = threading.Event()  # the first line is written at once, the rest after go
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def reopen(self) -> None:
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def run(self) -> None:
        rng = random.Random(7)
        i = 0
        while not (self.stop_event.is_set() and i >= self.min_lines):
            data = (log_line(i) + "\n").encode()
            cut = rng.randrange(len(data)) if i % 3 == 0 else len(data)
            os.write(self.fd, data[:cut])
            if cut < len(data):
                time.sleep(self.interval_s)
                os.write(self.fd, data[cut:])
            self.written.append(log_line(i))
            i += 1
            self.go.wait()
            if self.rotate is not None and self.rotate_every and i % self.rotate_every == 0:
                self.rotate(self)
            time.sleep(self.interval_s)
        os.close(self.fd)


class Collector:
    """Runs a follower in a task and keeps every line it yields."""

    def __init__(self, transport: Transport, source: LogSource, **kwargs: object) -> None:
        self.lines: list[FollowedLine] = []
        self.task = asyncio.create_task(self._run(transport, source, kwargs))

    async def _run(self, transport: Transport, source: LogSource, kwargs: dict[str, object]) -> None:
        async for batch in follow_log_batches(transport, source, backoff=FAST, **kwargs):  # type: ignore[arg-type]
            self.lines.extend(batch)

    async def wait_for(self, count: int, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.lines) < count and time.monotonic() < deadline and not self.task.done():
            await asyncio.sleep(0.02)
        if self.task.done():
            self.task.result()

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

    @property
    def texts(self) -> list[str]:
        return [line.text for line in self.lines]


async def release(writer: LogWriter, collector: Collector) -> None:
    """Let the writer go on once the follower has its first line (it follows the file from then on)."""
    await collector.wait_for(1)
    writer.go.set()


async def test_follow_growing_log_over_ssh(sshd_server: SshServer, tmp_path: Path) -> None:
    """Lines appended to a file arrive over SSH in order, with receive times and resume positions."""
    path = tmp_path / "server.log"
    writer = LogWriter(path, min_lines=500)
    writer.start()
    transport = await connect_ssh(sshd_server.options())
    collector = Collector(transport, LogSource("file", str(path)))
    await release(writer, collector)
    writer.stop_event.set()
    await asyncio.to_thread(writer.join)
    await collector.wait_for(len(writer.written))
    await collector.stop()
    await transport.close()
    assert collector.texts == writer.written
    recv = [line.recv_ts_ns for line in collector.lines]
    assert recv == sorted(recv) and abs(recv[-1] - time.time_ns()) < 30e9
    last = collector.lines[-1].position
    assert last == FilePosition(path.stat().st_ino, path.stat().st_size)


@pytest.mark.slow
async def test_kill_sshd_20_times_loses_nothing(sshd_server: SshServer, tmp_path: Path) -> None:
    """SIGKILL of the sshd serving the session, 20 times while the log grows: every line exactly once."""
    path = tmp_path / "server.log"
    writer = LogWriter(path, interval_s=0.0003)
    writer.start()
    transport = await connect_ssh(sshd_server.options())
    collector = Collector(transport, LogSource("file", str(path)))
    await release(writer, collector)
    kills = 0
    while kills < 20:
        # Wait until the follower is back (a new connection and new lines), then kill again.
        seen = len(collector.lines)
        deadline = time.monotonic() + 15
        while (transport.connects <= kills or len(collector.lines) <= seen) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(random.uniform(0.0, 0.08))
        assert sshd_server.kill_sessions() > 0
        kills += 1
    writer.min_lines = len(writer.written) + 200
    writer.stop_event.set()
    await asyncio.to_thread(writer.join)
    await collector.wait_for(len(writer.written))
    await collector.stop()
    await transport.close()
    assert transport.connects >= 21
    assert len(collector.texts) == len(writer.written)
    assert collector.texts == writer.written
    assert wait_no_processes(str(path)) == []


def rotate_by_rename(writer: LogWriter) -> None:
    n = sum(1 for p in writer.path.parent.iterdir() if p.name.startswith(writer.path.name + "."))
    os.rename(writer.path, f"{writer.path}.{n + 1}")
    writer.reopen()


async def test_rotation_by_rename_while_writing(sshd_server: SshServer, tmp_path: Path) -> None:
    """Renamed-away files are read to their end, then the new file from 0 (also across reconnects)."""
    path = tmp_path / "server.log"
    writer = LogWriter(path, min_lines=1200, rotate_every=150, rotate=rotate_by_rename, interval_s=0.001)
    writer.start()
    transport = await connect_ssh(sshd_server.options())
    collector = Collector(transport, LogSource("file", str(path)))
    await release(writer, collector)
    for _ in range(3):  # a few reconnects, so that some resume finds its file renamed away
        await asyncio.sleep(0.25)
        sshd_server.kill_sessions()
    writer.stop_event.set()
    await asyncio.to_thread(writer.join)
    await collector.wait_for(len(writer.written))
    await collector.stop()
    await transport.close()
    assert len(list(tmp_path.glob("server.log.*"))) >= 7
    assert collector.texts == writer.written


async def test_rotation_by_copytruncate_while_writing(sshd_server: SshServer, tmp_path: Path) -> None:
    """A file copied and truncated in place is read again from its start, nothing twice."""
    path = tmp_path / "server.log"
    state: dict[str, Collector] = {}

    def copytruncate(writer: LogWriter) -> None:
        # copytruncate itself loses what the follower has not read before the truncate (only the
        # copy has it); like a careful logrotate, let the follower catch up first.
        deadline = time.monotonic() + 10
        while len(state["c"].lines) < len(writer.written) and time.monotonic() < deadline:
            time.sleep(0.005)
        shutil.copyfile(writer.path, f"{writer.path}.{len(writer.written)}")
        os.truncate(writer.path, 0)

    writer = LogWriter(path, min_lines=1000, rotate_every=200, rotate=copytruncate, interval_s=0.0005)
    transport = await connect_ssh(sshd_server.options())
    state["c"] = collector = Collector(transport, LogSource("file", str(path)))
    writer.start()
    await release(writer, collector)
    writer.stop_event.set()
    await asyncio.to_thread(writer.join)
    await collector.wait_for(len(writer.written))
    await collector.stop()
    await transport.close()
    assert path.stat().st_size < 200 * 120
    assert collector.texts == writer.written


def _received(writer: LogWriter, collector: Collector,
              cut: range = range(0)) -> tuple[list[int], set[int]]:
    """The writer's numbers of the lines received whole, in the order received, and those never
    received whole. A line the writer was writing (in two writes) when the log was copied or
    truncated is on disk in pieces: the copy ends with its head, the truncated file starts with its
    tail, and each piece arrives as a line of its own. Such a piece is allowed only of a line in
    ``cut`` (those the rotation made unknowable), and that line counts as not received."""
    number = {line: i for i, line in enumerate(writer.written)}
    order = []
    for text in collector.texts:
        if text in number:
            order.append(number[text])
            continue
        pieces_of = [i for i in cut if i < len(writer.written) and text
                     and (writer.written[i].startswith(text) or writer.written[i].endswith(text))]
        assert pieces_of, f"received {text!r}: neither a line written nor a piece of one the rotation cut"
    return order, set(range(len(writer.written))) - set(order)


async def _copytruncate_during_an_outage(
        sshd_server: SshServer, tmp_path: Path, *,
        keep_copy: bool) -> tuple[LogWriter, Collector, list[str | None], range]:
    """A line every 5 ms; sshd killed; the log copied (or not) and truncated in place; sshd back
    once the log is longer than it was. Returns the writer, the follower, the problems told and
    the lines written between the copy and the truncation (those only the old file had)."""
    path = tmp_path / "server.log"
    writer = LogWriter(path, interval_s=0.005)
    writer.start()
    transport = await connect_ssh(sshd_server.options())
    problems: list[str | None] = []
    collector = Collector(transport, LogSource("file", str(path)), on_problem=problems.append)
    await release(writer, collector)
    await asyncio.sleep(0.8)
    sshd_server.kill()
    old_size = path.stat().st_size
    await asyncio.sleep(0.3)  # the engine goes on writing while the collector is away
    copied = len(writer.written)
    if keep_copy:
        shutil.copyfile(path, f"{path}.1")
    os.truncate(path, 0)
    truncated = len(writer.written)
    while path.stat().st_size <= old_size + 2000:
        await asyncio.sleep(0.02)
    sshd_server.restart()
    await asyncio.sleep(0.5)
    # 150 lines past the truncation however slowly a loaded machine lets the writer go (the tests
    # ask for 100 read after it: a make test beside other work wrote 16 in the time once)
    writer.min_lines = truncated + 150
    writer.stop_event.set()
    await asyncio.to_thread(writer.join)
    deadline = time.monotonic() + 20
    while writer.written[-1] not in collector.texts[-1:] and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)  # nothing more (no duplicate) arrives
    await collector.stop()
    await transport.close()
    return writer, collector, problems, range(copied, truncated + 1)


async def test_copytruncate_during_an_ssh_outage_resumes_at_the_new_content(
        sshd_server: SshServer, tmp_path: Path) -> None:
    """[robust] 1: sshd killed, the log copied and truncated, written past the old offset, sshd back:
    the old content is read on from the copy, the new from its start, nothing twice (it resumed at
    the old offset in the new content and lost 945 of 5,650); no gap told: the follower had read
    all it had seen of the file, and the copy holds it (what the engine wrote between the copy and
    the truncation, if anything, is in no file and known to no follower)."""
    writer, collector, problems, unknowable = await _copytruncate_during_an_outage(
        sshd_server, tmp_path, keep_copy=True)
    order, missing = _received(writer, collector, cut=unknowable)
    assert order == sorted(set(order)), "a line arrived twice or out of order"
    assert missing <= set(unknowable), f"lost {sorted(missing - set(unknowable))}"
    assert len(writer.written) - unknowable.stop > 100
    assert not [p for p in problems if p and "truncated in place" in p]


async def test_truncation_during_an_outage_without_a_copy_records_the_gap(
        sshd_server: SshServer, tmp_path: Path) -> None:
    """[robust] 1: truncated in place (no copy) while sshd was down: every line written after the
    truncation arrives, once; what the old file held past the offset is recorded as lost."""
    writer, collector, problems, unknowable = await _copytruncate_during_an_outage(
        sshd_server, tmp_path, keep_copy=False)
    order, missing = _received(writer, collector, cut=unknowable)
    assert order == sorted(set(order)), "a line arrived twice or out of order"
    assert missing and max(missing) < unknowable.stop, "lost lines written after the truncation"
    assert len(writer.written) - unknowable.stop > 100
    assert any(p and "no copy of the old content" in p and "is lost" in p for p in problems)


async def test_hostile_path_is_followed_and_nothing_else_runs(sshd_server: SshServer, tmp_path: Path) -> None:
    """A path with spaces, quotes, `;`, `$(...)` and backticks is followed literally; nothing runs."""
    pwned = Path("/tmp/pwned-gputrace")
    pwned.unlink(missing_ok=True)
    folder = tmp_path / "we ird 'q' \"dq\" ; $(touch " / "tmp" / "pwned-gputrace) `touch $HOME-x` *"
    folder.mkdir(parents=True)
    path = folder / "server; rm -rf $HOME.log"
    assert "$(touch /tmp/pwned-gputrace)" in str(path)
    path.write_text("".join(log_line(i) + "\n" for i in range(50)))
    transport = await connect_ssh(sshd_server.options())
    collector = Collector(transport, LogSource("file", str(path)))
    await collector.wait_for(50)
    result = await transport.run(["cat", str(path)])
    await collector.stop()
    await transport.close()
    assert collector.texts == [log_line(i) for i in range(50)]
    assert result.stdout.decode().splitlines() == collector.texts
    assert not pwned.exists() and not Path(os.path.expanduser("~") + "-x").exists()


async def test_follower_ends_on_the_host_when_stopped(sshd_server: SshServer, tmp_path: Path) -> None:
    """Cancelling the follower closes the channel and no follower process is left on the host."""
    path = tmp_path / "orphan-check.log"
    path.write_text("one\n")
    transport = await connect_ssh(sshd_server.options())
    collector = Collector(transport, LogSource("file", str(path)))
    await collector.wait_for(1)
    assert processes_matching(str(path)), "the follower should be running on the host"
    await collector.stop()
    assert wait_no_processes(str(path)) == []
    # A plain `tail -f` behind the same watchdog ends too, even though tail never reads stdin.
    stream = await transport.open_stream(["tail", "-f", str(path)])
    assert await stream.read() == b"one\n"
    await stream.close()
    assert wait_no_processes(str(path)) == []
    await transport.close()


async def test_partial_line_waits_for_its_end_locally(tmp_path: Path) -> None:
    """Through the local transport, a line without its newline is held back until it is complete."""
    path = tmp_path / "server.log"
    path.write_bytes(b"first\nsecond-ha")
    collector = Collector(LocalTransport(), LogSource("file", str(path)))
    await collector.wait_for(1)
    await asyncio.sleep(0.2)
    assert collector.texts == ["first"]
    with path.open("ab") as handle:
        handle.write(b"lf\r\nthird\n")
    await collector.wait_for(3)
    await collector.stop()
    assert collector.texts == ["first", "second-half", "third"]
    assert collector.lines[-1].position == FilePosition(path.stat().st_ino, path.stat().st_size)


async def test_resume_from_a_position_and_from_the_end(tmp_path: Path) -> None:
    """A follower started at a line's position continues right after it; from_start=False skips old lines."""
    path = tmp_path / "server.log"
    path.write_text("".join(f"{i}\n" for i in range(10)))
    local = LocalTransport()
    first = Collector(local, LogSource("file", str(path)))
    await first.wait_for(10)
    await first.stop()
    resumed = Collector(local, LogSource("file", str(path)), position=first.lines[3].position)
    tail_only = Collector(local, LogSource("file", str(path)), from_start=False)
    # A line a second until the tail-only follower has one: when it started (a loaded machine can
    # take longer than any fixed wait) is not this test's business, that it skips 0-9 is.
    written = 10
    deadline = time.monotonic() + 20
    while not tail_only.lines and time.monotonic() < deadline:
        with path.open("a") as handle:
            handle.write(f"{written}\n")
        written += 1
        await asyncio.sleep(0.2)
    await resumed.wait_for(written - 4)
    while tail_only.texts[-1:] != [str(written - 1)] and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await resumed.stop()
    await tail_only.stop()
    assert resumed.texts == [str(i) for i in range(4, written)]
    assert tail_only.texts, "the tail-only follower read nothing appended"
    first = int(tail_only.texts[0])
    assert first >= 10 and tail_only.texts == [str(i) for i in range(first, written)]


async def test_command_source_with_a_follower_script(sshd_server: SshServer, tmp_path: Path) -> None:
    """A command source (a follower script) resumes by skipping what it replays: exactly once."""
    path = tmp_path / "server.log"
    script = tmp_path / "follow it.sh"
    script.write_text('#!/bin/sh\nexec tail -n +1 -f "$1"\n')
    writer = LogWriter(path, min_lines=600, interval_s=0.001)
    writer.start()
    transport = await connect_ssh(sshd_server.options())
    source = LogSource("command", f"sh {shlex.quote(str(script))} {shlex.quote(str(path))}")
    collector = Collector(transport, source)
    await release(writer, collector)
    for _ in range(4):
        await asyncio.sleep(0.2)
        sshd_server.kill_sessions()
    writer.stop_event.set()
    await asyncio.to_thread(writer.join)
    await collector.wait_for(len(writer.written))
    await collector.stop()
    await transport.close()
    assert collector.texts == writer.written
    last = collector.lines[-1].position
    assert isinstance(last, CommandPosition) and last.lines == len(writer.written)
    assert wait_no_processes(str(path)) == []


async def test_a_command_that_ends_is_rerun_and_matched_by_content(tmp_path: Path) -> None:
    """[robust] #45 class 2 with a command that prints the whole log and ends (`cat`, rerun after
    each end): each rerun that replays what was read adds nothing; one that ends short of it (the
    log truncated back to its first 10 lines) is recorded as a gap after the last line read; what
    is appended then is read once (before: skipped by the old count until the log regrew past it)."""
    path = tmp_path / "server.log"
    old = [log_line(i) for i in range(300)]
    path.write_text("".join(f"{text}\n" for text in old))
    gaps: list[FollowGap] = []
    collector = Collector(LocalTransport(), LogSource("command", f"cat {path}"), on_gap=gaps.append)
    await collector.wait_for(len(old))
    await asyncio.sleep(1.0)  # rerun a few times, each replaying the same 300 lines
    assert collector.texts == old and gaps == []
    path.write_text("".join(f"{text}\n" for text in old[:10]))
    deadline = time.monotonic() + 20
    while not gaps and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    new = [log_line(5000 + i) for i in range(40)]
    with path.open("a") as fh:
        fh.writelines(f"{text}\n" for text in new)
    await collector.wait_for(len(old) + len(new))
    await asyncio.sleep(1.0)
    await collector.stop()
    assert collector.texts == old + new
    assert [(g.where, g.after_line) for g in gaps] == [(f"cat {path}", 300)]
    assert "it ended after 10 lines" in gaps[0].reason and "read from line 11" in gaps[0].reason
    last = collector.lines[-1].position
    assert isinstance(last, CommandPosition) and last.lines == 10 + len(new)


async def test_missing_follower_program_is_a_source_error(tmp_path: Path) -> None:
    """A follower that cannot run on the host (exit 127) raises SourceError instead of retrying forever."""
    source = LogSource("command", "exec gputrace-no-such-program-xyz")
    with pytest.raises(SourceError, match="exit 127"):
        async for _ in follow_log(LocalTransport(), source, backoff=FAST):
            pass


def _journald_ready() -> str | None:
    if shutil.which("journalctl") is None or shutil.which("systemd-run") is None:
        return "needs journalctl and systemd-run"
    if not Path("/run/systemd/journal/socket").exists():
        return "needs a running systemd-journald (no /run/systemd/journal/socket on this machine)"
    return None


@pytest.mark.skipif(_journald_ready() is not None, reason=str(_journald_ready()))
async def test_journald_unit_with_cursor_resume(tmp_path: Path) -> None:
    """journald lines arrive with __REALTIME_TIMESTAMP in microseconds, and resume after a cursor."""
    unit = f"gputrace-test-{os.getpid()}"
    subprocess.run(["systemd-run", "--unit", unit, "sh", "-c",
                    "for i in $(seq 0 99); do echo line $i; sleep 0.01; done"], check=True)
    local = LocalTransport()
    first = Collector(local, LogSource("journald", unit))
    await first.wait_for(100)
    await first.stop()
    assert first.texts == [f"line {i}" for i in range(100)]
    assert all(line.source_ts_ns is not None and line.source_ts_ns % 1000 == 0 for line in first.lines)
    resumed = Collector(local, LogSource("journald", unit), position=first.lines[49].position)
    await resumed.wait_for(50)
    await resumed.stop()
    assert resumed.texts == [f"line {i}" for i in range(50, 100)]


def _docker_ready() -> str | None:
    if shutil.which("docker") is None:
        return "needs docker"
    probe = subprocess.run(["docker", "image", "inspect", "busybox"], capture_output=True, timeout=20)
    if probe.returncode != 0:
        return "needs a running docker engine with the busybox image (none on this machine)"
    return None


@pytest.mark.skipif(_docker_ready() is not None, reason=str(_docker_ready()))
async def test_docker_container_with_since_resume() -> None:
    """docker logs lines arrive with their timestamps (stderr too), and resume with --since."""
    name = f"gputrace-test-{os.getpid()}"
    subprocess.run(["docker", "run", "-d", "--name", name, "busybox", "sh", "-c",
                    "for i in $(seq 0 99); do echo line $i >&2; sleep 0.01; done; sleep 60"], check=True)
    try:
        local = LocalTransport()
        first = Collector(local, LogSource("docker", name))
        await first.wait_for(100)
        await first.stop()
        assert first.texts == [f"line {i}" for i in range(100)]
        resumed = Collector(local, LogSource("docker", name), position=first.lines[49].position)
        await resumed.wait_for(50)
        await resumed.stop()
        assert resumed.texts == [f"line {i}" for i in range(50, 100)]
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)


def test_docker_timestamps_keep_nanoseconds() -> None:
    """docker's RFC 3339 timestamps convert to integer ns without float rounding."""
    assert parse_docker_timestamp("2026-06-24T12:00:00.123456789Z") == 1782302400123456789
    assert parse_docker_timestamp("1970-01-01T01:00:01.5+01:00") == 1_500_000_000
    with pytest.raises(ValueError):
        parse_docker_timestamp("yesterday")



def test_journal_json_decodes_cursor_time_and_byte_messages() -> None:
    """journalctl -o json entries give MESSAGE (also as a byte array), µs timestamps and the cursor."""
    decoder = _decoder_for(LogSource("journald", "sglang.service"), None, True, 0.05)
    entries = [
        {"__CURSOR": "s=1;i=1", "__REALTIME_TIMESTAMP": "1782302400123456",
         "MESSAGE": "Decode batch, #running-req: 8"},
        {"__CURSOR": "s=1;i=2", "__REALTIME_TIMESTAMP": "1782302400123999",
         "MESSAGE": list(b"caf\xc3\xa9 \xff")},
    ]
    data = "".join(json.dumps(e) + "\n" for e in entries).encode()
    lines = decoder.feed(data[:50], 1) + decoder.feed(data[50:], 2)
    assert [line.text for line in lines] == ["Decode batch, #running-req: 8", "café \ufffd"]
    assert [line.source_ts_ns for line in lines] == [1782302400123456000, 1782302400123999000]
    assert lines[-1].position == CursorPosition("s=1;i=2")
    resumed = _decoder_for(LogSource("journald", "a unit; rm -rf /"), lines[0].position, True, 0.05)
    assert resumed.argv("python3")[-2:] == ["--after-cursor", "s=1;i=1"]
    assert resumed.argv("python3")[2] == "a unit; rm -rf /"


def test_docker_resume_skips_what_was_read_at_the_same_instant() -> None:
    """docker --since is inclusive: lines at the resume instant already read are skipped, later ones kept."""
    out = (b"2026-06-24T12:00:00.000000001Z a\n2026-06-24T12:00:00.000000002Z b\n"
           b"2026-06-24T12:00:00.000000002Z c\n2026-06-24T12:00:00.000000003Z d\n")
    first = _decoder_for(LogSource("docker", "sglang"), None, True, 0.05)
    lines = first.feed(out[:70], 1)
    assert [line.text for line in lines] == ["a", "b"]
    resumed = _decoder_for(LogSource("docker", "sglang"), lines[-1].position, True, 0.05)
    assert resumed.argv("python3")[-4:] == ["--since", "1782302400.000000002", "--", "sglang"]
    replay = b"2026-06-24T12:00:00.000000002Z b\n" + out[out.index(b"2026-06-24T12:00:00.000000002Z c"):]
    assert [line.text for line in resumed.feed(replay, 2)] == ["c", "d"]


async def test_login_script_noise_before_the_follower_is_skipped(tmp_path: Path) -> None:
    """Whatever a host prints before the follower starts (a chatty .bashrc) is not taken for log lines."""
    noisy = tmp_path / "noisy-python"
    noisy.write_text('#!/bin/sh\necho "Welcome to node0 D 1 2 3"\nprintf "no newline"\n'
                     f'exec {sys.executable} "$@"\n')
    noisy.chmod(0o755)
    path = tmp_path / "server.log"
    path.write_text("one\ntwo\n")
    collector = Collector(LocalTransport(python=str(noisy)), LogSource("file", str(path)))
    await collector.wait_for(2)
    await collector.stop()
    assert collector.texts == ["one", "two"]


def test_a_followed_line_past_the_cap_is_cut_and_positions_count_every_byte() -> None:
    """A followed file writing 3 MiB without a newline: the follower keeps at most MAX_LINE_BYTES
    of it (memory grew with the file), emits its head as one line when the newline comes, and the
    resume position after the next line is the file's true byte offset ([robust] #13)."""
    from gputrace.engines.common import MAX_LINE_BYTES
    from gputrace.remote.follow import _FileDecoder

    decoder = _FileDecoder("/var/log/x.log", None, True, 0.1)
    opened = json.dumps({"ino": 7, "dev": 1, "path": "/var/log/x.log", "head": "", "via": None}).encode()
    head = b"\n:gputrace-follow-v2:\n" + b"O 7.a 0 %d 0\n" % len(opened) + opened
    blob = b"z" * (1 << 20)
    frames = [head]
    offset = 0
    for _ in range(3):
        frames.append(b"D 7.a %d %d 0\n" % (offset, len(blob)) + blob)
        offset += len(blob)
    tail = b"\n[2026-01-01 00:00:00 PP0] Decode batch, #running-req: 1\n"
    frames.append(b"D 7.a %d %d 0\n" % (offset, len(tail)) + tail)
    out = []
    for frame in frames:
        out += decoder.feed(frame, recv_ts_ns=1)
        assert len(decoder.gens["7.a"].pending) <= MAX_LINE_BYTES
    assert [len(line.text) for line in out] == [MAX_LINE_BYTES, len(tail) - 2]
    assert out[-1].position.offset == offset + len(tail)


async def test_receive_times_are_read_on_the_injected_clock(tmp_path: Path) -> None:
    """Lines followed with a clock 1 h ahead carry receive times on that clock."""
    path = tmp_path / "server.log"
    path.write_text("".join(log_line(i) + "\n" for i in range(3)))
    hour_ns = 3600 * 10**9
    before_ns = time.time_ns()
    lines = []
    async for line in follow_log(LocalTransport(), LogSource("file", str(path)), backoff=FAST,
                                 clock_ns=lambda: time.time_ns() + hour_ns):
        lines.append(line)
        if len(lines) == 3:
            break
    assert [line.text for line in lines] == [log_line(i) for i in range(3)]
    assert all(before_ns + hour_ns <= line.recv_ts_ns <= time.time_ns() + hour_ns for line in lines)


async def test_a_docker_source_backs_off_while_the_daemon_is_down(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """[robust] 14: `docker logs` that prints only its complaint (the daemon is down) and exits is
    retried with a growing delay: its output is no log line and does not reset the back-off (84
    reconnects in 30 s before)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    docker = bin_dir / "docker"  # the docker CLI as it answers with no daemon behind it
    docker.write_text(f'#!/bin/sh\necho x >> {shlex.quote(str(calls))}\n'
                      'echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. '
                      'Is the docker daemon running?" >&2\nexit 1\n')
    docker.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    backoff = Backoff(initial_s=0.05, max_s=0.8, jitter=0.0)
    problems: list[str | None] = []

    async def follow() -> None:
        async for _ in follow_log_batches(LocalTransport(), LogSource("docker", "engine"),
                                          backoff=backoff, on_problem=problems.append):
            pass

    task = asyncio.create_task(follow())
    await asyncio.sleep(3.0)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    runs = len(calls.read_text().splitlines())
    # 0.05 + 0.1 + 0.2 + 0.4 + 0.8 + 0.8 ... : at most 8 runs in 3 s (60 at a delay reset each time)
    assert 3 <= runs <= 8, runs
    assert any(p and "exited with status 1" in p for p in problems)


@pytest.mark.parametrize(("suffix", "compress"), [(".gz", gzip.compress), (".bz2", bz2.compress),
                                                  (".xz", lzma.compress)])
def test_a_compressed_copy_is_read_on_whatever_compressed_it(tmp_path: Path, suffix: str,
                                                             compress: Callable[[bytes], bytes]) -> None:
    """A rotated copy compressed by gzip, bzip2 or xz (logrotate's compresscmd) is read on from an
    offset (before: a .bz2 or .xz copy raised TypeError, its reader given GzipFile's fileobj=)."""
    path = tmp_path / f"server.log.1{suffix}"
    path.write_bytes(compress(b"first\nsecond\n"))
    source = Source.open(str(path))
    assert source is not None
    try:
        assert source.read(6, 100) == b"second\n" and source.size() is None
    finally:
        source.close_stream()
        os.close(source.fd)
