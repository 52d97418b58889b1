"""Runs ON the followed host (sent as ``python3 -c``): follows one log path through rotation and
writes framed chunks (``KIND KEY OFFSET LENGTH MTIME_NS\\n`` + payload) so the collector can resume
exactly. The frames follow a ``SYNC`` line, so that whatever a login script printed before is skipped.

The log is followed by identity, not by position, as Fluent Bit and Vector do. A *generation* is
one stream of content from its byte 0 (a file from its creation to its truncation or removal); it is
known by KEY (``INODE.TOKEN``, the inode it was first read from), by its device and inode, by its
head (its first HEAD_BYTES, fewer while it is shorter) and by the TAIL_BYTES before the read offset.
On every read and every reconnect:
- a file that shrank, or whose head or tail changed (truncated in place, even if regrown past the
  offset since), is a new generation; the old one is read on from a copy beside the path whose
  content matches (copytruncate's ``.1``, ``.2``, a ``.gz``), else its unread rest is lost (G);
- generations rotated away are found by inode (renamed) or by content (copied, compressed) and read
  on from their offsets, in rotation order, before the live file; generations rotated after them that
  were never seen (two rotations in one outage) are read from their start;
- a renamed file is read on while it is written (a writer that keeps it open, as Python's logging
  does under logrotate's ``create``) and dropped once idle ROTATE_WAIT seconds (X).

Frames: O reading KEY goes on at OFFSET (payload: JSON with ino, dev, path, head as hex, via);
D data of KEY at OFFSET (MTIME_NS: the file's mtime when read); S KEY's file was seen OFFSET bytes
long, past what was read (the follower is behind: the collector hands it back on reconnect, so what
a file gone since held past its offset is known); X KEY read to its end, dropped;
G KEY's content past OFFSET is lost (payload: JSON with why and lost_bytes: what the file held past
OFFSET when last seen, more may have been written after; null when nothing was seen past it);
K KEY, continued from a copy after a truncation, ends at OFFSET in the copy, short of what the file
was seen to hold before it was truncated: those bytes, written between the copy and the truncation,
are in no file (payload: the copy's path and lost_bytes); W no file at the path yet.
Kept to Python 3.6 syntax: hosts run whatever python3 their distribution ships.
"""

import contextlib
import gzip
import hashlib
import io
import json
import os
import re
import select
import stat
import sys
import time
from typing import IO, Any, Callable, Dict, List, Optional, Set, Tuple  # Python 3.6: no X | None

CHUNK_BYTES = 1 << 16
SYNC = b"\n:gputrace-follow-v2:\n"
HEAD_BYTES = 256  # the identity of a generation: its first line or two (a timestamp and more)
TAIL_BYTES = 4096  # the content before the offset: a line of an engine log is 100-300 bytes
# each compressed copy's reader over the copy's open file (BZ2File and LZMAFile take the file as
# their first argument: a fileobj= keyword, GzipFile's, was a TypeError on every .bz2 and .xz copy)
Opener = Callable[[IO[bytes]], io.BufferedIOBase]
OPENERS = {".gz": lambda raw: gzip.GzipFile(fileobj=raw)}  # type: Dict[str, Opener]
BROKEN = (EOFError, OSError, ValueError)  # type: tuple[type[Exception], ...]  # a copy cut short
with contextlib.suppress(ImportError):  # a Python built without them reads .gz copies only
    import bz2

    OPENERS[".bz2"] = bz2.BZ2File
with contextlib.suppress(ImportError):
    import lzma

    OPENERS[".xz"] = lzma.LZMAFile
    BROKEN += (lzma.LZMAError,)
Candidate = Tuple[str, os.stat_result]  # a file beside the path and its stat
NUMBERED = re.compile(r"[.-](\d+)(?:\.(?:gz|bz2|xz))?$")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Source:
    """One file on disk that a generation is read from: plain (read by offset, it may still grow)
    or compressed (decompressed in sequence)."""

    def __init__(self, path: str, fd: int, st: os.stat_result) -> None:
        self.path, self.fd = path, fd
        self.dev, self.ino, self.mtime_ns = st.st_dev, st.st_ino, st.st_mtime_ns
        self.opener = OPENERS.get(os.path.splitext(path)[1])
        self.stream = None  # type: Any
        self.raw = None  # type: Any

    @classmethod
    def open(cls, path: str) -> "Optional[Source]":
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        return cls(path, fd, os.fstat(fd))

    def read(self, off: int, length: int) -> bytes:
        if off < 0 or length <= 0:
            return b""
        if self.opener is None:
            return os.pread(self.fd, length, off)
        try:
            if self.stream is None or self.stream.tell() > off:
                self.close_stream()
                self.raw = os.fdopen(os.dup(self.fd), "rb")
                self.raw.seek(0)  # a dup shares the offset the last stream left
                self.stream = self.opener(self.raw)
            self.stream.seek(off)
            data = self.stream.read(length)  # type: bytes
            return data
        except BROKEN:
            return b""  # a compressed copy still being written, or broken: nothing (more) from it

    def size(self) -> Optional[int]:
        return os.fstat(self.fd).st_size if self.opener is None else None

    def close_stream(self) -> None:
        for handle in (self.stream, self.raw):
            if handle is not None:
                with contextlib.suppress(OSError, EOFError):
                    handle.close()
        self.stream = self.raw = None

    def close(self) -> None:
        self.close_stream()
        with contextlib.suppress(OSError):
            os.close(self.fd)


class Gen:
    """One generation being read: KEY, from SRC at POS; HEAD and TAIL as read."""

    def __init__(self, key: str, src: Source, pos: int, head: bytes, tail: bytes, keep: bool) -> None:
        self.key, self.src, self.pos, self.head, self.tail = key, src, pos, head, tail
        self.keep = keep  # it may still be written: read until idle (else: read to its end)
        self.idle_since = time.time()
        self.seen_size = pos
        self.opened_ns = int(time.time() * 1e9)
        self.unseen = False
        # read from a copy after the file was truncated: the size the file was seen at before (what
        # the copy lacks of it is lost); None: not a copy, or nothing seen
        self.before_cut = None  # type: Optional[int]

    def changed(self) -> bool:
        """Whether the file no longer holds this generation's content (truncated in place)."""
        if self.tail and self.src.read(self.pos - len(self.tail), len(self.tail)) != self.tail:
            return True
        return bool(self.head) and self.src.read(0, len(self.head)) != self.head

    def took(self, data: bytes) -> None:
        if self.pos < HEAD_BYTES and len(self.head) >= self.pos:
            self.head = (self.head + data[max(0, len(self.head) - self.pos):])[:HEAD_BYTES]
        self.pos += len(data)
        self.tail = (self.tail + data)[-TAIL_BYTES:]
        self.seen_size = max(self.seen_size, self.pos)
        self.idle_since = time.time()


def same_head(src: Source, head_len: int, head_sha: str) -> bool:
    return head_len > 0 and sha(src.read(0, head_len)) == head_sha


def holds(src: Source, known: Dict[str, Any]) -> bool:
    """Whether ``src`` holds the known generation's content up to its offset."""
    off, tail_len = known["off"], known["tail_len"]
    if not known["head_len"] and not tail_len:
        return False
    if known["head_len"] and not same_head(src, known["head_len"], known["head_sha"]):
        return False
    if tail_len and sha(src.read(off - tail_len, tail_len)) != known["tail_sha"]:
        return False
    return off == 0 or len(src.read(off - 1, 1)) == 1


def new_key(ino: int) -> str:
    return "%d.%s" % (ino, os.urandom(4).hex())


class Follower:
    def __init__(self, path: str, poll_s: float, rotate_wait_s: float, out_fd: int) -> None:
        self.path, self.poll_s, self.rotate_wait_s, self.out_fd = path, poll_s, rotate_wait_s, out_fd
        self.folder, self.base = os.path.split(path)
        self.live = None  # type: Optional[Gen]  # the generation at the path
        self.old = []  # type: List[Gen]  # generations rotated away (renamed, copied, compressed), read first, in order
        # when the live file was last known to hold the generation read (a truncation or a rename
        # seen): a copy made since, before the new file is read, is a generation in between
        self.since_ns = None  # type: Optional[int]
        self.done = []  # type: List[Tuple[int, str]]  # (head length, head sha) of generations read to their end
        os.set_blocking(out_fd, False)

    # -- output ------------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.out_fd, view):]
            except BlockingIOError:
                select.select([], [self.out_fd], [], self.poll_s)

    def frame(self, kind: bytes, key: str, off: int, data: bytes = b"", mtime_ns: int = 0) -> None:
        self.write(b"%s %s %d %d %d\n" % (kind, key.encode(), off, len(data), mtime_ns) + data)

    def opened(self, gen: Gen, via: Optional[str] = None) -> None:
        info = {"ino": gen.src.ino, "dev": gen.src.dev, "path": gen.src.path, "head": gen.head.hex(),
                "via": via}
        self.frame(b"O", gen.key, gen.pos, json.dumps(info).encode())

    def copied(self, key: str, off: int, path: str, lost_bytes: int) -> None:
        self.frame(b"K", key, off, json.dumps({"copy": path, "lost_bytes": lost_bytes}).encode())

    def lost(self, key: str, off: int, why: str, lost_bytes: Optional[int] = None) -> None:
        self.frame(b"G", key, off, json.dumps({"why": why, "lost_bytes": lost_bytes}).encode())

    # -- the files beside the path -------------------------------------------------------------

    def siblings(self, skip_inodes: Set[Tuple[int, int]]) -> List[Candidate]:
        """Rotated files beside the path (``server.log.1``, ``server.log.2.gz``, ``server.log-2026…``),
        oldest first."""
        found, names = [], []  # type: List[Candidate], List[str]
        try:
            entries = list(os.scandir(self.folder or "."))
        except OSError:
            return found  # no such folder (yet): nothing beside the path
        for entry in entries:
            if not entry.name.startswith(self.base) or entry.name == self.base:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            # empty ones too: a generation renamed while still empty is found by its inode (an
            # empty file is never read from its start: queue_later skips it)
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in skip_inodes:
                found.append((os.path.join(self.folder, entry.name), st))
                names.append(entry.name[len(self.base):])
        # oldest first by mtime (a rotated file is not written after the next one begins); files
        # rotated in the same tick by their number (logrotate's .1 is newer than .2)
        numbers = [NUMBERED.search(name) for name in names]
        keys = [(st.st_mtime_ns, -int(m.group(1)) if m else 0, path)
                for (path, st), m in zip(found, numbers)]
        return [item for _, item in sorted(zip(keys, found))]

    def open_inodes(self) -> Set[Tuple[int, int]]:
        gens = self.old + ([self.live] if self.live else [])
        return set((g.src.dev, g.src.ino) for g in gens)

    def known_heads(self) -> List[Tuple[int, str]]:
        gens = self.old + ([self.live] if self.live else [])
        return list(self.done) + [(len(g.head), sha(g.head)) for g in gens if g.head]

    def locate(self, known: Dict[str, Any], candidates: List[Candidate]) -> Tuple[Optional[Source], bool]:
        """The file that holds a known generation: by device and inode, else by content (a copy,
        a compressed copy, a file put in its place); plain files before compressed ones."""
        by_inode = [c for c in candidates if c[1].st_ino == known["ino"]
                    and (not known["dev"] or c[1].st_dev == known["dev"])]
        rest = [c for c in candidates if c not in by_inode]
        rest.sort(key=lambda c: c[0].endswith(tuple(OPENERS)))
        for path, st in by_inode + rest:
            src = Source.open(path)
            if src is None:
                continue
            ours = not known["head_len"] and not known["tail_len"] and (src.size() or 0) >= known["off"]
            if (ours and (path, st) in by_inode) or holds(src, known):
                return src, (path, st) in by_inode
            src.close()
        return None, False

    def queue_later(self, candidates: List[Candidate], after: Optional[str], since_mtime_ns: int,
                    heads: List[Tuple[int, str]]) -> None:
        """Generations rotated after ``after`` (a path; None: modified since ``since_mtime_ns``) that
        were never read: read from their start, oldest first."""
        paths = [p for p, _ in candidates]
        later = candidates[paths.index(after) + 1:] if after in paths else [
            c for c in candidates if c[1].st_mtime_ns >= since_mtime_ns]
        for path, _ in later:
            src = Source.open(path)
            if src is None:
                continue
            if any(same_head(src, n, h) for n, h in heads) or not src.read(0, 1):
                src.close()  # read already, or being read (the copy of the live file, not yet truncated)
                continue
            head = src.read(0, HEAD_BYTES)
            gen = Gen(new_key(src.ino), src, 0, head, b"", keep=src.opener is None)
            self.old.append(gen)
            self.opened(gen)
            heads.append((len(head), sha(head)))

    def live_heads(self) -> List[Tuple[int, str]]:
        st = self.path_stat()
        if st is None:
            return []
        src = Source.open(self.path)
        if src is None:
            return []
        head = src.read(0, HEAD_BYTES)
        src.close()
        return [(len(head), sha(head))] if head else []

    def path_stat(self) -> Optional[os.stat_result]:
        try:
            return os.stat(self.path)
        except OSError:
            return None

    # -- resuming --------------------------------------------------------------------------------

    def resume(self, state: Dict[str, Any]) -> bool:
        """Find every generation the collector was reading and read each on from its offset; then
        those rotated after them and never seen; then the file at the path."""
        self.done = [tuple(d) for d in state.get("done", [])]
        gens = sorted(state.get("gens", []), key=lambda k: k.get("mtime_ns", 0))
        # generations the collector reads are never read again from their start
        self.done += [(k["head_len"], k["head_sha"]) for k in gens if k["head_len"]]
        candidates = self.siblings(set())
        at_path = self.path_stat()
        here = [(self.path, at_path)] if at_path is not None else []
        newest = -1  # where in candidates the newest generation found beside the path is
        for known in gens:
            src, same_inode = self.locate(known, here + candidates)
            in_place = at_path is not None and at_path.st_ino == known["ino"]
            seen = known.get("seen", 0)
            if src is None:
                self.lost(known["key"], known["off"], (
                    "%s was truncated in place before it was read to its end and no copy of the old "
                    "content was found beside it" if in_place else "%s was rotated away, and no file "
                    "beside it holds its content any more (removed, or replaced)") % self.path,
                    seen - known["off"] if seen > known["off"] else None)
                continue
            head, off = src.read(0, known["head_len"]), known["off"]
            gen = Gen(known["key"], src, off, head, src.read(off - known["tail_len"], known["tail_len"]),
                      keep=same_inode and src.opener is None)
            gen.seen_size = max(off, seen)
            if src.path == self.path and self.live is None:
                self.live = gen
            else:
                self.old.append(gen)
                paths = [p for p, _ in candidates]
                newest = max(newest, paths.index(src.path) if src.path in paths else -1)
            self.opened(gen, None if same_inode else src.path)
            if in_place and not same_inode:
                # truncated in place after a copy (copytruncate): what the file was seen to hold
                # past the copy's end (written between the copy and the truncation) is in neither
                # file; known once the copy is read to its end
                gen.before_cut = gen.seen_size
        # then the generations rotated after them that were never read, oldest first
        heads = self.known_heads() + self.live_heads()
        if newest >= 0:
            self.queue_later(candidates, candidates[newest][0], 0, heads)
        elif gens and not self.old and self.live is None:
            # none found anywhere: what was rotated since the newest was last read is read whole
            self.queue_later(candidates, None, max(k.get("mtime_ns", 0) for k in gens), heads)
        return bool(gens)

    def open_live(self, at_end: bool) -> None:
        """Open the file at the path as a new generation (once it is there): from its start, or
        from its end (``at_end``, the first time only, when it is there already)."""
        told = False
        while True:
            src = Source.open(self.path)
            if src is not None:
                break
            if not told:  # say it once: a wrong path must not look like an idle engine
                self.frame(b"W", "0", 0)
                told = True
            self.pump_old()
            time.sleep(self.poll_s)
        pos = (src.size() or 0) if at_end and not told else 0
        live = Gen(new_key(src.ino), src, pos, src.read(0, HEAD_BYTES),
                   src.read(pos - TAIL_BYTES, min(pos, TAIL_BYTES)), keep=True)
        live.unseen = not pos  # nothing of it read yet
        if self.since_ns is not None:
            live.opened_ns, self.since_ns = self.since_ns, None
        self.live = live
        self.opened(live)

    # -- reading ---------------------------------------------------------------------------------

    def pump(self, gen: Gen, verify: bool) -> bool:
        """Read ``gen`` on to its end (now); False when it changed under us (``verify``: a file that
        may be truncated in place), else True."""
        while True:
            data = gen.src.read(gen.pos, CHUNK_BYTES)
            if verify and gen.changed():
                return False  # read after the check could be new content: checked again after the read
            if not data:
                size = gen.src.size()
                if size is not None:
                    gen.seen_size = max(gen.seen_size, size)
                return True
            st = os.fstat(gen.src.fd)
            self.frame(b"D", gen.key, gen.pos, data, st.st_mtime_ns)
            gen.took(data)
            if gen.src.opener is None and st.st_size > gen.seen_size:
                # behind: the collector keeps the size, so a reconnect that finds the file gone
                # knows what it held past the offset
                gen.seen_size = st.st_size
                self.frame(b"S", gen.key, st.st_size)

    def drop(self, gen: Gen) -> None:
        self.old.remove(gen)
        if gen.before_cut is not None and gen.pos < gen.before_cut:
            self.copied(gen.key, gen.pos, gen.src.path, gen.before_cut - gen.pos)
        gen.src.close()
        if gen.head:
            self.done.append((len(gen.head), sha(gen.head)))
            del self.done[:-64]
        self.frame(b"X", gen.key, gen.pos)

    def pump_old(self) -> None:
        for gen in list(self.old):
            self.pump(gen, verify=False)
            if not gen.keep or time.time() - gen.idle_since >= self.rotate_wait_s:
                self.drop(gen)

    def truncated(self, gen: Gen) -> None:
        """The live file was truncated in place (and maybe written again): its generation is read on
        from a copy beside the path, if one holds it, then the generations copied after it."""
        self.since_ns = int(time.time() * 1e9)
        known = {"key": gen.key, "ino": -1, "dev": 0, "off": gen.pos, "head_len": len(gen.head),
                 "head_sha": sha(gen.head), "tail_len": len(gen.tail), "tail_sha": sha(gen.tail)}
        candidates = self.siblings(self.open_inodes())
        src, _ = self.locate(known, candidates)
        self.live = None
        if src is not None:
            old = Gen(gen.key, src, gen.pos, gen.head, gen.tail, keep=False)
            old.before_cut = gen.seen_size  # what the copy lacks of it is told once it is read
            self.old.append(old)
            self.opened(old, src.path)
        else:
            lost = gen.seen_size - gen.pos
            self.lost(gen.key, gen.pos, "%s was truncated in place before it was read to its end and no "
                      "copy of the old content was found beside it" % self.path, lost if lost > 0 else None)
        self.queue_later(candidates, src.path if src else None, gen.src.mtime_ns,
                         [*self.known_heads(), (len(gen.head), sha(gen.head)), *self.live_heads()])
        if src is None or src.fd != gen.src.fd:
            gen.src.close()

    def rotated(self, gen: Gen) -> None:
        """The path holds another file: the one read is renamed (or removed). It is read on while it
        is written; generations rotated in between are read from their start; then the new file."""
        self.since_ns = int(time.time() * 1e9)
        self.live = None
        self.old.append(gen)
        self.pump(gen, verify=False)
        candidates = self.siblings(self.open_inodes())
        self.queue_later(candidates, None, gen.src.mtime_ns if gen.pos else 0,
                         self.known_heads() + self.live_heads())

    def run(self, state: Dict[str, Any]) -> None:
        self.write(SYNC)
        resumed = self.resume(state)
        at_end = state.get("start") == "end" and not resumed
        while True:
            self.pump_old()
            live = self.live
            if live is None:
                self.open_live(at_end)
                at_end = False
                continue
            if live.unseen and live.src.read(0, 1):
                # its first bytes: a generation copied away and truncated since it was opened
                # (never seen: the follower was behind) is read first
                live.unseen = False
                self.queue_later(self.siblings(self.open_inodes()), None, live.opened_ns,
                                 self.known_heads() + self.live_heads())
                continue
            st = self.path_stat()
            if st is not None and (st.st_dev, st.st_ino) != (live.src.dev, live.src.ino):
                self.rotated(live)
                continue
            if not self.pump(live, verify=True):
                self.truncated(live)
                continue
            live.src.mtime_ns = os.fstat(live.src.fd).st_mtime_ns
            time.sleep(self.poll_s)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError, KeyboardInterrupt):
        Follower(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), 1).run(json.loads(sys.argv[4]))
