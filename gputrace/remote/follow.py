"""Follow a log source on a host (file, journald unit, docker container, any command) with resume:
reconnect with back-off and jitter, and continue from the last byte or cursor, so no line is lost
and none is seen twice. Each line carries its receive time and the position to resume after it.

Stop following by cancelling the consuming task, or with ``contextlib.aclosing``: the stream is
closed and the command ends on the host (see ``transport.watched_argv``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol

from gputrace.backoff import Backoff
from gputrace.config import LogSource
from gputrace.engines.common import MAX_LINE_BYTES
from gputrace.errors import HostKeyError, SourceError, TransportError
from gputrace.logsetup import get_logger
from gputrace.remote.transport import StreamedCommand, Transport

log = get_logger("remote.follow")
_READ_BYTES = 65536

_RFC3339 = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)")
_FILE_FOLLOWER_SOURCE = Path(__file__).with_name("file_follower.py").read_text()
_SYNC = b"\n:gputrace-follow-v1:\n"  # file_follower.SYNC: frames start after it
_TAIL_BYTES = 4096  # file_follower.TAIL_BYTES: the fingerprint of the content before the offset


@dataclass(frozen=True, slots=True)
class FilePosition:
    """Resume a file at byte ``offset`` of the file with ``inode`` (0: not started yet)."""

    inode: int
    offset: int


@dataclass(frozen=True, slots=True)
class CursorPosition:
    """Resume journald after this entry's ``__CURSOR``."""

    cursor: str


@dataclass(frozen=True, slots=True)
class SincePosition:
    """Resume ``docker logs`` at ``ts_ns``, skipping the ``seen`` lines already read at that time."""

    ts_ns: int
    seen: int


@dataclass(frozen=True, slots=True)
class LineCountPosition:
    """A command's output: ``lines`` already read (the command replays; that many are skipped)."""

    lines: int


Position = FilePosition | CursorPosition | SincePosition | LineCountPosition


@dataclass(frozen=True, slots=True)
class FollowedLine:
    """One complete log line (no newline) as received by the collector."""

    text: str
    recv_ts_ns: int  # time.time_ns() on the collector when the line's last byte arrived
    position: Position  # resume here to continue right after this line
    source_ts_ns: int | None = None  # the source's own timestamp (journald, docker), host clock


class _Decoder(Protocol):
    """Turns one source's stream into lines and knows how to resume it."""

    merge_stderr: bool
    problem: str | None  # why the source yields nothing right now (a file not there), else None
    gaps: list[str]  # what was lost or could not be told since the last feed (taken by the caller)

    def argv(self, python: str) -> list[str]: ...

    def feed(self, data: bytes, recv_ts_ns: int) -> list[FollowedLine]: ...

    def restart(self) -> None: ...


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace").removesuffix("\r")


class _FileDecoder:
    """Reads the framed output of file_follower.py; the position is that of the last full line."""

    merge_stderr = False

    def __init__(self, path: str, position: FilePosition | None, from_start: bool, poll_s: float) -> None:
        self.path = path
        self.problem: str | None = None
        self.gaps: list[str] = []
        self.poll_s = poll_s
        start = (0, 0 if from_start else -1)  # offset -1: the end of the file
        self.inode, self.offset = (position.inode, position.offset) if position else start
        self._frames = bytearray()
        self._synced = False
        self._pending = b""  # a partial line, from byte self.offset of self.inode
        self._dropped = 0  # bytes of that line past MAX_LINE_BYTES, not kept
        self._next = self.offset  # the offset the next data frame should start at
        # the last bytes of self.inode before self.offset (at most _TAIL_BYTES; empty: unknown): on
        # resume the host checks the file still holds them there, else it was truncated and regrown
        self._tail = b""

    def argv(self, python: str) -> list[str]:
        tail = self._tail
        return [python, "-c", _FILE_FOLLOWER_SOURCE, self.path, str(self.inode), str(self.offset),
                f"{self.poll_s:g}", str(len(tail)), hashlib.sha256(tail).hexdigest()]

    def restart(self) -> None:
        self._frames.clear()
        self._synced = False
        self._pending = b""
        self._dropped = 0

    def _flush_pending(self, out: list[FollowedLine], recv_ts_ns: int) -> None:
        # The file ended without a newline (rotated or truncated under a partial line).
        if self._pending:
            self.offset += len(self._pending) + self._dropped
            self._tail = (self._tail + self._pending)[-_TAIL_BYTES:] if not self._dropped else b""
            self._dropped = 0
            out.append(FollowedLine(_text(self._pending), recv_ts_ns, FilePosition(self.inode, self.offset)))
            self._pending = b""

    def feed(self, data: bytes, recv_ts_ns: int) -> list[FollowedLine]:
        frames = self._frames
        frames += data
        out: list[FollowedLine] = []
        start = 0
        if not self._synced:
            # Skip what the host's login scripts may have printed before the follower started.
            at = frames.find(_SYNC)
            if at < 0:
                del frames[:max(0, len(frames) - len(_SYNC))]
                return out
            if at > 0:
                log.info("follow_output_skipped", path=self.path, bytes=at, head=_text(bytes(frames[:80])))
            del frames[:at + len(_SYNC)]
            self._synced = True
        while True:
            eol = frames.find(b"\n", start)
            if eol < 0:
                break
            try:
                kind, inode_text, off_text, len_text = bytes(frames[start:eol]).split(b" ")
                length = int(len_text)
                inode, off = int(inode_text), int(off_text)
            except ValueError as exc:
                # A broken stream: reconnect and resume from the last complete line.
                head = bytes(frames[start:eol])[:60]
                raise TransportError(f"{self.path}: garbled follower output {head!r}") from exc
            if len(frames) < eol + 1 + length:
                break
            if kind == b"D":
                self._data(inode, off, bytes(frames[eol + 1:eol + 1 + length]), recv_ts_ns, out)
            elif kind == b"O":
                self.problem = None
                if (inode, off) != (self.inode, self._next):  # else it continues where we are
                    self._flush_pending(out, recv_ts_ns)
                    self.inode, self.offset, self._next, self._pending = inode, off, off, b""
                    self._dropped = 0
                    self._tail = b""
            elif kind == b"T":
                # the O frame that follows says where reading goes on (a copy, or the file at 0)
                log.info("log_truncated", path=self.path, inode=inode, at_offset=off)
            elif kind == b"K":
                copy = _text(bytes(frames[eol + 1:eol + 1 + length]))
                log.warning("log_truncated", path=self.path, at_offset=off, read_rest_from=copy)
                self.gaps.append(f"{self.path} was truncated in place at byte {off} before it was read "
                                 f"to its end: the rest was read from its copy {copy}; lines written "
                                 "between the copy and the truncation, if any, are lost")
                if off == self._next:
                    self.inode = inode  # the copy holds the same bytes up to off: go on in it
            elif kind == b"G":
                self._flush_pending(out, recv_ts_ns)
                log.warning("log_truncated", path=self.path, inode=inode, at_offset=off,
                            why="truncated in place and written past our offset before we read on; "
                                "no copy of the old content beside it")
                self.gaps.append(f"{self.path} was truncated in place and rewritten past byte {off} "
                                 "before it was read to its end, and no copy of the old content was "
                                 f"found beside it: what it held after byte {off} is lost")
            elif kind == b"W":
                self.problem = f"{self.path}: no such file on the host (followed once it appears)"
                log.warning("log_file_missing", path=self.path,
                            why="no such file on the host yet: following it once it appears; "
                                "check the path if the engine is already running")
            elif kind == b"L":
                log.warning("log_rotated_file_gone", path=self.path, inode=inode, after_offset=off,
                            why="the rotated file was removed before it was read to the end")
            start = eol + 1 + length
        del frames[:start]
        return out

    def _data(self, inode: int, off: int, data: bytes, recv_ts_ns: int, out: list[FollowedLine]) -> None:
        if inode != self.inode or off != self._next:
            log.warning("log_frame_out_of_order", path=self.path, inode=inode, offset=off,
                        expected_inode=self.inode, expected_offset=self._next)
            self._flush_pending(out, recv_ts_ns)
            self.inode, self.offset, self._tail = inode, off, b""
        self._next = off + len(data)
        joined = self._pending + data
        parts = joined.split(b"\n")
        self._pending = parts.pop()
        offset = self.offset
        whole_from = 0  # where in joined the bytes as the file holds them begin (after a cut line)
        at = 0
        for raw in parts:
            offset += len(raw) + 1 + self._dropped  # positions count every byte, cut ones too
            at += len(raw) + 1
            if self._dropped:
                whole_from, self._tail = at, b""
            self._dropped = 0
            out.append(FollowedLine(_text(raw[:MAX_LINE_BYTES]), recv_ts_ns, FilePosition(inode, offset)))
        self._tail = (self._tail + joined[whole_from:at])[-_TAIL_BYTES:]
        self.offset = offset
        if len(self._pending) > MAX_LINE_BYTES:
            # a "line" no engine writes (a file without newlines): keep its head, drop the rest,
            # so memory stays bounded (it grew with the file)
            if not self._dropped:
                log.warning("log_line_cut", path=self.path, max_bytes=MAX_LINE_BYTES)
            self._dropped += len(self._pending) - MAX_LINE_BYTES
            self._pending = self._pending[:MAX_LINE_BYTES]


class _LineDecoder:
    """Base for sources whose output is plain lines."""

    merge_stderr = True
    problem: str | None = None  # a stream of lines has no state of its own to report

    def __init__(self) -> None:
        self._pending = b""
        self.gaps: list[str] = []

    def restart(self) -> None:
        self._pending = b""

    def _lines(self, data: bytes) -> list[bytes]:
        parts = (self._pending + data).split(b"\n")
        # past the cap a line is cut (memory grew with a stream that sends no newline)
        self._pending = parts.pop()[:MAX_LINE_BYTES]
        return [part[:MAX_LINE_BYTES] for part in parts]


class _JournalDecoder(_LineDecoder):
    merge_stderr = False  # journalctl's own complaints stay out of the JSON stream

    def __init__(self, unit: str, position: CursorPosition | None, from_start: bool) -> None:
        super().__init__()
        self.unit = unit
        self.cursor = position.cursor if position else None
        self.from_start = from_start

    def argv(self, python: str) -> list[str]:
        # --all: without it journalctl writes fields over 4 KiB as null in JSON.
        argv = ["journalctl", "--unit", self.unit, "--output", "json", "--all", "--follow", "--no-pager"]
        if self.cursor is not None:
            return [*argv, "--lines", "all", "--after-cursor", self.cursor]
        return [*argv, "--lines", "all" if self.from_start else "0"]

    def feed(self, data: bytes, recv_ts_ns: int) -> list[FollowedLine]:
        out: list[FollowedLine] = []
        for raw in self._lines(data):
            try:
                entry = json.loads(raw)
                cursor = str(entry["__CURSOR"])
                ts_ns = int(entry["__REALTIME_TIMESTAMP"]) * 1000
            except (ValueError, KeyError, TypeError):
                log.warning("journal_entry_unreadable", unit=self.unit, line=_text(raw)[:200])
                continue
            message = entry.get("MESSAGE")
            if isinstance(message, list):  # journald sends non-UTF-8 messages as byte arrays
                message = bytes(b & 0xFF for b in message if isinstance(b, int)).decode("utf-8", "replace")
            self.cursor = cursor
            for text in str(message or "").split("\n"):
                out.append(FollowedLine(text.removesuffix("\r"), recv_ts_ns, CursorPosition(cursor), ts_ns))
        return out


def parse_docker_timestamp(text: str) -> int:
    """RFC 3339 with up to nanoseconds (``2026-06-24T12:00:00.123456789Z``) -> ns since the epoch."""
    match = _RFC3339.fullmatch(text)
    if match is None:
        raise ValueError(f"not an RFC 3339 timestamp: {text!r}")
    whole, frac, zone = match.groups()
    seconds = int(datetime.fromisoformat(whole + ("+00:00" if zone == "Z" else zone)).timestamp())
    return seconds * 1_000_000_000 + int((frac or "").ljust(9, "0")[:9])


class _DockerDecoder(_LineDecoder):
    def __init__(self, container: str, position: SincePosition | None, from_start: bool) -> None:
        super().__init__()
        self.container = container
        self.since = position
        self.from_start = from_start
        self._skip = position.seen if position else 0

    def argv(self, python: str) -> list[str]:
        argv = ["docker", "logs", "--follow", "--timestamps"]
        if self.since is not None:
            ts = self.since.ts_ns
            argv += ["--since", f"{ts // 1_000_000_000}.{ts % 1_000_000_000:09d}"]
        elif not self.from_start:
            argv += ["--tail", "0"]
        return [*argv, "--", self.container]

    def restart(self) -> None:
        super().restart()
        self._skip = self.since.seen if self.since else 0

    def feed(self, data: bytes, recv_ts_ns: int) -> list[FollowedLine]:
        out: list[FollowedLine] = []
        for raw in self._lines(data):
            stamp, _, rest = _text(raw).partition(" ")
            try:
                ts_ns = parse_docker_timestamp(stamp)
            except ValueError:
                log.warning("docker_line_unreadable", container=self.container, line=_text(raw)[:200])
                continue
            since = self.since
            if since is not None and (ts_ns < since.ts_ns or (ts_ns == since.ts_ns and self._skip > 0)):
                if ts_ns == since.ts_ns:
                    self._skip -= 1
                continue  # already read before the reconnect
            seen = since.seen + 1 if since is not None and since.ts_ns == ts_ns else 1
            self.since = SincePosition(ts_ns, seen)
            self._skip = 0
            out.append(FollowedLine(rest, recv_ts_ns, self.since, ts_ns))
        return out


class _CommandDecoder(_LineDecoder):
    """Any shell command; it must print the log from its start (it is restarted on reconnect)."""

    def __init__(self, command: str, position: LineCountPosition | None) -> None:
        super().__init__()
        self.command = command
        self.lines = position.lines if position else 0
        self._skip = self.lines

    def argv(self, python: str) -> list[str]:
        return ["sh", "-c", self.command]

    def restart(self) -> None:
        super().restart()
        self._skip = self.lines

    def feed(self, data: bytes, recv_ts_ns: int) -> list[FollowedLine]:
        out: list[FollowedLine] = []
        for raw in self._lines(data):
            if self._skip > 0:
                self._skip -= 1
                continue
            self.lines += 1
            out.append(FollowedLine(_text(raw), recv_ts_ns, LineCountPosition(self.lines)))
        return out


def _decoder_for(source: LogSource, position: Position | None, from_start: bool, poll_s: float) -> _Decoder:
    kind = source.kind
    if kind == "file" and (position is None or isinstance(position, FilePosition)):
        return _FileDecoder(source.target, position, from_start, poll_s)
    if kind == "journald" and (position is None or isinstance(position, CursorPosition)):
        return _JournalDecoder(source.target, position, from_start)
    if kind == "docker" and (position is None or isinstance(position, SincePosition)):
        return _DockerDecoder(source.target, position, from_start)
    if kind == "command" and (position is None or isinstance(position, LineCountPosition)):
        return _CommandDecoder(source.target, position)
    raise SourceError(f"cannot follow a {kind!r} log source from a {type(position).__name__}")


async def follow_log_batches(
    transport: Transport,
    source: LogSource,
    *,
    position: Position | None = None,
    from_start: bool = True,
    poll_s: float = 0.02,
    backoff: Backoff | None = None,
    on_caught_up: Callable[[], None] | None = None,
    on_problem: Callable[[str | None], None] | None = None,
    clock_ns: Callable[[], int] = time.time_ns,
) -> AsyncGenerator[list[FollowedLine], None]:
    """Follow ``source`` on ``transport``'s host forever; yields the lines of each chunk received.

    ``position`` resumes after a line seen before (``FollowedLine.position``); without one, start
    at the beginning (``from_start``) or at the end. Connection failures are retried with back-off;
    a HostKeyError, or a command that is missing on the host (exit 126/127), raises SourceError.
    ``on_caught_up`` is called once, after the first read that did not fill the read buffer: the
    follower is running and has read what the source held when it started (lines received from
    then on carry live receive times). ``on_problem`` is told why the source yields nothing (a
    file that is not there, a lost connection) when that starts, and None when it is over; a gap
    it could not avoid (a file truncated in place before it was read to its end, e.g. during an
    outage) is told as a problem over at once, with what was lost.
    ``clock_ns`` is the collector's clock, that receive times are read on.
    """
    caught_up = on_caught_up is None
    decoder = _decoder_for(source, position, from_start, poll_s)
    backoff = backoff or Backoff()
    attempt = 0
    where = f"{transport.host}: {source.kind} {source.target!r}"
    told: str | None = None

    def tell(problem: str | None) -> None:
        nonlocal told
        if problem != told and on_problem is not None:
            on_problem(problem)
        told = problem

    while True:
        stream: StreamedCommand | None = None
        try:
            stream = await transport.open_stream(decoder.argv(transport.python),
                                                 merge_stderr=decoder.merge_stderr)
            while data := await stream.read(_READ_BYTES):
                lines = decoder.feed(data, clock_ns())
                if lines:  # the source delivers again; output that is no line (docker's "cannot
                    attempt = 0  # connect" to a daemon that is down) must not reset the back-off
                for gap in decoder.gaps:  # recorded as a problem that is over at once
                    tell(gap)
                decoder.gaps.clear()
                tell(decoder.problem)
                if lines:
                    yield lines
                if not caught_up and len(data) < _READ_BYTES and on_caught_up is not None:
                    caught_up = True
                    on_caught_up()
        except HostKeyError:
            raise
        except TransportError as exc:
            log.warning("follow_disconnected", source=where, error=str(exc))
            tell(f"disconnected ({exc}): reconnecting")
        finally:
            if stream is not None:
                await stream.close()
        status = stream.exit_status() if stream is not None else None
        if status in (126, 127):
            raise SourceError(f"{where}: the follower cannot run on the host (exit {status}): "
                              f"{stream.stderr_tail().strip() if stream else ''}")
        if status:
            tail = follower_error(stream.stderr_tail()) if stream is not None else ""
            tell(f"the follower exited with status {status}{': ' + tail if tail else ''}; restarting it")
        decoder.restart()
        delay_s = backoff.delay_s(attempt)
        attempt += 1
        log.info("follow_reconnecting", source=where, exit_status=status, delay_s=round(delay_s, 3))
        await asyncio.sleep(delay_s)


def follower_error(stderr_tail: str) -> str:
    """A failed follower's stderr in one line for /healthz and meta.json: a Python traceback's
    last line (the error itself; the whole traceback went into /healthz), said plainly where
    the cause is the configured path."""
    lines = [line.strip() for line in stderr_tail.splitlines() if line.strip()]
    if not lines:
        return ""
    last = lines[-1]
    if last.startswith("IsADirectoryError"):
        return "the log path is a directory on the host, not a log file: check [hosts.log] path"
    return last[-200:]


async def follow_log(
    transport: Transport,
    source: LogSource,
    *,
    position: Position | None = None,
    from_start: bool = True,
    poll_s: float = 0.02,
    backoff: Backoff | None = None,
    clock_ns: Callable[[], int] = time.time_ns,
) -> AsyncGenerator[FollowedLine, None]:
    """Like ``follow_log_batches``, one line at a time."""
    batches = follow_log_batches(transport, source, position=position, from_start=from_start,
                                 poll_s=poll_s, backoff=backoff, clock_ns=clock_ns)
    try:
        async for batch in batches:
            for line in batch:
                yield line
    finally:
        await batches.aclose()
