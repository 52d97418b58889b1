"""What a path given on the command line is, before anything reads it: a regular file is read as
it is; a pipe (``<(cat log)``, ``/dev/stdin``) is copied once to a temporary file, since an import
reads its input more than once (the content hash, the probe) and a pipe can be read only once;
a directory or a device is refused with one line that says what it is."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from gputrace.errors import SourceError, UsageError

_COPY_BYTES = 1 << 20


def _what(mode: int) -> str | None:
    """What a file of this mode is, when it is not something a log or capture can be read from."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    return None


def check_readable(path: str) -> bool:
    """Whether ``path`` is a pipe (True) or a regular file (False); UsageError with one line for a
    missing path, a directory or a device (``/dev/zero`` never ends; it was called "no such file")."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read: {exc.strerror}") from None
    what = _what(mode)
    if what is not None:
        raise UsageError(f"{path}: is {what}, not a file (give a log or capture file, or a pipe)")
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


@contextmanager
def pipes_spooled(paths: Mapping[str, tuple[str, ...]], say: Callable[[str], None]
                  ) -> Iterator[dict[str, tuple[str, ...]]]:
    """``paths`` (option -> paths) with each pipe replaced by a temporary copy of what it gave,
    removed on exit (``say`` is told where); every path checked by ``check_readable`` first."""
    pipes = {p for group in paths.values() for p in group if check_readable(p)}
    if not pipes:
        yield dict(paths)
        return
    with tempfile.TemporaryDirectory(prefix="gputrace-pipe-") as spool_dir:
        copies: dict[str, str] = {}
        for i, pipe in enumerate(sorted(pipes)):
            # the pipe's own name kept, so the summaries and the store's source name it
            copy = os.path.join(spool_dir, str(i), pipe.lstrip("/"))
            os.makedirs(os.path.dirname(copy), exist_ok=True)
            try:
                with open(pipe, "rb") as src, open(copy, "wb") as dst:
                    shutil.copyfileobj(src, dst, _COPY_BYTES)
            except OSError as exc:
                raise SourceError(f"{pipe}: a pipe, copied to {spool_dir} to be read twice, "
                                  f"failed there: {exc.strerror} (set TMPDIR to a roomier disk)") from exc
            copies[pipe] = copy
            say(f"{pipe} is a pipe: read into {copy} ({os.path.getsize(copy)} bytes) to import it")
        yield {option: tuple(copies.get(p, p) for p in group) for option, group in paths.items()}
