"""The one exception hierarchy of gputrace.

GputraceError                      base; ``exit_code`` is what the CLI exits with
 ├── UsageError         (exit 2)   bad command-line use
 │    └── ConfigError   (exit 2)   gputrace.toml (or another input file) is invalid
 ├── StoreError         (exit 1)   the run store cannot be created, opened or written
 │    ├── SchemaVersionError       the store was written by a newer gputrace
 │    ├── RecordError              a record holds a value its column cannot store
 │    └── StoreWriteError          a write failed (disk full, I/O): the same write may work later
 ├── SourceError        (exit 1)   a data source failed (log, agent, load endpoint)
 │    ├── NvmlError                NVML or the driver is missing or failing
 │    ├── CursorKeptMoving         an agent dropped samples faster than a pull could ask for them
 │    └── TransportError           a local or SSH transport failed
 │         └── HostKeyError        an SSH host key is unknown or changed
 └── AnalysisError      (exit 1)   a run cannot be analysed (e.g. no data in it)

Adapters map library errors into these (``raise StoreError(...) from exc``) so callers never
catch duckdb, asyncssh or pynvml errors.
"""

from __future__ import annotations


class GputraceError(Exception):
    """Base of every error gputrace raises on purpose."""

    exit_code = 1


class UsageError(GputraceError):
    """The command line asked for something that cannot be done."""

    exit_code = 2


class ConfigError(UsageError):
    """A configuration or input file is invalid; the message names the file and the key."""


class StoreError(GputraceError):
    """The run store cannot be created, opened or written."""


class RecordError(StoreError):
    """A record holds a value its column cannot store (an integer past int64, a bool where a
    count belongs, text that is not valid Unicode): that record is set aside, the rest written."""


class StoreWriteError(StoreError):
    """A write failed for a reason outside the records (the disk is full, an I/O error): nothing
    of that batch was stored, and the same write may succeed once the cause is gone."""


class SchemaVersionError(StoreError):
    """The run store was written by a newer gputrace with a newer schema."""


class SourceError(GputraceError):
    """A data source failed."""


class NvmlError(SourceError):
    """NVML or the NVIDIA driver is missing or failing."""


class CursorKeptMoving(SourceError):
    """Every try of one pull from an agent found its cursor gone from the agent's ring (a link
    slower than the ring is long): the next pull tries again."""


class TransportError(SourceError):
    """A local or SSH transport failed."""


class HostKeyError(TransportError):
    """An SSH host key is unknown or has changed."""


class AnalysisError(GputraceError):
    """A run cannot be analysed."""
