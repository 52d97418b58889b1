"""The serving engines, one package each (gputrace/engines/sglang/, gputrace/engines/vllm/) behind
one interface (``Engine``: its log grammar and fast path, knobs, placement rule, words,
scheduling policy and the log and /metrics the simulator writes for it), registered here and
nowhere else; ``engine_words`` gives the run's engine.
``LogParser`` numbers and counts the lines of one source, from a file or followed live.
"""

from __future__ import annotations

import datetime as dt
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from gputrace.engines import sglang, vllm
from gputrace.engines.common import Engine, EngineWords, LineGrammar, LogClock, ParsedLine
from gputrace.errors import UsageError
from gputrace.model import EngineConfig, SchedulerEvent

__all__ = ["ENGINES", "ENGINE_WORDS", "KINDS", "Engine", "EngineWords", "LogParser", "ParseCounts",
           "engine_kind", "engine_words", "grammar", "parse_line", "register"]

# The engines gputrace reads, by the store's engine name: the one place an engine is registered.
ENGINE_WORDS: dict[str, Engine] = {}
AUTO = "auto"  # a log whose engine is found line by line: every registered grammar tries it
KINDS = ("prefill", "decode", "config", "stats")


def register(engine: Engine) -> Engine:
    """Add an engine (its package's ``ENGINE``); the last registered with a name wins."""
    ENGINE_WORDS[engine.kind] = engine
    return engine


for _engine in (sglang.ENGINE, vllm.ENGINE):
    register(_engine)

# A run whose engine is not known is read as SGLang's (the engine gputrace was first written for).
DEFAULT_ENGINE = sglang.KIND


def engine_names() -> tuple[str, ...]:
    """The engines a log source may name, and "auto"."""
    return (*ENGINE_WORDS, AUTO)


ENGINES = engine_names()  # as at import (the CLI's choices)


def engine_kind(engine: str | None) -> str:
    """The store's engine name when gputrace knows the engine, else ``DEFAULT_ENGINE``."""
    return engine if engine is not None and engine in ENGINE_WORDS else DEFAULT_ENGINE


def engine_words(kind: str | None) -> Engine:
    """The run's engine (None or unknown: SGLang): its words, knobs, grammar and rules."""
    return ENGINE_WORDS[engine_kind(kind)]


def foreign_words(kind: str | None) -> frozenset[str]:
    """The words other engines use that this one does not: what its outputs must never show."""
    own = engine_words(kind)
    return frozenset(w for other in ENGINE_WORDS.values() if other is not own
                     for w in other.vocabulary()) - own.vocabulary()


def _auto(line: str, clock: LogClock) -> ParsedLine | None:
    for engine in ENGINE_WORDS.values():
        parsed = engine.parse_line(line, clock)
        if parsed is not None:
            return parsed
    return None


def grammar(engine: str) -> LineGrammar:
    """The line grammar of an engine (a registered name, or "auto" for any)."""
    if engine == AUTO:
        return _auto
    try:
        return ENGINE_WORDS[engine].parse_line
    except KeyError:
        raise UsageError(f"unknown engine {engine!r}; known: {', '.join(engine_names())}") from None


def fast_path_engine(engine: str) -> Engine | None:
    """The engine whose fast path reads a log of ``engine``: that engine where it has one, for
    "auto" the first registered that has one; None where there is none."""
    grammar(engine)  # an unknown name: the one-line error
    candidates = ENGINE_WORDS.values() if engine == AUTO else [ENGINE_WORDS[engine]]
    return next((e for e in candidates if e.fast_path is not None), None)


def maybe_line(engine: str) -> re.Pattern[bytes]:
    """What every line the engine's grammar (or, for "auto", any grammar) reads holds."""
    if engine != AUTO:
        return ENGINE_WORDS[engine].maybe_line
    return re.compile(b"|".join(e.maybe_line.pattern for e in ENGINE_WORDS.values()))


def parse_line(
    line: str, engine: str = "auto", tz: str = "UTC", date: dt.date | str | None = None
) -> ParsedLine | None:
    """Parse one line on its own (tests, one-offs); use LogParser for a stream of lines."""
    return grammar(engine)(line, LogClock(tz, date))


@dataclass
class ParseCounts:
    """What a LogParser has seen so far."""

    lines: int = 0
    recognised: Counter[str] = field(default_factory=Counter)  # per kind
    unrecognised: int = 0
    bad_values: int = 0  # values a recognised line logged that break the value rule: not stored
    first_bad_value: str | None = None  # "line N: name='text'"

    def count_bad(self, line_no: int, bad_values: tuple[str, ...]) -> None:
        if bad_values:
            self.bad_values += len(bad_values)
            if self.first_bad_value is None:
                self.first_bad_value = f"line {line_no}: {bad_values[0]}"

    def as_dict(self) -> dict[str, object]:
        return {
            "lines": self.lines,
            "recognised": {k: self.recognised.get(k, 0) for k in KINDS},
            "unrecognised": self.unrecognised,
        }


class LogParser:
    """Parses the lines of one log source in order, for files and live follows alike.

    ``feed`` never raises on any line: a line that is not a scheduler, stats or configuration
    line is counted in ``counts.unrecognised`` and gives None. Line numbers start at 1 (or
    ``first_line_no``, for a follower that resumes mid-file).
    """

    def __init__(
        self,
        *,
        host: str,
        source: str,
        engine: str = "sglang",
        tz: str = "UTC",
        date: dt.date | str | None = None,
        first_line_no: int = 1,
        year_until: Callable[[], dt.date] | None = None,
    ):
        self.host = host
        self.source = source
        self.engine = engine
        self.clock = LogClock(tz, date, year_until)
        self._grammar = grammar(engine)
        self.next_line_no = first_line_no
        self.counts = ParseCounts()

    def parse(self, line: str) -> ParsedLine | None:
        """Parse and count the next line; returns the engine-neutral ParsedLine."""
        line_no = self.next_line_no
        self.next_line_no += 1
        self.counts.lines += 1
        try:
            parsed = self._grammar(line.rstrip("\r\n"), self.clock)
        except Exception:  # a grammar bug must cost one line, never the follower
            parsed = None
        if parsed is None:
            self.counts.unrecognised += 1
        else:
            self.counts.recognised[parsed.kind] += 1
            self.counts.count_bad(line_no, parsed.bad_values)
        return parsed

    def feed(self, line: str, recv_ts_ns: int | None = None) -> SchedulerEvent | EngineConfig | None:
        """Parse and count the next line; the store record, or None when not recognised.

        ``recv_ts_ns`` is when a live follower received the line (collector clock).
        """
        line_no = self.next_line_no
        parsed = self.parse(line)
        if parsed is None:
            return None
        return parsed.to_record(host=self.host, source=self.source, line_no=line_no, recv_ts_ns=recv_ts_ns)

    def skip(self, n_lines: int) -> None:
        """Advance the line number past lines handled elsewhere (e.g. a bulk fast path)."""
        self.next_line_no += n_lines
