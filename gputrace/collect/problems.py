"""What keeps a capture from being complete, per source: a log file not there, a lost connection, a
task that ended, log content that could not be read; each with when it began and ended (collector
clock), for /healthz, /v1/status and meta.json."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from gputrace.remote.follow import FollowGap
from gputrace.vocabulary import CaptureProblem


class SourceProblems:
    """The problems seen so far, the open ones (until_ns None) current; stamped on ``clock_ns``."""

    def __init__(self, clock_ns: Callable[[], int]):
        self.clock_ns = clock_ns
        self.seen: list[CaptureProblem] = []
        self.log_gaps: list[dict[str, object]] = []  # log content that could not be read (meta.json)

    def note(self, source: str, reason: str | None) -> None:
        """``source`` has a problem from now on (``reason``), or none any more (None)."""
        now = self.clock_ns()
        for i, problem in enumerate(self.seen):
            if problem.source == source and problem.until_ns is None:
                if problem.reason == reason:
                    return
                self.seen[i] = dataclasses.replace(problem, until_ns=now)
        if reason is not None:
            self.seen.append(CaptureProblem(source, reason, now))

    def log_gap(self, source: str, gap: FollowGap) -> None:
        """Log content ``source`` could not read: kept in meta.json with its position and size, and
        as a problem over at once spanning the time it covers (the report's notes say it)."""
        self.log_gaps.append({"source": source, **gap.to_dict()})
        self.seen.append(CaptureProblem(source, gap.reason, gap.since_ns or gap.found_ns, gap.found_ns))

    def current(self) -> list[CaptureProblem]:
        return [p for p in self.seen if p.until_ns is None]

    def open_sources(self) -> set[str]:
        return {p.source for p in self.current()}
