"""Importers of per-request records that other benchmark tools wrote: AIPerf ``profile_export.jsonl``,
guidellm's JSON benchmarks report, and gputrace's own requests JSONL, into a run store.

Each ``parse_*`` is a pure function (path -> an ImportReport holding the records and the bad rows);
each ``import_*`` writes what it parsed into a Store. Bad rows are counted and reported, never
fatal; a file of the wrong kind is one ConfigError line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

from gputrace.errors import ConfigError
from gputrace.imports.jsonl import record_from_obj
from gputrace.imports.report import ImportReport, read_text, write_parsed
from gputrace.json_types import JsonObject
from gputrace.model import Marker, RequestRecord
from gputrace.store import Store

_C_LABEL = re.compile(r"^C=(\d+)$")


class _BadValue(ValueError):
    """A value no record field can take (NaN, Infinity, 1e400): its row is skipped with this reason."""


def _json_lines(text: str) -> Iterator[tuple[int, Any | None, str]]:
    """(line number, parsed object or None, why not) for each non-empty line. NaN and Infinity
    parse (Python's json.dumps writes them); the fields that hold them are judged per row."""
    for no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield no, json.loads(line), ""
        except ValueError:
            yield no, None, "not JSON"
        except RecursionError:
            yield no, None, "JSON nested too deeply"


def _number(value: Any) -> float | int | None:
    """A JSON number (not a bool) or None; _BadValue when it is not finite."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        raise _BadValue(f"{value!r} where a finite number belongs")
    return value


def _ns(seconds: Any) -> int | None:
    value = _number(seconds)
    return None if value is None else round(float(value) * 1e9)


def _int(value: Any) -> int | None:
    number = _number(value)
    return None if number is None else int(number)


def _target(label: str | None) -> int | None:
    m = _C_LABEL.match(label or "")
    return int(m.group(1)) if m else None


def _phase_markers(requests: Sequence[RequestRecord], label: str | None, host: str) -> list[Marker]:
    """A phase marker at the first start and an end marker at the last end of ``requests``."""
    if not label or not requests:
        return []
    t0 = min(r.start_ns for r in requests)
    t1 = max(r.end_ns if r.end_ns is not None else r.start_ns for r in requests)
    return [
        Marker(host=host, ts_ns=t0, label=label, kind="phase", target_concurrency=_target(label)),
        Marker(host=host, ts_ns=t1, label="end", kind="end"),
    ]


# -- AIPerf ---------------------------------------------------------------------------------------

_TIME_UNITS_NS = {"ns": 1.0, "us": 1e3, "µs": 1e3, "ms": 1e6, "s": 1e9, "sec": 1e9}


def _section(obj: JsonObject, key: str) -> JsonObject | None:
    """``obj[key]`` where it is a JSON object, else None."""
    value = obj.get(key)
    return value if isinstance(value, dict) else None


def _aiperf_metric_ns(metrics: JsonObject, name: str) -> float | None:
    """A time metric ({"value": 255.9, "unit": "ms"}) in ns."""
    m = _section(metrics, name)
    value = _number(m.get("value")) if m is not None else None
    if m is None or value is None:
        return None
    scale = _TIME_UNITS_NS.get(str(m.get("unit", "ms")))
    return None if scale is None else float(value) * scale


def _aiperf_metric(metrics: JsonObject, *names: str) -> int | None:
    for name in names:
        m = _section(metrics, name)
        value = _int(m.get("value")) if m is not None else None
        if value is not None:
            return value
    return None


def _aiperf_request(obj: Any, no: int, host: str, phase: str | None) -> RequestRecord | str:
    """One profile_export line as a record, or why it is none."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(meta, dict):
        return "no 'metadata' object"
    metrics = obj.get("metrics") if isinstance(obj.get("metrics"), dict) else {}
    # Older AIPerf wrote timestamp_ns where newer writes request_start_ns.
    start = _int(meta.get("request_start_ns", meta.get("timestamp_ns")))
    if start is None:
        return "no request_start_ns"
    end = _int(meta.get("request_end_ns"))
    if end is None and (latency := _aiperf_metric_ns(metrics, "request_latency")) is not None:
        end = start + int(latency)
    ttft = _aiperf_metric_ns(metrics, "time_to_first_token")
    err = obj.get("error")
    error = None
    if err:
        error = (
            f"{err.get('type') or 'error'} ({err.get('code')}): {err.get('message') or ''}".strip()
            if isinstance(err, dict) else str(err)
        )[:200]
    rid = meta.get("x_request_id") or obj.get("record_id") or f"aiperf-{meta.get('session_num', no)}"
    label = "warmup" if meta.get("benchmark_phase") == "warmup" else phase
    return RequestRecord(
        host=host,
        request_id=str(rid),
        start_ns=start,
        first_token_ns=start + int(ttft) if ttft is not None else None,
        end_ns=end,
        prompt_tokens=_aiperf_metric(metrics, "input_sequence_length", "error_isl"),
        completion_tokens=_aiperf_metric(metrics, "output_sequence_length", "output_token_count"),
        ok=error is None,
        error=error,
        phase=label,
        source="aiperf",
    )


def parse_aiperf(path: str | os.PathLike[str], host: str, phase: str | None = None) -> ImportReport:
    """AIPerf's per-request ``profile_export.jsonl`` (one MetricRecordInfo per line: ``metadata``
    with request_start_ns/request_end_ns, ``metrics`` with units, ``error``). ``phase`` (e.g.
    "C=32") labels the run, which AIPerf runs at one concurrency, and adds its markers."""
    text = read_text(path)
    out = ImportReport(str(path), "aiperf")
    requests: list[RequestRecord] = []
    lines = 0
    for no, obj, why in _json_lines(text):
        lines += 1
        if obj is None:
            out.skip(f"line {no}", why)
            continue
        try:
            request = _aiperf_request(obj, no, host, phase)
        except _BadValue as exc:
            out.skip(f"line {no}", str(exc))
            continue
        if isinstance(request, str):
            out.skip(f"line {no}", request)
        else:
            requests.append(request)
    if lines and not requests:
        hint = ""
        if text.lstrip().startswith("{") and '"records"' in text[:20000]:
            hint = " (that looks like the aggregate profile_export_aiperf.json)"
        raise ConfigError(
            f"{path}: not an AIPerf profile_export.jsonl: no line has 'metadata' with "
            f"request_start_ns{hint}"
        )
    out.records.extend(requests)
    out.records.extend(_phase_markers([r for r in requests if r.phase == phase], phase, host))
    return out


def import_aiperf(
    store: Store, path: str | os.PathLike[str], host: str, phase: str | None = None
) -> ImportReport:
    return write_parsed(store, parse_aiperf(path, host, phase))


# -- guidellm -------------------------------------------------------------------------------------


def _guidellm_label(bench: JsonObject, index: int) -> tuple[str, int | None]:
    """The phase label of one benchmark from its scheduling strategy ("C=8" for concurrent)."""
    strategy = None
    for key in ("config", "scheduler", "args", "settings"):
        section = _section(bench, key)
        strategy = _section(section, "strategy") if section is not None else None
        if strategy is not None:
            break
    if strategy is None:
        return f"benchmark {index}", None
    kind = strategy.get("type_") or strategy.get("type")
    streams = strategy.get("streams")
    if kind == "concurrent" and isinstance(streams, int):
        return f"C={streams}", int(streams)
    if kind == "synchronous":
        return "C=1", 1
    rate = strategy.get("rate")
    if isinstance(rate, int | float):
        return f"{kind}@{rate:g}/s", None
    return str(kind or f"benchmark {index}"), None


def _guidellm_request(
    obj: JsonObject, status: str, host: str, label: str, fallback_id: str
) -> RequestRecord | None:
    """One GenerativeRequestStats in any of guidellm's three layouts, or None when it has no start."""
    info, sched = _section(obj, "info"), _section(obj, "scheduler_info")
    if info is not None and (t := _section(info, "timings")) is not None:  # 0.4+: info.timings
        start = _ns(t.get("request_start", t.get("resolve_start")))
        first = _ns(t.get("first_token_iteration", t.get("first_request_iteration")))
        end = _ns(t.get("request_end", t.get("resolve_end")))
        prompt = _int(obj.get("prompt_tokens", (_section(obj, "input_metrics") or {}).get("total_tokens")))
        output = _int(obj.get("output_tokens", (_section(obj, "output_metrics") or {}).get("total_tokens")))
        error = info.get("error")
    elif sched is not None and (t := _section(sched, "request_timings")) is not None:  # 0.3: scheduler_info
        start, first = _ns(t.get("request_start")), _ns(t.get("first_iteration"))
        end = _ns(t.get("request_end"))
        prompt, output = _int(obj.get("prompt_tokens")), _int(obj.get("output_tokens"))
        error = obj.get("error")
    else:  # 0.2: flat start_time / first_token_time / end_time
        start, first = _ns(obj.get("start_time")), _ns(obj.get("first_token_time"))
        end = _ns(obj.get("end_time"))
        prompt, output = _int(obj.get("prompt_tokens")), _int(obj.get("output_tokens"))
        error = obj.get("error")
    if start is None:
        return None
    ok = status == "successful"
    if not ok and not error:
        error = status
    return RequestRecord(
        host=host,
        request_id=str(obj.get("request_id") or fallback_id),
        start_ns=start,
        first_token_ns=first,
        end_ns=end,
        prompt_tokens=prompt,
        completion_tokens=output if ok or output else None,
        ok=ok,
        error=None if ok else str(error)[:200],
        phase=label,
        source="guidellm",
    )


# Deeper than any guidellm report nests (about 8 levels); far below Python's recursion limit.
MAX_JSON_DEPTH = 200
_JSON_STRUCTURE = re.compile(r'[\[\]{}"\\]')


def _json_without_deep_values(text: str, out: ImportReport) -> Any:
    """A JSON document whose values nested past MAX_JSON_DEPTH are read as null, each counted in
    ``out`` as a bad row; ConfigError when it is still not JSON."""
    kept: list[str] = []
    depth, begin, in_string, escaped_at, cut_from = 0, 0, False, -1, -1
    for m in _JSON_STRUCTURE.finditer(text):
        char, at = m.group(), m.start()
        if in_string:
            if at == escaped_at:  # \" or \\ inside a string
                continue
            if char == "\\":
                escaped_at = at + 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth == MAX_JSON_DEPTH + 1:
                cut_from = at
        elif char in "]}":
            if depth == MAX_JSON_DEPTH + 1:
                kept += [text[begin:cut_from], "null"]
                begin = at + 1
                out.skip(f"character {cut_from}",
                         f"a value nested deeper than {MAX_JSON_DEPTH} levels (read as null)")
            depth -= 1
    kept.append(text[begin:])
    try:
        return json.loads("".join(kept))
    except (ValueError, RecursionError):
        raise ConfigError(f"{out.path}: not a guidellm JSON report (not JSON)") from None


def parse_guidellm(path: str | os.PathLike[str], host: str) -> ImportReport:
    """guidellm's benchmarks report (``benchmarks.json``: GenerativeBenchmarksReport): each benchmark
    of the sweep becomes a phase ("C=8" for a concurrent strategy), with its successful,
    incomplete and errored requests."""
    text = read_text(path)
    out = ImportReport(str(path), "guidellm")
    try:
        report = json.loads(text)
    except ValueError:
        raise ConfigError(
            f"{path}: not a guidellm JSON report (not JSON; YAML and CSV reports are not read)"
        ) from None
    except RecursionError:  # one value nested past any report's depth: that value goes, not the file
        report = _json_without_deep_values(text, out)
    benchmarks = report.get("benchmarks") if isinstance(report, dict) else None
    if not isinstance(benchmarks, list):
        raise ConfigError(f"{path}: not a guidellm benchmarks report (no top-level 'benchmarks' list)")
    markers: list[Marker] = []
    last_end: int | None = None
    for bi, bench in enumerate(benchmarks):
        if not isinstance(bench, dict) or not isinstance(bench.get("requests"), dict):
            out.skip(f"benchmark {bi}", "no 'requests' breakdown")
            continue
        label, target = _guidellm_label(bench, bi)
        mine: list[RequestRecord] = []
        for status in ("successful", "incomplete", "errored"):
            items = bench["requests"].get(status) or []
            for ri, item in enumerate(items if isinstance(items, list) else []):
                try:
                    rec = _guidellm_request(item, status, host, label, f"guidellm-{bi}-{status}-{ri}") \
                        if isinstance(item, dict) else None
                except _BadValue as exc:
                    out.skip(f"benchmark {bi} {status}[{ri}]", str(exc))
                    continue
                if rec is None:
                    out.skip(f"benchmark {bi} {status}[{ri}]", "no request start time")
                    continue
                mine.append(rec)
        if not mine:
            continue
        try:
            start = _ns(bench.get("start_time")) or min(r.start_ns for r in mine)
        except _BadValue:  # the benchmark's own start is not a time: its first request's is
            start = min(r.start_ns for r in mine)
        markers.append(Marker(host=host, ts_ns=start, label=label, kind="phase", target_concurrency=target))
        ends = [r.end_ns for r in mine if r.end_ns is not None]
        last_end = max([*ends, last_end or 0]) or None
        out.records.extend(mine)
    if markers and last_end is not None:
        markers.append(Marker(host=host, ts_ns=max(last_end, markers[-1].ts_ns), label="end", kind="end"))
    out.records.extend(markers)
    return out


def import_guidellm(store: Store, path: str | os.PathLike[str], host: str) -> ImportReport:
    return write_parsed(store, parse_guidellm(path, host))


# -- gputrace's own JSONL -------------------------------------------------------------------------


def parse_requests_jsonl(path: str | os.PathLike[str], host: str | None = None) -> ImportReport:
    """``gputrace load --out`` files: request and marker lines (``host`` replaces theirs if given)."""
    out = ImportReport(str(path), "gputrace-jsonl")
    lines = 0
    for no, obj, why in _json_lines(read_text(path)):
        lines += 1
        record = record_from_obj(obj)
        if record is None:
            out.skip(f"line {no}", why or "not a gputrace request or marker")
            continue
        if host is not None and record.host != host:
            record = dataclasses.replace(record, host=host)
        out.records.append(record)
    if lines and not out.records:
        raise ConfigError(
            f"{path}: not a gputrace requests JSONL (lines need \"type\": \"request\" or \"marker\")"
        )
    return out


def import_requests_jsonl(
    store: Store, path: str | os.PathLike[str], host: str | None = None
) -> ImportReport:
    return write_parsed(store, parse_requests_jsonl(path, host))
