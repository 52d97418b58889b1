"""structlog configuration: readable key=value lines on a terminal, JSON lines for machines.

Logs go to stderr so that commands whose output is data (``parse``, ``export``) keep stdout clean.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(log_format: str = "console", level: str = "info") -> None:
    """Configure structlog once per process; ``log_format`` is "console" or "json"."""
    renderer: structlog.typing.Processor
    if log_format == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        # sys.stderr as it is at each write, not as it was here: an in-process caller (click's test
        # runner, a notebook) may swap the stream and close it after this call
        logger_factory=_stderr_at_write_time,
        cache_logger_on_first_use=False,
    )


def _stderr_at_write_time(*_args: object) -> structlog.PrintLogger:
    return structlog.PrintLogger(file=sys.stderr)


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    """A logger bound to a component name."""
    return structlog.get_logger(component=name)  # type: ignore[no-any-return]
