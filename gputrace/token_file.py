"""Bearer tokens read from files (`--token-file`, `--agent-token-file`), for the agent and the
collector alike: the file must be readable text with a token in it, and should be private."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gputrace.errors import UsageError
from gputrace.logsetup import get_logger

log = get_logger("token_file")


def read_token(path: str | None, flag: str = "--token-file") -> str | None:
    """The bearer token in ``path`` (None without one). A file that cannot be read, is not text or
    is empty is a usage error: an empty token turned the collector's authentication off."""
    if not path:
        return None
    try:
        raw = Path(path).read_bytes()
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot read it: {exc.strerror}") from exc
    try:
        token = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise UsageError(f"{flag} {path}: not a text file") from None
    if not token:
        raise UsageError(f"{flag} {path}: the file is empty")
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning("token file readable by other users", file=path, fix=f"chmod 600 {path}")
    return token
