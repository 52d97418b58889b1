"""ToyServe: a made-up serving engine, test-only, added to gputrace as this one package and one
registration (``gputrace.engines.register(ENGINE)``; the test registers it for its own duration
only, so the rest of the suite sees the two real engines) and nothing else. Its log is a small
grammar of its own:

    [toy 2026-12-01 09:00:00.000] config pp=2 max_batch=8
    [toy 2026-12-01 09:00:01.000] step running=4 waiting=0 gen_tok_s=96.0 kv=0.10

(every second, engine-wide: admission up to ``max_batch`` requests, set by ``--max-batch``)."""

from __future__ import annotations

import re

from gputrace.engines.common import Engine, LogClock, ParsedLine, SchedulingPolicy, Value, convert_value
from gputrace.engines.knobs import Knob

KIND = "toy"
_LINE = re.compile(r"^\[toy (\d{4}-\d\d-\d\d) (\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?\] (step|config) (.*)$")
_PAIR = re.compile(r"(\w+)=(\S+)")
# its step fields -> SchedulerEvent's, with their types
_STEP = {"running": ("running_req", int), "waiting": ("queue_req", int),
         "gen_tok_s": ("gen_throughput_tok_s", float), "kv": ("token_usage", float)}
# its config names -> gputrace's settings (what the engine reads from its config lines)
_CONFIG = {"pp": "pp_size", "max_batch": "max_running_requests"}


def parse_line(line: str, clock: LogClock) -> ParsedLine | None:
    """One ToyServe line -> ParsedLine (a "stats" step or its "config"), None for any other."""
    m = _LINE.match(line.rstrip())
    if m is None:
        return None
    date, hms, frac, what, body = m.groups()
    log_ts_ns, resolution = clock.to_ns(date, hms, frac)
    pairs = dict(_PAIR.findall(body))
    stamp = {"ts_text": f"{date} {hms}", "log_ts_ns": log_ts_ns, "ts_resolution_ns": resolution}
    if what == "config":
        config: dict[str, object] = {k: int(v) for k, v in pairs.items() if v.isdigit()}
        config.update({_CONFIG[k]: v for k, v in list(config.items()) if k in _CONFIG})
        return ParsedLine(engine=KIND, kind="config", config=config, **stamp)  # type: ignore[arg-type]
    values: dict[str, Value] = {}
    for key, text in pairs.items():
        if key in _STEP:
            name, kind = _STEP[key]
            value = convert_value(text, kind)
            if value is not None:
                values[name] = value
    if not values:
        return None
    return ParsedLine(engine=KIND, kind="stats", values=values, **stamp)  # type: ignore[arg-type]


ENGINE = Engine(
    kind=KIND, name="ToyServe",
    knobs=(Knob("max_running_requests", "--max-batch", int, "requests running at once, engine-wide",
                "8", default=lambda s: 8, low=1, simulated=True, setting="max_batch",
                causes=("admission_bound",)),),
    log_fields=("gen_tok_s",),
    placement_rule="ToyServe rank order", placement_source="toy-rank-order",
    policy=SchedulingPolicy(microbatch_slots=False, mixed_prefill=True, cpu_forward_in_loop=False),
    parse_line=parse_line,
    maybe_line=re.compile(rb"\[toy "),
    steps_logged=False,  # a step line every second with engine-wide figures
    kv_advice="--kv-memory",
)
