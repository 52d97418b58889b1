"""Runs ON the followed host (sent as ``python3 -c``): follows one file through rotation and
writes framed chunks (``KIND INODE OFFSET LENGTH\\n`` + bytes) so the collector can resume exactly.
The frames follow a ``SYNC`` line, so that whatever a login script printed before is skipped.

Kinds: O opened INODE at OFFSET; D data at OFFSET; T INODE was truncated (copytruncate), reading
again from 0; L the rotated file INODE could not be found, lines after OFFSET are lost.
Kept to Python 3.6 syntax: hosts run whatever python3 their distribution ships.
"""

import contextlib
import os
import select
import sys
import time

CHUNK_BYTES = 1 << 16
SYNC = b"\n:gputrace-follow-v1:\n"
COMPRESSED = (".gz", ".xz", ".bz2", ".zst", ".lz4", ".Z")


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
            self.watch_path()

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

    def run(self, want_inode: int, offset: int) -> None:
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
        elif want_inode and st.st_size < offset:
            self.frame(b"T", self.inode, offset)
            pos = 0
        elif offset < 0:
            pos = st.st_size
        self.frame(b"O", self.inode, pos)
        while True:
            pos = self.drain(self.fd, self.inode, pos)
            if os.fstat(self.fd).st_size < pos:
                self.frame(b"T", self.inode, pos)
                pos = 0
                continue
            self.watch_path()
            if self.queue:
                # The writer may have appended to the old file after our last read: finish it first.
                self.drain(self.fd, self.inode, pos)
                os.close(self.fd)
                (self.fd, self.inode), pos = self.queue.pop(0), 0
                self.frame(b"O", self.inode, pos)
                continue
            time.sleep(self.poll_s)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError, KeyboardInterrupt):
        Follower(sys.argv[1], float(sys.argv[4]), 1).run(int(sys.argv[2]), int(sys.argv[3]))
