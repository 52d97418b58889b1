"""Which files a run holds already, by content: `gputrace import` asks before it imports a file
and records it after, so the same bytes given again (under any name) add nothing.

An engine log is also known by its content, whatever its compression and however far it had
grown (``log_stream``): by the sha256 of its first HEAD_BYTES decompressed bytes, as log shippers
fingerprint a file; its lines are keyed by their numbers in that content, so a grown copy adds only
its new lines, and the same log gzipped adds none.

A file is known by the sha256 of its bytes. Hashing costs a pass over the file (about 200 MB/s
on the 2-core CI machine, so 10 s for a 2 GiB log), so a new file is not hashed before its
import: a probe (sha256 over its size and first and last MiB, read in milliseconds) finds the
ledger's candidates, only a file whose probe matches one is hashed in full first, and an engine
log is hashed as the importer reads it.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from gputrace.errors import SourceError
from gputrace.imports.log_files import open_log
from gputrace.imports.report import StoredLines
from gputrace.store import ImportedFile, ImportedStream, Store

PROBE_BYTES = 1 << 20
# An engine log's first line stamps its time (and SGLang's prints every server argument): two
# logs share their first KiB only when one is a copy of the other, grown or compressed. A log
# shorter than this is known by all of it.
HEAD_BYTES = 1 << 10
_BLOCK_BYTES = 1 << 20


def content_probe(path: str | os.PathLike[str]) -> tuple[str, int] | None:
    """(probe, size in bytes), equal for files of equal content; None for an empty or unreadable
    file (the importer then says what is wrong with it)."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if not size:
                return None
            probe = hashlib.sha256(str(size).encode() + b"\n" + fh.read(PROBE_BYTES))
            if size > PROBE_BYTES:
                fh.seek(max(size - PROBE_BYTES, PROBE_BYTES))
                probe.update(fh.read(PROBE_BYTES))
    except OSError:
        return None
    return probe.hexdigest(), size


@dataclass
class StreamHash:
    """The sha256 of a file's bytes, fed as a reader reads them from its start (``update``)."""

    digest: hashlib._Hash = field(default_factory=hashlib.sha256)
    bytes_read: int = 0

    def update(self, data: bytes | memoryview) -> None:
        self.digest.update(data)
        self.bytes_read += len(data)

    def finish(self, path: str | os.PathLike[str]) -> str:
        """The file's sha256: what the reader did not read (it stopped at damage) is read here."""
        with open(path, "rb") as fh:
            fh.seek(self.bytes_read)
            while block := fh.read(_BLOCK_BYTES):
                self.update(block)
        return self.digest.hexdigest()


@dataclass(frozen=True, slots=True)
class LedgerCheck:
    """What the ledger says of a file about to be imported."""

    path: str
    kind: str
    probe: str | None = None  # None: empty or unreadable, not recorded
    size_bytes: int = 0
    earlier: ImportedFile | None = None  # the same content, imported already

    def entry(self, sha256: str) -> ImportedFile | None:
        """The ledger row for this file, once imported with this content hash."""
        if self.probe is None:
            return None
        return ImportedFile(sha256=sha256, probe=self.probe, kind=self.kind,
                            path=str(Path(self.path).resolve()), size_bytes=self.size_bytes,
                            imported_ns=time.time_ns())

    def already_imported(self) -> str:
        """The one line `gputrace import` prints for a file whose content the run holds already."""
        assert self.earlier is not None
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.earlier.imported_ns / 1e9))
        return f"already imported: {self.path} (imported {when} as {self.earlier.path})"


def check(store: Store, path: str, kind: str) -> LedgerCheck:
    """Whether ``store`` holds a file of the same content as ``path`` (any kind, any path)."""
    probed = content_probe(path)
    if probed is None:
        return LedgerCheck(path, kind)
    probe, size = probed
    candidates = store.imported_like(probe)
    earlier = None
    if candidates:
        full = StreamHash().finish(path)
        earlier = next((c for c in candidates if c.sha256 == full), None)
    return LedgerCheck(path, kind, probe, size, earlier)


@dataclass(frozen=True, slots=True)
class LogStream:
    """An engine log about to be imported, as the ledger knows its content."""

    source: str  # the name its lines go in under: an earlier copy's, or a new one
    head_sha256: str = ""  # "": an empty or unreadable log, not recorded
    head_bytes: int = 0
    earlier: ImportedStream | None = None  # the copy that first brought this content
    stored: StoredLines | None = None  # its lines the run holds; None: none
    recorded: bool = False  # the ledger knows this head already

    def entry(self, kind: str, path: str) -> ImportedStream | None:
        """The ledger row to record before its lines go in; None when there is none to add."""
        if self.recorded or not self.head_sha256:
            return None
        return ImportedStream(head_sha256=self.head_sha256, head_bytes=self.head_bytes,
                              source=self.source, kind=kind, path=str(Path(path).resolve()),
                              imported_ns=time.time_ns())


def log_stream(store: Store, path: str, source: str) -> LogStream:
    """How ``store`` knows the engine log at ``path``: a log whose first decompressed bytes match
    one it holds continues that one (its lines go in under that source, those stored already
    skipped); any other is new, under ``source`` (made unique when another log holds that name:
    two logs written at one path, one after the other, must not share their line numbers)."""
    try:
        with open_log(path) as stream:
            head = stream.read(HEAD_BYTES)
    except (OSError, EOFError):
        head = b""
    except SourceError:  # unreadable: the importer says so
        return LogStream(source)
    if not head:
        return LogStream(source)
    fingerprint = hashlib.sha256(head).hexdigest()
    matches = [known for known in store.imported_streams() if known.head_bytes <= len(head)
               and hashlib.sha256(head[:known.head_bytes]).hexdigest() == known.head_sha256]
    if not matches:
        if source in store.log_sources():
            source = f"{source} [{fingerprint[:12]}]"
        return LogStream(source, fingerprint, len(head))
    first = matches[0]  # oldest first: the copy that brought the content
    recorded = any(m.head_bytes == len(head) and m.source == first.source for m in matches)
    return LogStream(first.source, fingerprint, len(head), earlier=first,
                     stored=StoredLines(store.stored_line_numbers(first.source)), recorded=recorded)
