"""Serving-engine log grammars (SGLang, vLLM): text in, SchedulerEvent / EngineConfig out;
``LogParser`` numbers and counts the lines of one source, from a file or followed live; and each
engine's words (``engine_words``: its flags, setting names and log fields) that outputs speak in.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from gputrace.engines import sglang, vllm
from gputrace.engines.common import EngineWords, LogClock, ParsedLine
from gputrace.errors import UsageError
from gputrace.model import EngineConfig, SchedulerEvent

ENGINES = ("sglang", "vllm", "auto")
KINDS = ("prefill", "decode", "config", "stats")

# Each engine's words, by the store's engine name. A run whose engine is not known is read as SGLang's,
# as its settings are (``EngineSettings``).
ENGINE_WORDS: dict[str, EngineWords] = {w.kind: w for w in (sglang.WORDS, vllm.WORDS)}


# A run whose engine is not known is read as SGLang's (the engine gputrace was first written for).
DEFAULT_ENGINE = sglang.ENGINE


def engine_kind(engine: str | None) -> str:
    """The store's engine name when gputrace knows the engine, else ``DEFAULT_ENGINE``."""
    return engine if engine is not None and engine in ENGINE_WORDS else DEFAULT_ENGINE


def engine_words(kind: str | None) -> EngineWords:
    """The words of the run's engine ("sglang", "vllm"; None or unknown: SGLang's)."""
    return ENGINE_WORDS[engine_kind(kind)]


def foreign_words(kind: str | None) -> frozenset[str]:
    """The words other engines use that this one does not: what its outputs must never show."""
    own = engine_words(kind)
    return frozenset(w for other in ENGINE_WORDS.values() if other is not own
                     for w in other.vocabulary()) - own.vocabulary()


LineGrammar = Callable[[str, LogClock], ParsedLine | None]


def _auto(line: str, clock: LogClock) -> ParsedLine | None:
    return sglang.parse_line(line, clock) or vllm.parse_line(line, clock)


_GRAMMARS: dict[str, LineGrammar] = {"sglang": sglang.parse_line, "vllm": vllm.parse_line, "auto": _auto}


def grammar(engine: str) -> LineGrammar:
    """The line grammar of an engine ("sglang", "vllm" or "auto" for either)."""
    try:
        return _GRAMMARS[engine]
    except KeyError:
        raise UsageError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}") from None


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
