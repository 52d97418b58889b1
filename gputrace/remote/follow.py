"""Follow a log source on a host (file, journald unit, docker container, any command) with resume:
reconnect with back-off and jitter, and continue from the last byte or cursor, so no line is lost
and none is seen twice. Each line carries its receive time and the position to resume after it.

Stop following by cancelling the consuming task, or with ``contextlib.aclosing``: the stream is
closed and the command ends on the host (see ``transport.watched_argv``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import re
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

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
_SYNC = b"\n:gputrace-follow-v2:\n"  # file_follower.SYNC: frames start after it
_TAIL_BYTES = 4096  # file_follower.TAIL_BYTES: the fingerprint of the content before the offset
_HEAD_BYTES = 256  # file_follower.HEAD_BYTES: the fingerprint of a file's first bytes
# a renamed file is read on until it is idle this long (a writer that keeps it open, as Python's
# logging does under logrotate's `create`), as Fluent Bit's rotate_wait (also 5 s)
ROTATE_WAIT_S = 5.0
# A command's rerun is checked against the output read before by the digests of its first lines,
# one by one, then of every _MARK_EVERY lines: at most that many of its lines wait in memory while
# it is checked (more only when resuming from a bare CommandPosition, up to _MAX_HELD)
_HEAD_MARKS = 16
_MARK_EVERY = 1024
_MAX_HELD = 100_000
# a rerun that goes silent (or ends) short of the lines read before is no replay of them (a log
# truncated during an outage, printed whole): decided once it has been silent this long
COMMAND_SILENT_S = 5.0


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
class CommandPosition:
    """A command's output: ``lines`` already read, and ``digest``, the digest of those lines
    (blake2b over each line and its newline). A rerun continues this output only if its first
    ``lines`` lines have this digest: matched by content, never by a count alone."""

    lines: int
    digest: bytes


Position = FilePosition | CursorPosition | SincePosition | CommandPosition


@dataclass(frozen=True, slots=True)
class FollowGap:
    """Log content the follower could not read (a file gone before it was read to its end, a
    command whose output no longer starts as it did): where, why, and what is known of its size."""

    where: str  # the file (or command)
    reason: str  # in words, for the capture's notes
    after_byte: int | None  # in the file's generation: content past this byte is lost
    after_line: int | None  # in a command's output: lines past this one may be lost
    # what the file held past after_byte when the follower last looked (more may have been written
    # after); None: it had seen nothing past it
    lost_bytes: int | None
    since_ns: int | None  # the receive time of the last line read before the gap (None: none read)
    found_ns: int  # when it was found (collector clock)

    def to_dict(self) -> dict[str, object]:
        return {"where": self.where, "reason": self.reason, "after_byte": self.after_byte,
                "after_line": self.after_line, "lost_bytes": self.lost_bytes,
                "since_ns": self.since_ns, "found_ns": self.found_ns}


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
    gaps: list[FollowGap]  # what was lost since the last feed (taken by the caller)

    def argv(self, python: str) -> list[str]: ...

    def feed(self, data: bytes, recv_ts_ns: int) -> list[FollowedLine]: ...

    def restart(self) -> None: ...

    def wait_s(self) -> float | None:
        """How long the output may stay silent before ``silent`` is told (None: for ever)."""
        ...

    def silent(self, recv_ts_ns: int, *, ended: bool) -> list[FollowedLine]:
        """The output stayed silent for ``wait_s``, or the command ended by itself (exit 0)."""
        ...


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace").removesuffix("\r")



@dataclass(frozen=True, slots=True)
class _Opened:
    """An O frame's payload: the generation read on (its inode, device, path and head) and the
    copy it was found in (``via``), if any."""

    ino: int
    dev: int
    path: str
    head: bytes
    via: str | None = None


@dataclass(slots=True)
class _Generation:
    """What the collector knows of one generation of a followed file (see file_follower.py): its
    identity (head, and the tail before ``offset``) and where reading it goes on."""

    key: str
    inode: int  # the inode it was first read from (lines' FilePosition)
    dev: int
    path: str
    offset: int  # right after the last full line received
    next: int  # where the next data frame starts
    head: bytes = b""
    tail: bytes = b""  # the bytes before offset, at most _TAIL_BYTES (empty: unknown)
    pending: bytes = b""  # a partial line, from byte offset
    dropped: int = 0  # bytes of that line past MAX_LINE_BYTES, not kept
    mtime_ns: int = 0  # the file's mtime when it was last read (host clock)
    seen: int = 0  # the size the file was last seen at, past offset when the follower is behind
    last_recv_ns: int | None = None  # when its last line arrived

    def checkpoint(self) -> dict[str, object]:
        return {"key": self.key, "ino": self.inode, "dev": self.dev, "off": self.offset,
                "head_len": len(self.head), "head_sha": hashlib.sha256(self.head).hexdigest(),
                "tail_len": len(self.tail), "tail_sha": hashlib.sha256(self.tail).hexdigest(),
                "mtime_ns": self.mtime_ns, "seen": max(self.seen, self.offset)}


class _FileDecoder:
    """Reads the framed output of file_follower.py, one generation of the file at a time (a rotated
    file read on beside the live one); a line's position is that of its generation's last full line.
    On reconnect every generation still open is handed back (its identity and offset), so the host
    finds each again wherever rotation put it."""

    merge_stderr = False

    def __init__(self, path: str, position: FilePosition | None, from_start: bool, poll_s: float,
                 rotate_wait_s: float = ROTATE_WAIT_S) -> None:
        self.path = path
        self.problem: str | None = None
        self.gaps: list[FollowGap] = []
        self.poll_s = poll_s
        self.rotate_wait_s = rotate_wait_s
        self.start = "begin" if from_start else "end"
        self.gens: dict[str, _Generation] = {}
        if position is not None:
            key = str(position.inode)
            self.gens[key] = _Generation(key, position.inode, 0, path, position.offset, position.offset)
        # the heads of generations read to their end: never read again from their start
        self.done: deque[tuple[int, str]] = deque(maxlen=64)
        self._frames = bytearray()
        self._synced = False

    def argv(self, python: str) -> list[str]:
        state = {"gens": [g.checkpoint() for g in self.gens.values()], "done": list(self.done),
                 "start": self.start}
        return [python, "-c", _FILE_FOLLOWER_SOURCE, self.path, f"{self.poll_s:g}",
                f"{self.rotate_wait_s:g}", json.dumps(state)]

    def restart(self) -> None:
        self._frames.clear()
        self._synced = False
        for gen in self.gens.values():
            gen.pending, gen.dropped, gen.next = b"", 0, gen.offset

    def wait_s(self) -> float | None:
        return None  # the host's follower itself decides when a renamed file is done with

    def silent(self, recv_ts_ns: int, *, ended: bool) -> list[FollowedLine]:
        return []

    @staticmethod
    def _flush_pending(gen: _Generation, out: list[FollowedLine], recv_ts_ns: int) -> None:
        # The file ended without a newline (rotated or truncated under a partial line).
        if gen.pending:
            gen.offset += len(gen.pending) + gen.dropped
            gen.tail = (gen.tail + gen.pending)[-_TAIL_BYTES:] if not gen.dropped else b""
            gen.dropped = 0
            out.append(FollowedLine(_text(gen.pending), recv_ts_ns, FilePosition(gen.inode, gen.offset)))
            gen.pending = b""
        gen.next = gen.offset

    def _ended(self, key: str, out: list[FollowedLine], recv_ts_ns: int) -> _Generation | None:
        gen = self.gens.pop(key, None)
        if gen is not None:
            self._flush_pending(gen, out, recv_ts_ns)
            if gen.head:
                self.done.append((len(gen.head), hashlib.sha256(gen.head).hexdigest()))
        return gen

    def _gap(self, gen: _Generation | None, off: int, reason: str, lost_bytes: int | None,
             recv_ts_ns: int) -> None:
        where = gen.path if gen is not None else self.path
        log.warning("log_gap", path=where, after_byte=off, lost_bytes=lost_bytes, why=reason)
        self.gaps.append(FollowGap(where, reason, off, None, lost_bytes,
                                   gen.last_recv_ns if gen is not None else None, recv_ts_ns))

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
                kind, key_raw, off_text, len_text, mtime_text = bytes(frames[start:eol]).split(b" ")
                length, off, mtime_ns = int(len_text), int(off_text), int(mtime_text)
                key = key_raw.decode("ascii")
            except ValueError as exc:
                # A broken stream: reconnect and resume from the last complete line.
                head = bytes(frames[start:eol])[:60]
                raise TransportError(f"{self.path}: garbled follower output {head!r}") from exc
            if len(frames) < eol + 1 + length:
                break
            payload = bytes(frames[eol + 1:eol + 1 + length])
            start = eol + 1 + length
            if kind == b"D":
                self._data(key, off, payload, mtime_ns, recv_ts_ns, out)
            elif kind == b"O":
                self._opened(key, off, self._opened_frame(payload), out, recv_ts_ns)
            elif kind == b"X":
                self._ended(key, out, recv_ts_ns)
            elif kind == b"G":
                gen = self._ended(key, out, recv_ts_ns)
                info = json.loads(payload)
                lost = info.get("lost_bytes")
                size = (f" (at least {lost:,} bytes: what it held when last seen)" if lost is not None
                        else " (its size unknown: written after the follower last looked)")
                self._gap(gen, off, f"{gen.path if gen else self.path}: what it held past byte {off}{size} "
                          f"is lost: {info['why']}", lost, recv_ts_ns)
            elif kind == b"K":
                gen = self.gens.get(key)
                info = json.loads(payload)
                lost = int(info["lost_bytes"])
                self._gap(gen, off, f"{self.path} was truncated in place before it was read to its end; "
                          f"the rest was read from its copy {info['copy']}, which ends at byte {off}, "
                          f"{lost:,} bytes short of what the file held when last seen: those bytes, "
                          "written between the copy and the truncation, are lost", lost, recv_ts_ns)
            elif kind == b"S":
                if (gen := self.gens.get(key)) is not None:
                    gen.seen = max(gen.seen, off)
            elif kind == b"W":
                self.problem = f"{self.path}: no such file on the host (followed once it appears)"
                log.warning("log_file_missing", path=self.path,
                            why="no such file on the host yet: following it once it appears; "
                                "check the path if the engine is already running")
        del frames[:start]
        return out

    def _opened_frame(self, payload: bytes) -> _Opened:
        """An O frame's payload; TransportError (reconnect, as for a garbled frame) when it is none."""
        try:
            info = json.loads(payload)
            ino, dev, path, head, via = info["ino"], info["dev"], info["path"], info["head"], info.get("via")
            if not (isinstance(ino, int) and isinstance(dev, int) and isinstance(path, str)
                    and isinstance(head, str) and (via is None or isinstance(via, str))):
                raise ValueError("ino, dev, path, head or via of the wrong type")
            return _Opened(ino, dev, path, bytes.fromhex(head), via)
        except (ValueError, KeyError, TypeError) as exc:
            raise TransportError(f"{self.path}: garbled follower output {payload[:60]!r}: {exc}") from exc

    def _opened(self, key: str, off: int, info: _Opened, out: list[FollowedLine], recv_ts_ns: int) -> None:
        self.problem = None
        gen = self.gens.get(key)
        if gen is None:
            head = info.head
            self.gens[key] = _Generation(key, info.ino, info.dev, info.path, off, off,
                                         head, head[:off] if off <= len(head) else b"")
            return
        gen.dev, gen.path = gen.dev or info.dev, info.path
        if info.via:
            log.info("log_generation_found", path=self.path, read_on_from=info.via, at_offset=off)
        if off != gen.next:
            log.warning("log_frame_out_of_order", path=self.path, offset=off, expected_offset=gen.next)
            self._flush_pending(gen, out, recv_ts_ns)
            gen.offset, gen.next, gen.tail = off, off, b""

    def _data(self, key: str, off: int, data: bytes, mtime_ns: int, recv_ts_ns: int,
              out: list[FollowedLine]) -> None:
        gen = self.gens.get(key)
        if gen is None:
            log.warning("log_frame_unknown_file", path=self.path, key=key, offset=off)
            inode = int(key.partition(".")[0])
            gen = self.gens[key] = _Generation(key, inode, 0, self.path, off, off)
        elif off != gen.next:
            log.warning("log_frame_out_of_order", path=gen.path, offset=off, expected_offset=gen.next)
            self._flush_pending(gen, out, recv_ts_ns)
            gen.offset, gen.tail = off, b""
        if off <= len(gen.head) < _HEAD_BYTES:
            gen.head += data[len(gen.head) - off:_HEAD_BYTES - off]
        gen.next = off + len(data)
        gen.mtime_ns, gen.last_recv_ns = mtime_ns, recv_ts_ns
        joined = gen.pending + data
        parts = joined.split(b"\n")
        gen.pending = parts.pop()
        offset = gen.offset
        whole_from = 0  # where in joined the bytes as the file holds them begin (after a cut line)
        at = 0
        for raw in parts:
            offset += len(raw) + 1 + gen.dropped  # positions count every byte, cut ones too
            at += len(raw) + 1
            if gen.dropped:
                whole_from, gen.tail = at, b""
            gen.dropped = 0
            out.append(FollowedLine(_text(raw[:MAX_LINE_BYTES]), recv_ts_ns, FilePosition(gen.inode, offset)))
        gen.tail = (gen.tail + joined[whole_from:at])[-_TAIL_BYTES:]
        gen.offset = offset
        if len(gen.pending) > MAX_LINE_BYTES:
            # a "line" no engine writes (a file without newlines): keep its head, drop the rest,
            # so memory stays bounded (it grew with the file)
            if not gen.dropped:
                log.warning("log_line_cut", path=gen.path, max_bytes=MAX_LINE_BYTES)
            gen.dropped += len(gen.pending) - MAX_LINE_BYTES
            gen.pending = gen.pending[:MAX_LINE_BYTES]


class _LineDecoder:
    """Base for sources whose output is plain lines."""

    merge_stderr = True
    problem: str | None = None  # a stream of lines has no state of its own to report

    def __init__(self) -> None:
        self._pending = b""
        self.gaps: list[FollowGap] = []

    def restart(self) -> None:
        self._pending = b""

    def wait_s(self) -> float | None:
        return None

    def silent(self, recv_ts_ns: int, *, ended: bool) -> list[FollowedLine]:
        return []

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


def _line_digest() -> Any:
    return hashlib.blake2b(digest_size=16)


@dataclass(slots=True)
class _Rerun:
    """A rerun of a command (after an outage) while it is checked against the output read before:
    its lines are held until a digest of the earlier output says they are the same (then dropped:
    read already) or not (then read: the log was truncated or restarted meanwhile)."""

    hash: Any = dataclasses.field(default_factory=_line_digest)
    count: int = 0  # its lines so far
    same: int = 0  # its first lines known to be those read before
    same_hash: Any = None  # the digest state after them
    held: deque[bytes] = dataclasses.field(default_factory=deque)  # its lines past `same`
    unkept: int = 0  # held lines let go past _MAX_HELD (lost if the rerun turns out to differ)


class _CommandDecoder(_LineDecoder):
    """Any shell command that prints the log from its start; rerun on reconnect. Its rerun's output
    is matched by content against what was read: the same lines are skipped, exactly those; output
    that no longer starts with them (a log truncated, or a container restarted, meanwhile) is read
    whole from its start, and the lines the earlier output may have had past the last one read are
    recorded as a gap."""

    def __init__(self, command: str, position: CommandPosition | None,
                 silent_s: float = COMMAND_SILENT_S) -> None:
        super().__init__()
        self.command = command
        self.silent_s = silent_s
        self.lines = 0  # of the current output, read
        self.hash = _line_digest()  # of those lines
        self.marks: dict[int, bytes] = {}  # line count -> the digest of the lines up to it
        self.last_recv_ns: int | None = None
        self.rerun: _Rerun | None = None
        if position is not None and position.lines > 0:
            # a digest state cannot be rebuilt from a digest: the rerun's own, once it matches
            self.lines, self.marks[position.lines] = position.lines, position.digest
            self.rerun = _Rerun()

    def argv(self, python: str) -> list[str]:
        return ["sh", "-c", self.command]

    def restart(self) -> None:
        super().restart()
        if self.lines > 0:
            self.marks.setdefault(self.lines, self.hash.digest())
            self.rerun = _Rerun()

    def wait_s(self) -> float | None:
        # a rerun that printed nothing yet is waited for (a tool still connecting)
        return self.silent_s if self.rerun is not None and self.rerun.count > 0 else None

    def silent(self, recv_ts_ns: int, *, ended: bool) -> list[FollowedLine]:
        out: list[FollowedLine] = []
        rerun = self.rerun
        if rerun is not None and (ended or rerun.count > 0):
            self._differs(f"it {'ended' if ended else 'stopped'} after {rerun.count} lines", recv_ts_ns, out)
        return out

    def feed(self, data: bytes, recv_ts_ns: int) -> list[FollowedLine]:
        out: list[FollowedLine] = []
        for raw in self._lines(data):
            if self.rerun is None:
                self._read(raw, recv_ts_ns, out)
            else:
                self._check(self.rerun, raw, recv_ts_ns, out)
        return out

    def _read(self, raw: bytes, recv_ts_ns: int, out: list[FollowedLine]) -> None:
        self.hash.update(raw)
        self.hash.update(b"\n")
        self.lines += 1
        digest = self.hash.digest()
        if self.lines <= _HEAD_MARKS or self.lines % _MARK_EVERY == 0:
            self.marks[self.lines] = digest
        self.last_recv_ns = recv_ts_ns
        out.append(FollowedLine(_text(raw), recv_ts_ns, CommandPosition(self.lines, digest)))

    def _check(self, rerun: _Rerun, raw: bytes, recv_ts_ns: int, out: list[FollowedLine]) -> None:
        rerun.hash.update(raw)
        rerun.hash.update(b"\n")
        rerun.count += 1
        rerun.held.append(raw)
        want = self.marks.get(rerun.count)
        if want is None:
            if len(rerun.held) > _MAX_HELD:
                rerun.held.popleft()
                rerun.unkept += 1
            return
        if rerun.hash.digest() != want:
            self._differs(f"its first {rerun.count} lines differ", recv_ts_ns, out)
            return
        rerun.same, rerun.same_hash, rerun.unkept = rerun.count, rerun.hash.copy(), 0
        rerun.held.clear()
        if rerun.count == self.lines:  # it replayed exactly what was read: go on after it
            self.hash, self.rerun = rerun.hash, None

    def _differs(self, why: str, recv_ts_ns: int, out: list[FollowedLine]) -> None:
        rerun, read = self.rerun, self.lines
        assert rerun is not None
        self.rerun = None
        unkept = (f"{rerun.unkept} lines of the rerun, let go while it was checked, and "
                  if rerun.unkept else "")
        reason = (f"{self.command!r}: its output, rerun, no longer starts with the {read} lines read "
                  f"before ({why}: the log was truncated or restarted meanwhile); read from "
                  + (f"line {rerun.same + 1}, the lines before it the same" if rerun.same else "its start")
                  + f"; {unkept}what the earlier output held past line {read}, if anything, is lost")
        log.warning("log_gap", command=self.command, after_line=read, why=why)
        self.gaps.append(FollowGap(self.command, reason, None, read, None, self.last_recv_ns, recv_ts_ns))
        self.lines = rerun.same
        self.hash = rerun.same_hash if rerun.same_hash is not None else _line_digest()
        self.marks = {lines: digest for lines, digest in self.marks.items() if lines <= rerun.same}
        for raw in rerun.held:
            self._read(raw, recv_ts_ns, out)


def _decoder_for(source: LogSource, position: Position | None, from_start: bool, poll_s: float) -> _Decoder:
    kind = source.kind
    if kind == "file" and (position is None or isinstance(position, FilePosition)):
        return _FileDecoder(source.target, position, from_start, poll_s)
    if kind == "journald" and (position is None or isinstance(position, CursorPosition)):
        return _JournalDecoder(source.target, position, from_start)
    if kind == "docker" and (position is None or isinstance(position, SincePosition)):
        return _DockerDecoder(source.target, position, from_start)
    if kind == "command" and (position is None or isinstance(position, CommandPosition)):
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
    on_gap: Callable[[FollowGap], None] | None = None,
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
    outage) is told to ``on_gap`` with what is known of it, else as a problem over at once.
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

    def take_gaps() -> None:
        for gap in decoder.gaps:
            if on_gap is not None:
                on_gap(gap)
            else:  # told as a problem that is over at once
                tell(gap.reason)
        decoder.gaps.clear()

    while True:
        stream: StreamedCommand | None = None
        try:
            stream = await transport.open_stream(decoder.argv(transport.python),
                                                 merge_stderr=decoder.merge_stderr)
            while True:
                wait_s = decoder.wait_s()
                try:  # a stream's read keeps its data when cancelled
                    data: bytes | None = await (stream.read(_READ_BYTES) if wait_s is None else
                                                asyncio.wait_for(stream.read(_READ_BYTES), wait_s))
                except TimeoutError:
                    data = None
                if data == b"":
                    break
                if data is None:
                    lines = decoder.silent(clock_ns(), ended=False)
                else:
                    lines = decoder.feed(data, clock_ns())
                if lines:  # the source delivers again; output that is no line (docker's "cannot
                    attempt = 0  # connect" to a daemon that is down) must not reset the back-off
                take_gaps()
                tell(decoder.problem)
                if lines:
                    yield lines
                if (not caught_up and data is not None and len(data) < _READ_BYTES
                        and on_caught_up is not None):
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
        if status == 0:  # the command printed all it had: a rerun short of what was read differs
            lines = decoder.silent(clock_ns(), ended=True)
            take_gaps()
            if lines:
                yield lines
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
