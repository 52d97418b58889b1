"""Runs ON the followed host (sent as ``python3 -c``): follows one file through rotation and
writes framed chunks (``KIND INODE OFFSET LENGTH\\n`` + bytes) so the collector can resume exactly.
The frames follow a ``SYNC`` line, so that whatever a login script printed before is skipped.

Kinds: O opened INODE at OFFSET; D data at OFFSET; T INODE was truncated (copytruncate), reading
again from 0; L the rotated file INODE could not be found, lines after OFFSET are lost; K the old
content past OFFSET is read from the copy INODE (its path is the frame's data) before the file
is read again from 0; G INODE was truncated and regrown while its content past OFFSET was unread,
and no copy of it was found: that content is lost.

Truncation is recognised by content, not only by size: the follower keeps the last TAIL_BYTES it
read (the collector sends their length and SHA-256 when it resumes), and content at its offset
that no longer ends with them is a new file (a copytruncate during an SSH outage, after which the
engine wrote past the old offset before the collector was back).
Kept to Python 3.6 syntax: hosts run whatever python3 their distribution ships.
"""

import contextlib
import hashlib
import os
import select
import sys
import time

CHUNK_BYTES = 1 << 16
SYNC = b"\n:gputrace-follow-v1:\n"
COMPRESSED = (".gz", ".xz", ".bz2", ".zst", ".lz4", ".Z")
TAIL_BYTES = 4096  # the fingerprint: a line of an engine log is 100-300 bytes, so 4 KiB spans 10+


def fingerprint(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_tail(fd: int, pos: int, length: int) -> bytes:
    """The ``length`` bytes just before ``pos`` (fewer if the file is shorter there)."""
    start = max(0, pos - length)
    return os.pread(fd, pos - start, start) if pos > start else b""


class Follower:
    def __init__(self, path: str, poll_s: float, out_fd: int) -> None:
        self.path = path
        self.poll_s = poll_s
        self.out_fd = out_fd
        self.fd = -1
        self.inode = 0
        # Files that appeared at the path after the current one, opened at once and read in order:
        # however far behind the collector is, a file rotated away twice is not skipped.
        self.queue = []  # type: list[tuple[int, int]]
        self.tail = b""  # the last bytes read from self.fd, up to the read position
        os.set_blocking(out_fd, False)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.out_fd, view):]
            except BlockingIOError:
                select.select([], [self.out_fd], [], self.poll_s)
                self.watch_path()

    def frame(self, kind: bytes, inode: int, off: int, data: bytes = b"") -> None:
        self.write(kind + b" %d %d %d\n" % (inode, off, len(data)) + data)

    def watch_path(self) -> None:
        try:
            path_inode = os.stat(self.path).st_ino
        except FileNotFoundError:
            return
        newest = self.queue[-1][1] if self.queue else self.inode
        if path_inode != newest:
            try:
                fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                return
            self.queue.append((fd, os.fstat(fd).st_ino))

    def drain(self, fd: int, inode: int, pos: int) -> int:
        while True:
            data = os.pread(fd, CHUNK_BYTES, pos)
            if not data:
                return pos
            self.frame(b"D", inode, pos, data)
            pos += len(data)
            if fd == self.fd:
                self.tail = (self.tail + data)[-TAIL_BYTES:]
            self.watch_path()

    def recover(self, offset: int, tail_len: int, tail_sha: str, lost_if_no_copy: bool) -> None:
        # The file's content past ``offset`` was replaced (truncated in place) before it was read:
        # a copy beside the path (copytruncate's) whose bytes before ``offset`` are those we read
        # has it. Read the copy on from ``offset``; without one, say what is lost.
        folder, base = os.path.split(self.path)
        for entry in os.scandir(folder or "."):
            if (not entry.name.startswith(base) or entry.name == base or entry.name.endswith(COMPRESSED)
                    or not entry.is_file(follow_symlinks=False) or entry.inode() == self.inode):
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY)
            except OSError:
                continue
            try:
                size = os.fstat(fd).st_size
                if tail_len and size >= offset and fingerprint(read_tail(fd, offset, tail_len)) == tail_sha:
                    if size == offset and not lost_if_no_copy:
                        return  # read to its end before the truncation: nothing was missed
                    inode = os.fstat(fd).st_ino
                    self.frame(b"K", inode, offset, os.fsencode(entry.path))
                    self.frame(b"O", inode, offset)
                    self.drain(fd, inode, offset)
                    return
            finally:
                os.close(fd)
        if lost_if_no_copy:
            self.frame(b"G", self.inode, offset)

    def resume_rotated(self, want_inode: int, offset: int) -> None:
        # Rotated by rename while we were away: finish the old file if it is still beside the path,
        # then any file rotated after it (same name prefix, not compressed, modified since), oldest first.
        folder, base = os.path.split(self.path)
        old_path, later = None, []
        for entry in os.scandir(folder or "."):
            if entry.inode() == want_inode and entry.is_file(follow_symlinks=False):
                old_path = entry.path
            elif (entry.name.startswith(base) and entry.name != base and entry.is_file(follow_symlinks=False)
                  and not entry.name.endswith(COMPRESSED) and entry.inode() != self.inode):
                later.append((entry.stat(follow_symlinks=False).st_mtime_ns, entry.path, entry.inode()))
        if old_path is None:
            self.frame(b"L", want_inode, offset)
            return
        old_fd = os.open(old_path, os.O_RDONLY)
        old_mtime_ns = os.fstat(old_fd).st_mtime_ns
        self.frame(b"O", want_inode, offset)
        self.drain(old_fd, want_inode, offset)
        os.close(old_fd)
        for mtime_ns, path, inode in sorted(later):
            if mtime_ns >= old_mtime_ns:
                fd = os.open(path, os.O_RDONLY)
                self.frame(b"O", inode, 0)
                self.drain(fd, inode, 0)
                os.close(fd)

    def run(self, want_inode: int, offset: int, tail_len: int = 0, tail_sha: str = "") -> None:
        self.write(SYNC)
        told = False
        while self.fd < 0:
            try:
                self.fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                if not told:  # say it once: a wrong path must not look like an idle engine
                    self.frame(b"W", 0, 0)
                    told = True
                time.sleep(self.poll_s)
        st = os.fstat(self.fd)
        self.inode, pos = st.st_ino, offset
        if want_inode and want_inode != self.inode:
            self.resume_rotated(want_inode, offset)
            pos = 0
        elif want_inode and (st.st_size < offset or (
                tail_len and fingerprint(read_tail(self.fd, offset, tail_len)) != tail_sha)):
            # truncated while the collector was away: what was written after its offset and before
            # the truncation is only in a copy, if anywhere
            self.frame(b"T", self.inode, offset)
            self.recover(offset, tail_len, tail_sha, lost_if_no_copy=True)
            pos = 0
        elif offset < 0:
            pos = st.st_size
        self.tail = read_tail(self.fd, pos, TAIL_BYTES)
        self.frame(b"O", self.inode, pos)
        while True:
            size = os.fstat(self.fd).st_size
            # regrown past our position since the last read: the bytes before it are not ours
            replaced = size >= pos and self.tail and read_tail(self.fd, pos, len(self.tail)) != self.tail
            if size < pos or replaced:
                self.frame(b"T", self.inode, pos)
                self.recover(pos, len(self.tail), fingerprint(self.tail), lost_if_no_copy=bool(replaced))
                pos, self.tail = 0, b""
                self.frame(b"O", self.inode, pos)
                continue
            pos = self.drain(self.fd, self.inode, pos)
            self.watch_path()
            if self.queue:
                # The writer may have appended to the old file after our last read: finish it first.
                self.drain(self.fd, self.inode, pos)
                os.close(self.fd)
                (self.fd, self.inode), pos = self.queue.pop(0), 0
                self.tail = b""
                self.frame(b"O", self.inode, pos)
                continue
            time.sleep(self.poll_s)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError, KeyboardInterrupt):
        tail_args = (int(sys.argv[5]), sys.argv[6]) if len(sys.argv) > 6 else (0, "")
        Follower(sys.argv[1], float(sys.argv[4]), 1).run(int(sys.argv[2]), int(sys.argv[3]), *tail_args)
