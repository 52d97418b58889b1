"""Engine log files as bytes: plain or gzip (a cut gzip gives what it holds), read in chunks of
whole lines with every line's length bounded. `gputrace import` and `gputrace parse` read logs
through these; kept apart from the import so that `parse` does not load the run store (DuckDB:
a tenth of a second of its start).
"""

from __future__ import annotations

import gzip
import io
import os
import zlib
from collections.abc import Callable, Iterator
from typing import IO, Any

import numpy as np

from gputrace.engines.common import MAX_LINE_BYTES
from gputrace.errors import SourceError

CHUNK_BYTES = 8 << 20
# Scanning costs memory per line, not per byte (about 200 bytes a line): a chunk of short or blank
# lines is split at this many, so 16 MB of blank lines no longer takes 2.3 GB. A log's usual lines
# (150 to 300 bytes) fill an 8 MiB chunk with far fewer.
CHUNK_LINES = 1 << 17


class GzipLog(gzip.GzipFile):
    """A gzip log that ends where its data does: a cut or corrupt stream (a copy stopped short, a
    disk that filled) gives every byte that decompresses, then end of file, and says so in
    ``cut``, instead of raising and losing the file."""

    cut: str | None = None
    decompressed_bytes = 0
    file_bytes = 0  # the compressed file's size
    source: IO[bytes] | None = None  # the file it reads, closed with it (GzipFile leaves a fileobj open)

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.source is not None:
                self.source.close()

    def read(self, size: int | None = -1) -> bytes:
        if self.cut is not None:
            return b""
        want = -1 if size is None else size
        parts: list[bytes] = []
        got = 0
        try:
            # read1 hands out what each step decompressed, so nothing before the damage is lost
            while want < 0 or got < want:
                part = self.read1(want - got if want >= 0 else 1 << 20)
                if not part:
                    break
                parts.append(part)
                got += len(part)
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
            at = self.decompressed_bytes + got
            self.cut = (f"the gzip data ends before its end marker ({self.file_bytes} bytes of file, "
                        f"{at} bytes decompressed)" if isinstance(exc, EOFError) else
                        f"the gzip data is corrupt after {at} decompressed bytes ({exc})")
        self.decompressed_bytes += got
        return b"".join(parts)


class _Tee(io.RawIOBase):
    """A file's bytes as read, each block also handed to ``on_bytes`` (the import ledger's hash:
    one pass over the file, not two)."""

    def __init__(self, raw: io.BufferedReader, on_bytes: Callable[[memoryview], None]):
        self._raw = raw
        self._on_bytes = on_bytes

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self._raw.readinto(buffer)
        if n:
            self._on_bytes(memoryview(buffer)[:n])
        return n

    def tell(self) -> int:
        return self._raw.tell()

    def close(self) -> None:
        self._raw.close()
        super().close()


def open_log(path: str | os.PathLike[str], on_bytes: Callable[[memoryview], None] | None = None
             ) -> IO[bytes]:
    """A log file as bytes (gzip by magic number, whatever its name: a GzipLog); SourceError if
    unreadable. ``on_bytes`` sees the file's own bytes (compressed, for a .gz) as they are read."""
    try:
        raw = open(path, "rb")  # noqa: SIM115  # returned to the caller, who closes it
    except OSError as exc:
        raise SourceError(f"{path}: cannot read the log: {exc.strerror}") from exc
    gzipped = raw.peek(2)[:2] == b"\x1f\x8b"
    file_bytes = os.fstat(raw.fileno()).st_size
    stream: IO[bytes] = raw
    if on_bytes is not None:
        stream = io.BufferedReader(_Tee(raw, on_bytes), buffer_size=1 << 20)
    if gzipped:
        log = GzipLog(fileobj=stream, mode="rb")
        log.file_bytes = file_bytes
        log.source = stream
        return log  # type: ignore[return-value]
    return stream

def read_chunks(stream: IO[bytes], chunk_bytes: int = CHUNK_BYTES,
                max_line_bytes: int = MAX_LINE_BYTES, max_lines: int = CHUNK_LINES,
                on_cut: Callable[[], None] | None = None) -> Iterator[bytes]:
    """Whole lines in chunks of about ``chunk_bytes`` and at most ``max_lines`` lines (the last line
    may lack its newline). A line longer than ``max_line_bytes`` is cut there and the rest of it
    skipped (``on_cut`` is called for each), so memory stays bounded on a file without newlines (a
    2 GB one grew past 1.9 GB and ended in MemoryError), as on one of newlines only."""
    for chunk in _read_chunks(stream, chunk_bytes, max_line_bytes, on_cut or (lambda: None)):
        yield from _split_lines(chunk, max_lines)


def _split_lines(chunk: bytes, max_lines: int) -> Iterator[bytes]:
    """``chunk`` in pieces of at most ``max_lines`` whole lines."""
    if len(chunk) <= max_lines:
        yield chunk
        return
    newline = np.frombuffer(chunk, dtype=np.uint8) == ord("\n")
    if np.count_nonzero(newline) <= max_lines:  # a third of bytes.count's CPU
        yield chunk
        return
    ends = np.flatnonzero(newline)[max_lines - 1::max_lines] + 1
    begin = 0
    for end in ends.tolist():
        yield chunk[begin:end]
        begin = end
    if begin < len(chunk):
        yield chunk[begin:]


def _read_chunks(stream: IO[bytes], chunk_bytes: int, max_line_bytes: int,
                 on_cut: Callable[[], None]) -> Iterator[bytes]:
    tail = b""
    skipping = False  # inside a line already cut: drop up to its newline
    while True:
        block = stream.read(chunk_bytes)
        if not block:
            if tail:
                yield tail
            return
        if skipping:
            end = block.find(b"\n")
            if end < 0:
                continue
            block, skipping = block[end + 1:], False
        block = tail + block
        cut = block.rfind(b"\n")
        if cut < 0:
            if len(block) > max_line_bytes:
                on_cut()
                yield block[:max_line_bytes] + b"\n"
                tail, skipping = b"", True
            else:
                tail = block
            continue
        tail = block[cut + 1:]
        if len(tail) > max_line_bytes:
            on_cut()
            tail, skipping = tail[:max_line_bytes] + b"\n", True
            yield block[: cut + 1] + tail
            tail = b""
            continue
        yield block[: cut + 1]


def chunk_lines(chunk: bytes) -> list[str]:
    """A chunk's lines split at newlines only (a stray carriage return stays inside its line)."""
    lines = chunk.decode("utf-8", errors="replace").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines
