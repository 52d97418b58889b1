"""SGLang's log grammar: its scheduler and startup lines, every known version, as ParsedLine: fields by name
(unknown ignored, missing None); any other line gives None; no input makes it raise.
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
from gputrace.engines.reprs import python_dict, python_kwargs, simple_kwargs

ENGINE = "sglang"  # the store's name of the engine

# A container runtime's own prefix (CRI ``<RFC3339> stdout F ``, ``docker logs -t``).
_RUNTIME_PREFIX = re.compile(
    r"^\s*\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)?\s+(?:(?:stdout|stderr)\s+[FP]\s+)?"
)
_MARKER = re.compile(
    r"(?<![\w-])(?:(?P<prefill>Prefill batch|Prefil batch|new fill batch)|(?P<decode>Decode batch))"
    r"(?: \[\d+\])?[.,](?: |$)"
    r"|(?<!\w)(?P<config>max_total_num_tokens=)"
    r"|(?<!\w)(?P<args>server_args=ServerArgs\()"
    r"|(?<!\w)(?P<args_dict>server_args=\{)"  # 0.5.x logs the resolved arguments as a dict
)
# v0.1 logged decode steps with no prefix and no "Decode batch" words.
_BARE_DECODE = re.compile(r"^\s*(?:\[[^\]]*\]\s*)?(?=#running-req: \d)")
_TIMESTAMP = re.compile(
    r"(?<![\d:.-])(?:(\d{4}-\d\d-\d\d)[ T])?(\d\d:\d\d:\d\d)(?:[.,](\d{1,9}))?(?![\d:])"
)
_BRACKETS = re.compile(r"\[([^\[\]]*)\]")
# a rank tag in a line prefix (PP3, TP0, ...) and the SchedulerEvent field each fills: shared with
# the batch parser (engines/fastpath.py)
RANK_TAG = re.compile(r"(?<![A-Za-z0-9_])(DP|PP|ATTN_CP|MOE_DP|TP|EP)(\d{1,9})(?![A-Za-z0-9_])")
RANK_FIELDS = {"DP": "dp_rank", "PP": "pp_rank", "TP": "tp_rank", "EP": "ep_rank"}
_GPU_TAG = re.compile(r"\[gpu(?:_id)?=(\d+)\]")
# A value is the text up to the next separator (a comma, a space, v0.1's ". "): the value rule
# (common.convert_value) decides whether it is one, so `-5`, `inf` or `1e309` are bad values,
# counted, not silently absent.
_FIELD = re.compile(r"(#?[A-Za-z][\w \-/()]*?): ([^\s,]*[^\s,.])")

# SGLang's field names (all versions) -> SchedulerEvent fields.
_KEYS: dict[str, str] = {
    "#running-req": "running_req",
    "#running_req": "running_req",
    "#queue-req": "queue_req",
    "#remaining_req": "queue_req",  # v0.1: requests still waiting after this prefill
    "#new-seq": "new_seq",
    "#seq": "new_seq",
    "#new-token": "new_token",
    "#new_token": "new_token",
    "#cached-token": "cached_token",
    "#cached_token": "cached_token",
    "#token": "num_token",
    "token usage": "token_usage",
    "gen throughput (token/s)": "gen_throughput_tok_s",
    "input throughput (token/s)": "input_throughput_tok_s",
    "cuda graph": "cuda_graph",
    "cpu graph": "cuda_graph",
    "npu graph": "cuda_graph",
    "musa graph": "cuda_graph",
}
# the field names its scheduler lines carry, as its report words (gputrace.engines.Engine.log_fields)
LOG_FIELDS = tuple(k for k in _KEYS if k.startswith("#"))
# Hybrid (SWA / mamba) models log the full-attention pool under these names instead.
_FALLBACK_KEYS: dict[str, str] = {"#full token": "num_token", "full token usage": "token_usage"}
_FIELD_TYPES: dict[str, type] = {
    "running_req": int, "queue_req": int, "new_seq": int, "new_token": int, "cached_token": int,
    "num_token": int, "token_usage": float, "gen_throughput_tok_s": float,
    "input_throughput_tok_s": float, "cuda_graph": bool,
}


def batch_fields(message: str) -> tuple[dict[str, Value], tuple[str, ...]]:
    """The SchedulerEvent metric fields named in a batch message (unknown names ignored), and the
    known fields whose value breaks the value rule (``name='text'``, not kept)."""
    values: dict[str, Value] = {}
    fallback: dict[str, Value] = {}
    bad: list[str] = []
    for key, text in _FIELD.findall(message):
        key = key.strip()
        name = _KEYS.get(key)
        target = values
        if name is None:
            name = _FALLBACK_KEYS.get(key)
            target = fallback
            if name is None:
                continue
        if name in target:
            continue
        value = convert_value(text, _FIELD_TYPES[name])
        if value is None:
            bad.append(f"{name}={text[:40]!a}")
        else:
            target[name] = value
    for name, value in fallback.items():
        values.setdefault(name, value)
    return values, tuple(bad)


def _prefix_fields(head: str, clock: LogClock) -> dict[str, object]:
    """Timestamp text and time, and ranks, from the text in front of the message."""
    out: dict[str, object] = {}
    stripped = head if head.startswith("[") else _RUNTIME_PREFIX.sub("", head, count=1)
    ts = _TIMESTAMP.search(stripped) or (_TIMESTAMP.search(head) if stripped != head else None)
    if ts is not None:
        date_text, hms, frac = ts.groups()
        out["ts_text"] = ts.group(0)
        out["log_ts_ns"], out["ts_resolution_ns"] = clock.to_ns(date_text, hms, frac)
    segments = _BRACKETS.findall(stripped) or [stripped]
    for segment in segments:
        for name, number in RANK_TAG.findall(segment):
            field_name = RANK_FIELDS.get(name)
            if field_name is not None and field_name not in out:
                out[field_name] = int(number)
    gpu = _GPU_TAG.search(head)
    if gpu is not None and "tp_rank" not in out:
        # Before PP existed (2024) the tag was the GPU id, which is base_gpu_id + tp_rank.
        out["tp_rank"] = int(gpu.group(1))
    return out


def parse_line(line: str, clock: LogClock) -> ParsedLine | None:
    """One SGLang log line -> ParsedLine, or None when it is not a scheduler/config line."""
    marker = _MARKER.search(line)
    if marker is None:
        bare = _BARE_DECODE.match(_RUNTIME_PREFIX.sub("", line, count=1))
        if bare is None:
            return None
        stripped = _RUNTIME_PREFIX.sub("", line, count=1)
        head, message, kind = stripped[: bare.end()], stripped[bare.end():], "decode"
    else:
        head, message = line[: marker.start()], line[marker.end():]
        if marker.group("prefill"):
            kind = "prefill"
        elif marker.group("decode"):
            kind = "decode"
        else:
            return _config_line(line, marker, clock)
    values, bad = batch_fields(message)
    if not values:  # not one value the rule takes: no scheduler line
        return None
    prefix = _prefix_fields(head, clock)
    return ParsedLine(engine=ENGINE, kind=kind, values=values, bad_values=bad,
                      **prefix)  # type: ignore[arg-type]


def _config_line(line: str, marker: re.Match[str], clock: LogClock) -> ParsedLine | None:
    if marker.group("args"):
        body = line[marker.end():].rstrip()
        body = body.removesuffix(")")
        fields = python_kwargs(body)
    elif marker.group("args_dict"):
        fields = python_dict(line[marker.end():].rstrip().removesuffix("}"))
    else:
        fields = simple_kwargs(line[marker.start():])
    if not fields:
        return None
    prefix = _prefix_fields(line[: marker.start()], clock)
    return ParsedLine(engine=ENGINE, kind="config", config=fields, bad_values=config_bad_values(fields),
                      **prefix)  # type: ignore[arg-type]
