"""vLLM's periodic stats line (V1 ``loggers.py``, V0 ``metrics.py``) as ParsedLine; its stamps
(``MM-DD HH:MM:SS``) take the year from the caller's date, else log time is None.
"""

from __future__ import annotations

import re

from gputrace.engines.common import LogClock, ParsedLine, Value, convert_value

ENGINE = "vllm"

_MARKER = re.compile(r"(?<!\w)Avg prompt throughput: ")
_TIMESTAMP = re.compile(
    r"(?<![\d:.-])(?:(\d{4})-)?(\d\d)-(\d\d) (\d\d:\d\d:\d\d)(?:[.,](\d{1,9}))?(?![\d:])"
)
_ENGINE_INDEX = re.compile(r"(?<!\w)Engine (\d+): *$")
_FIELD = re.compile(r"([A-Za-z][A-Za-z ]*?): ([-+]?\d+(?:\.\d+)?)")
_KEYS: dict[str, tuple[str, type, float]] = {  # field, type, divisor
    "Avg prompt throughput": ("input_throughput_tok_s", float, 1.0),
    "Avg generation throughput": ("gen_throughput_tok_s", float, 1.0),
    "Running": ("running_req", int, 1.0),
    "Waiting": ("queue_req", int, 1.0),
    "Pending": ("queue_req", int, 1.0),  # V0's name for requests waiting to be scheduled
    "GPU KV cache usage": ("token_usage", float, 100.0),  # logged in percent; stored as a ratio
    "CPU KV cache usage": ("token_usage", float, 100.0),  # vLLM's CPU build names its cache so
}


def parse_line(line: str, clock: LogClock) -> ParsedLine | None:
    """One vLLM log line -> ParsedLine (kind "stats"), or None when it is not a stats line."""
    marker = _MARKER.search(line)
    if marker is None:
        return None
    values: dict[str, Value] = {}
    for key, text in _FIELD.findall(line, marker.start()):
        spec = _KEYS.get(key.strip())
        if spec is None or spec[0] in values:
            continue
        name, kind, divisor = spec
        value = convert_value(text, kind)
        if isinstance(value, float) and divisor != 1.0:
            value = value / divisor
        if value is not None:
            values[name] = value
    if not values:
        return None
    head = line[: marker.start()]
    ts_text: str | None = None
    log_ts_ns: int | None = None
    resolution: int | None = None
    ts = _TIMESTAMP.search(head)
    if ts is not None:
        year, month, day, hms, frac = ts.groups()
        ts_text = ts.group(0)
        if year is not None:
            log_ts_ns, resolution = clock.to_ns(f"{year}-{month}-{day}", hms, frac)
        else:
            log_ts_ns, resolution = clock.month_day_to_ns(int(month), int(day), hms, frac)
    engine_index = _ENGINE_INDEX.search(head)
    # Under data parallelism vLLM V1 runs one engine core per DP rank, numbered as logged.
    dp_rank = int(engine_index.group(1)) if engine_index else None
    return ParsedLine(
        engine=ENGINE, kind="stats", ts_text=ts_text, log_ts_ns=log_ts_ns,
        ts_resolution_ns=resolution, dp_rank=dp_rank, values=values,
    )
