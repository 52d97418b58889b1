"""vLLM's periodic stats line (V1 ``loggers.py``, V0 ``metrics.py``) and its configuration lines
(``non-default args: {...}``, ``Initializing a V1 LLM engine (vX) with config: ...``) as
ParsedLine; its stamps (``MM-DD HH:MM:SS``) take the year from the caller's date, else log time
is None.
"""

from __future__ import annotations

import re

from gputrace.engines.common import (
    LogClock,
    ParsedLine,
    Value,
    config_bad_values,
    convert_value,
)
from gputrace.engines.reprs import python_dict, python_kwargs

ENGINE = "vllm"

_MARKER = re.compile(r"(?<!\w)Avg prompt throughput: ")
# The engine's arguments as given (a dict) and its resolved configuration (``k=v, ...``).
_CONFIG_MARKER = re.compile(r"(?<!\w)(?:non-default args: (?P<args>\{)|"
                            r"Initializing a V1 LLM engine \(v[^)]*\) with config: (?P<config>)|"
                            r"Chunked prefill is enabled with max_num_batched_tokens=(?P<budget>\d+))")
_TIMESTAMP = re.compile(
    r"(?<![\d:.-])(?:(\d{4})-)?(\d\d)-(\d\d) (\d\d:\d\d:\d\d)(?:[.,](\d{1,9}))?(?![\d:])"
)
# Every line the grammar reads holds one of these (its markers' text, less their context).
MAYBE_VLLM = re.compile(rb"Avg prompt throughput: |non-default args: \{|Initializing a V1 LLM engine \(v|"
                        rb"Chunked prefill is enabled with max_num_batched_tokens=")
_ENGINE_INDEX = re.compile(r"(?<!\w)Engine (\d+): *$")
# the value is the text up to the next separator; the value rule (common.convert_value) judges it
_FIELD = re.compile(r"([A-Za-z][A-Za-z ]*?): ([^\s,]*[^\s,.])")
_KEYS: dict[str, tuple[str, type, float]] = {  # field, type, divisor
    "Avg prompt throughput": ("input_throughput_tok_s", float, 1.0),
    "Avg generation throughput": ("gen_throughput_tok_s", float, 1.0),
    "Running": ("running_req", int, 1.0),
    "Waiting": ("queue_req", int, 1.0),
    "Pending": ("queue_req", int, 1.0),  # V0's name for requests waiting to be scheduled
    "GPU KV cache usage": ("token_usage", float, 100.0),  # logged in percent; stored as a ratio
    "CPU KV cache usage": ("token_usage", float, 100.0),  # vLLM's CPU build names its cache so
}
# its stats lines' field names ("Running" and "Waiting" are plain words, not its own)
LOG_FIELDS = tuple(k for k in _KEYS if " " in k)


def parse_line(line: str, clock: LogClock) -> ParsedLine | None:
    """One vLLM log line -> ParsedLine (kind "stats"), or None when it is not a stats line."""
    marker = _MARKER.search(line)
    if marker is None:
        return _config_line(line, clock)
    values: dict[str, Value] = {}
    bad: list[str] = []
    for key, text in _FIELD.findall(line, marker.start()):
        spec = _KEYS.get(key.strip())
        if spec is None or spec[0] in values:
            continue
        name, kind, divisor = spec
        value = convert_value(text, kind)
        if value is None:
            bad.append(f"{name}={text[:40]!a}")
            continue
        values[name] = value / divisor if isinstance(value, float) and divisor != 1.0 else value
    if not values:  # not one value the rule takes: no scheduler line
        return None
    head = line[: marker.start()]
    ts_text, log_ts_ns, resolution = _stamp(head, clock)
    engine_index = _ENGINE_INDEX.search(head)
    # Under data parallelism vLLM V1 runs one engine core per DP rank, numbered as logged.
    dp_rank = int(engine_index.group(1)) if engine_index else None
    return ParsedLine(
        engine=ENGINE, kind="stats", ts_text=ts_text, log_ts_ns=log_ts_ns,
        ts_resolution_ns=resolution, dp_rank=dp_rank, values=values, bad_values=tuple(bad),
    )


def _stamp(head: str, clock: LogClock) -> tuple[str | None, int | None, int | None]:
    """(stamp text, epoch ns or None, resolution ns) of the text before a message."""
    ts = _TIMESTAMP.search(head)
    if ts is None:
        return None, None, None
    year, month, day, hms, frac = ts.groups()
    if year is not None:
        log_ts_ns, resolution = clock.to_ns(f"{year}-{month}-{day}", hms, frac)
    else:
        log_ts_ns, resolution = clock.month_day_to_ns(int(month), int(day), hms, frac)
    return ts.group(0), log_ts_ns, resolution


def _config_line(line: str, clock: LogClock) -> ParsedLine | None:
    marker = _CONFIG_MARKER.search(line)
    if marker is None:
        return None
    body = line[marker.end():].rstrip()
    if marker.group("budget"):
        # the scheduler's per-step token budget (decode tokens and prefill chunks share it)
        fields: dict[str, object] = {"max_num_batched_tokens": int(marker.group("budget"))}
    else:
        fields = python_dict(body.removesuffix("}")) if marker.group("args") else python_kwargs(body)
    if not fields:
        return None
    ts_text, log_ts_ns, resolution = _stamp(line[: marker.start()], clock)
    return ParsedLine(engine=ENGINE, kind="config", ts_text=ts_text, log_ts_ns=log_ts_ns,
                      ts_resolution_ns=resolution, config=fields, bad_values=config_bad_values(fields))
