"""A run store from a Prometheus that scraped gputrace's agents and collector, or what clusters
already run: dcgm-exporter's ``DCGM_FI_*`` series and the engine's own ``sglang:*``/``vllm:*``
metrics. GPU samples, one engine line per rank and step, phase markers where the target
concurrency changes, the topology from the agents' rank labels. Every time is Prometheus'
evaluation time (one clock for all hosts).

A range imported into a run that an import of the same server, step and matchers made adds only
the rows it lacks (each row is known by its series and step: store.RECORD_IDENTITY), so the same
range twice adds nothing and an overlapping one only its new steps; the markers are derived anew
from the load of both.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, NotRequired, TypedDict

import numpy as np

from gputrace import metric_names as mn
from gputrace.engines import ENGINE_WORDS, engine_words, vllm
from gputrace.errors import SourceError, UsageError
from gputrace.imports.report import ImportReport, write_rows
from gputrace.model import ENGINE_LOAD_SOURCE, DeviceInfo, EngineConfig, Marker
from gputrace.prometheus.client import MAX_POINTS_PER_SERIES, PrometheusClient, Series, chunk_windows
from gputrace.store import META_FILE, Column, Store
from gputrace.topology import MetaTopology, Placement, topology_to_meta

# The one metric-name table: each series' name -> (GpuSample field, the exporter's units per SI
# unit). gputrace's own first, then dcgm-exporter's, both schemas: before 4.9 GPU_UTIL in %, clocks
# in MHz, FB in MiB, energy in mJ; 4.9's names in SI units, 4.10's PCIe/NVLink *_PER_SECOND. Each
# series is converted by its own name, so a Prometheus holding both (an upgrade mid-range) reads
# both; where two give one field, the first found fills it.
GPU_FIELDS: dict[str, tuple[str, float]] = {
    m.name: (m.field, m.scale) for m in (*mn.GPU_GAUGES, mn.GPU_ENERGY, *mn.DCGM_ALL) if m.field}
GPU_FIELDS["DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"] = ("clock_event_reasons", 1.0)  # before DCGM 3.3
GPU_INT_FIELDS = ("memory_used_bytes", "memory_total_bytes", "clock_event_reasons")
ENGINE_FIELDS = {
    **{m.name: m.field for m in mn.ENGINE_GAUGES if m.field},
    # SGLang --enable-metrics, one series per pp_rank: set when the rank logs a batch, so
    # num_running_reqs is that micro-batch's size as #running-req is
    "sglang:num_running_reqs": "running_req",
    "sglang:num_queue_reqs": "queue_req",
    "sglang:gen_throughput": "gen_throughput_tok_s",
    "sglang:token_usage": "token_usage",
    **vllm.RANK_GAUGES,  # engine-wide (label engine), no PP rank
    "vllm:kv_cache_usage_perc": "token_usage",  # a ratio despite the name
}


def escaped(name: str) -> str:
    """A name as Prometheus stores it after an OpenMetrics scrape with ``escaping=underscores``:
    prometheus_client (0.22 and later) writes ``sglang:num_running_reqs`` as
    ``sglang_num_running_reqs`` when the scraper asks for OpenMetrics, as Prometheus 2.x does."""
    return name.replace(":", "_")


ENGINE_FIELDS.update({escaped(name): f for name, f in list(ENGINE_FIELDS.items()) if ":" in name})
# The engine whose metrics a series is, by its name's prefix (either spelling).
ENGINE_PREFIXES = {"sglang:": "sglang", "sglang_": "sglang", "vllm:": "vllm", "vllm_": "vllm"}
VLLM_E2E_SUM = "vllm:e2e_request_latency_seconds_sum"
# What the diagnosis uses, each with the series that can give it: the import says which it found.
SERIES_ROLES: dict[str, tuple[str, ...]] = {
    "GPU busy": (mn.GPU_UTILIZATION.name, "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
                 "DCGM_FI_DEV_GPU_UTIL_RATIO", "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO"),
    "SM activity": (mn.GPU_SM_ACTIVE.name, "DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_SM_UTIL_RATIO"),
    "GPU power": (mn.GPU_POWER.name, "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_BOARD_POWER_WATTS"),
    "PCIe traffic": (mn.GPU_PCIE_TX.name, "DCGM_FI_PROF_PCIE_TX_BYTES",
                     "DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND"),
    "clock events": (mn.GPU_CLOCK_EVENT_REASONS.name, "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
                     "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"),
    "engine running requests": (mn.ENGINE_RUNNING.name, "sglang:num_running_reqs",
                                "vllm:num_requests_running"),
    "engine queue": (mn.ENGINE_QUEUE.name, "sglang:num_queue_reqs", "vllm:num_requests_waiting"),
    "engine throughput": (mn.ENGINE_GENERATION_THROUGHPUT.name, "sglang:gen_throughput"),
    "client load": (mn.LOAD_INFLIGHT.name, mn.LOAD_TARGET_CONCURRENCY.name),
    "requests in system (end-to-end latency)": ("sglang:e2e_request_latency_seconds_sum",
                                                VLLM_E2E_SUM),
}
SERIES_ROLES = {role: (*names, *(escaped(n) for n in names if ":" in n))
                for role, names in SERIES_ROLES.items()}
TARGET_METRIC = mn.LOAD_TARGET_CONCURRENCY.name
BUSY_COUNTER = mn.GPU_BUSY.name  # where an agent exports it, the utilization of every NVML period
INFLIGHT_METRIC = mn.LOAD_INFLIGHT.name
# Requests in the system by Little's law: the rate at which SGLang's end-to-end latency sum grows
# is the mean number of requests in it over the window. Under PP the ranks' running gauges cannot
# give the engine's total where nothing waits (each holds one micro-batch, and ranks that hold the
# same one count it twice: C=1 reads pp_size); the law's figure bounds it there. (SGLang 0.5.23's
# sglang:http_requests_active would say it directly, but it reads high: 2-3 at C=1 and 20 at C=16
# on the real engine.) Its window is centred on each step (a trailing one lags a level step by
# half its length) and holds several requests' completions.
# SGLang's own timers per pp_rank, kept as the collector's engine-metrics source keeps them (the
# analysis takes each stage's busy figure from them where they rank above the GPUs' signal)
ENGINE_TIMERS = ("sglang:scheduler_stage_seconds_total", "sglang:forward_execution_seconds_total")
ENGINE_TIMER_METRICS = {**{n: n for n in ENGINE_TIMERS}, **{escaped(n): n for n in ENGINE_TIMERS}}
E2E_SUM = "sglang:e2e_request_latency_seconds_sum"
E2E_SUM_METRICS = (E2E_SUM, escaped(E2E_SUM), VLLM_E2E_SUM, escaped(VLLM_E2E_SUM))
LITTLE_WINDOW_S = 10.0
E2E_LABELS = frozenset({"model_name", "engine_type", "engine"})
MAX_STEPS = 5_000_000
"""Steps per import at most: each GPU metric is held as one float per step while stitching."""

# The labels each family carries: a --match matcher on one of these labels applies only to the
# families that carry it (run= picks the collector's series, the agents have no run label); a
# matcher on any other label (job, instance, ...) applies to every family.
AGENT_LABELS = frozenset({"host", "gpu", "uuid", "model", "pp_rank", "tp_rank",
                          # dcgm-exporter's
                          "UUID", "device", "modelName", "pci_bus_id", "Hostname", "hostname", "pod",
                          "namespace"})
ENGINE_LABELS = frozenset({"host", "pp_rank", "tp_rank", "dp_rank", "run", "model_name", "engine_type",
                           "engine", "moe_ep_rank"})
LOAD_LABELS = frozenset({"run"})
_KNOWN_LABELS = AGENT_LABELS | ENGINE_LABELS | LOAD_LABELS | E2E_LABELS

_MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*("(?:[^"\\]|\\.)*")\s*(,|$)')
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w|y)")
_DURATION_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000,
                "y": 31_536_000_000}


@dataclass(frozen=True, slots=True)
class Matcher:
    """One label matcher of --match, its value kept quoted as given."""

    label: str
    op: str
    quoted: str

    def __str__(self) -> str:
        return f"{self.label}{self.op}{self.quoted}"


# -- command-line values ----------------------------------------------------------------------

_LAST_UNIX_S = 253_402_300_799  # 9999-12-31T23:59:59Z, the last second a datetime holds


def parse_time_ms(text: str, what: str) -> int:
    """RFC 3339 (with a UTC offset) or unix seconds -> ms since the epoch."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = _rfc3339_s(text, what)
    # ns since the epoch must fit int64 and the report prints dates: 1e30 was "unexpected OverflowError"
    if not 0 <= seconds <= _LAST_UNIX_S:
        raise UsageError(f"{what} {text!r}: must be from 1970 to the end of 9999 "
                         f"(unix seconds 0 to {_LAST_UNIX_S})")
    return round(seconds * 1000)


def _rfc3339_s(text: str, what: str) -> float:
    try:
        dt = datetime.fromisoformat(text.strip())
    except ValueError:
        raise UsageError(f"{what} {text!r}: give RFC 3339 (2026-01-02T03:04:05Z) or unix seconds") from None
    if dt.tzinfo is None:
        raise UsageError(f"{what} {text!r}: RFC 3339 needs a UTC offset (Z or +hh:mm)")
    return dt.timestamp()


def parse_step_ms(text: str) -> int:
    """A Prometheus duration (``1s``, ``500ms``, ``1m30s``) or seconds (``0.5``) -> ms."""
    text = text.strip()
    try:
        ms = float(text) * 1000
    except ValueError:
        parts = _DURATION.findall(text)
        if not parts or "".join(n + u for n, u in parts) != text:
            raise UsageError(f"--step {text!r}: give a duration such as 1s, 500ms or 2m") from None
        ms = sum(float(n) * _DURATION_MS[u] for n, u in parts)
    if not math.isfinite(ms) or ms < 1 or ms != int(ms):
        raise UsageError(f"--step {text!r}: a whole number of milliseconds, at least 1 ms")
    return int(ms)


def scrape_interval_ms(client: PrometheusClient) -> int | None:
    """The shortest scrape interval of the server's active targets (None when it does not say:
    an older server, or a query front end such as Thanos without the targets API)."""
    try:
        data = client.get("/api/v1/targets", {"state": "active"})
    except SourceError:
        return None
    intervals = []
    for t in (data or {}).get("activeTargets", []) if isinstance(data, dict) else []:
        with contextlib.suppress(UsageError, TypeError, KeyError):
            intervals.append(parse_step_ms(t["scrapeInterval"]))
    return min(intervals) if intervals else None


def parse_matchers(text: str | None) -> list[Matcher]:
    """``{a="x", b=~"y.*"}`` (braces optional) -> matchers."""
    if not text or not text.strip():
        return []
    body = text.strip()
    if body.startswith("{") and body.endswith("}"):
        body = body[1:-1]
    out, pos = [], 0
    while pos < len(body) and body[pos:].strip():
        m = _MATCHER.match(body, pos)
        if not m:
            raise UsageError(f"--match {text!r}: expected label matchers such as {{run=\"x\"}} "
                             f"(at {body[pos:]!r})")
        out.append(Matcher(m.group(1), m.group(2), m.group(3)))
        pos = m.end()
    return out


def selector(names: Sequence[str], matchers: Sequence[Matcher], family_labels: frozenset[str]) -> str:
    """One selector for several metric names and the matchers that apply to their family."""
    parts = ['__name__=~"' + "|".join(re.escape(n) for n in names) + '"']
    parts += [str(m) for m in matchers if m.label in family_labels or m.label not in _KNOWN_LABELS]
    return "{" + ", ".join(parts) + "}"


# -- the import ---------------------------------------------------------------------------------

def _place(series: Series, start_ms: int, step_ms: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(grid index, value) of the series' points that fall on the grid."""
    k = (series.ts_ms - start_ms) // step_ms
    ok = (k >= 0) & (k < n) & ((series.ts_ms - start_ms) % step_ms == 0)
    return k[ok], series.values[ok]


def _fill(target: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    """Fill cells still empty: when several series map to one key (two scrape jobs, two runs),
    the first one seen wins."""
    empty = np.isnan(target[k])
    target[k[empty]] = v[empty]


def _busy_from_counter(counts: Sequence[Series], scraped: Sequence[Series], start_ms: int, step_ms: int,
                       n: int) -> dict[tuple[str, int], np.ndarray]:
    """Per (host, gpu): the share of each step's scrape interval the GPU was busy, from the agent's
    busy-seconds counter and its scrape times (``timestamp()``): the counter's increase since the
    previous scrape over the time between them. A step that shows the same scrape as the one
    before takes its ratio; NaN where the counter went back (an agent restart) or is missing."""
    times: dict[tuple[str, int], np.ndarray] = {}
    for s in scraped:
        gpu = _int_label(s.labels, "gpu")
        if gpu is not None:
            at = times.setdefault((gpu_host(s.labels), gpu), np.full(n, np.nan))
            _fill(at, *_place(s, start_ms, step_ms, n))
    out: dict[tuple[str, int], np.ndarray] = {}
    for s in counts:
        gpu = _int_label(s.labels, "gpu")
        key = (gpu_host(s.labels), gpu) if gpu is not None else None
        if key is None or key not in times or key in out:
            continue
        count = np.full(n, np.nan)
        _fill(count, *_place(s, start_ms, step_ms, n))
        at = np.flatnonzero(np.isfinite(count) & np.isfinite(times[key]))
        if len(at) < 2:
            continue
        c, t = count[at], times[key][at]
        new_scrape = np.r_[True, t[1:] != t[:-1]]
        first = np.flatnonzero(new_scrape)
        dc, dt = np.diff(c[first]), np.diff(t[first])
        ratio = np.full(len(first), np.nan)
        ok = (dt > 0) & (dc >= 0)
        ratio[1:][ok] = np.clip(dc[ok] / dt[ok], 0.0, 1.0)
        per_step = np.full(n, np.nan)
        per_step[at] = ratio[np.cumsum(new_scrape) - 1]
        out[key] = per_step
    return out


def _int_label(labels: dict[str, str], name: str) -> int | None:
    text = labels.get(name, "")
    return int(text) if text.lstrip("-").isdigit() else None


BUSY_FIELDS = ("utilization_ratio", "sm_active_ratio")  # what busy and bubble fractions come from
COARSE_STEP_RATIO = 1.5  # a step this much longer than the data's own interval drops samples
DATA_INTERVAL_WINDOW_MS = 3_600_000  # the samples counted to find the data's interval


def data_interval_ms(client: PrometheusClient, names: Sequence[str], matchers: Sequence[Matcher],
                     start_ms: int, end_ms: int) -> int | None:
    """The spacing of the samples the server holds for these series (the GPUs' busy ones): the
    last hour of the range (or all of it) over the samples in it (``count_over_time``, the
    median over the series); None when it cannot tell."""
    window_ms = min(end_ms - start_ms, DATA_INTERVAL_WINDOW_MS)
    if not names or window_ms < 1000:
        return None
    for name in names:  # one name a query: count_over_time drops the name, so two would collide
        expr = f"count_over_time({selector([name], matchers, AGENT_LABELS)}[{window_ms}ms])"
        try:
            data = client.get("/api/v1/query", {"query": expr, "time": f"{end_ms / 1000:.3f}"}, post=True)
            counts = [float(r["value"][1]) for r in (data or {}).get("result", [])]
        except (SourceError, TypeError, KeyError, IndexError, ValueError, AttributeError):
            continue
        counts = [c for c in counts if c > 1]
        if counts:
            return round(window_ms / float(np.median(counts)))
    return None


def coarse_step_reason(step_ms: int, interval_ms: int | None) -> str | None:
    """Why busy and bubble fractions cannot come from this step (None: they can): a step coarser
    than the data's own interval (a downsampled store, as Thanos' 5 m and 1 h resolutions, or a
    step longer than the scrape interval) keeps one sample of several, or their average, and a
    bubble is the time a stage idled between its samples' neighbours."""
    if interval_ms is None or step_ms <= COARSE_STEP_RATIO * interval_ms:
        return None
    interval_s = float(f"{interval_ms / 1000:.2g}")  # counted over a window: 1.007 s is 1 s
    return (f"the query step ({step_ms / 1000:g} s) is coarser than the GPU series' own interval "
            f"({interval_s:g} s; a downsampled store or a long step): busy and bubble fractions "
            f"are not given, they would be averaged away; query at --step {interval_s:g}s "
            "from a store that holds the raw samples")


# what must agree for a range to be added to a run an import made: the same series at the same steps
_SAME_IMPORT = ("source", "prometheus_url", "step_ms", "match")  # PrometheusImportMeta keys


class PrometheusImportMeta(TypedDict):
    """meta.json's ``extra`` of a Prometheus import: where and how it queried, what it found."""

    source: Literal["prometheus"]
    prometheus_url: str
    start_ms: int
    end_ms: int
    step_ms: int
    match: list[str]
    runs: list[str]
    note: str
    series_found: list[str]
    series_lacking: list[str]
    data_interval_ms: int | None
    bubble_refused: str | None
    utilization_from: str
    dcgm_schema: NotRequired[str]
    ranges: NotRequired[list[list[int]]]  # every range imported into the run, [start_ms, end_ms]


def _names(held: object) -> list[str]:
    """A list of names as meta.json holds it (anything else: none)."""
    return [str(v) for v in held] if isinstance(held, list) else []


def _held_ranges(held: Mapping[str, object]) -> list[list[int]]:
    """The ranges an earlier import wrote to meta.json (one written before ``ranges``: its own)."""
    ranges = held.get("ranges")
    if not isinstance(ranges, list):
        ranges = [[held.get("start_ms"), held.get("end_ms")]]
    return [[r[0], r[1]] for r in ranges
            if isinstance(r, list) and len(r) == 2 and isinstance(r[0], int) and isinstance(r[1], int)]


def _run_store(out: str | Path, name: str, topology: MetaTopology | None,
               extra: PrometheusImportMeta) -> Store:
    """A new run store at ``out``, or the one there that an import of the same server, step and
    matchers made (its meta.json's range grown to hold both); any other run there is refused."""
    if not (Path(out) / META_FILE).exists():
        return Store.create(out, name=name, topology=topology,
                            extra={**extra, "ranges": [[extra["start_ms"], extra["end_ms"]]]})
    store = Store.open(out)
    held = store.meta.extra  # as meta.json holds it
    same = [extra["source"], extra["prometheus_url"], extra["step_ms"], extra["match"]]
    if [held.get(k) for k in _SAME_IMPORT] != same:
        store.close()
        what = (f"an import from {held.get('prometheus_url')} at a {held.get('step_ms')} ms step"
                + (f" matching {', '.join(_names(held['match']))}" if held.get("match") else "")
                if held.get("source") == "prometheus" else "a run that is no Prometheus import")
        raise UsageError(f"{out} holds {what}: a Prometheus range is added only to an import of the same "
                         "server, step and --match; choose another --run-out")
    found = sorted(set(_names(held.get("series_found"))) | set(extra["series_found"]))
    ranges = [*_held_ranges(held), [extra["start_ms"], extra["end_ms"]]]
    grown: PrometheusImportMeta = {
        **extra, "start_ms": min(r[0] for r in ranges), "end_ms": max(r[1] for r in ranges), "ranges": ranges,
        "series_found": found,
        "series_lacking": [role for role, names in SERIES_ROLES.items() if not set(names) & set(found)],
        "runs": sorted(set(_names(held.get("runs"))) | set(extra["runs"]))}
    store.update_meta(topology=store.meta.topology or topology or {}, extra=grown)
    return store


def _markers_of_both(store: Store, load_source: str, target: np.ndarray, grid_ns: np.ndarray,
                     step_ms: int) -> list[Marker]:
    """The markers of the load the run holds (an earlier range's) and this range's, on one grid."""
    step_ns = step_ms * 1_000_000
    held = store.target_concurrency_of(load_source)
    lo = min([int(grid_ns[0]), *(ts + step_ns // 2 for ts, _ in held)])
    hi = max([int(grid_ns[-1]), *(ts + step_ns // 2 for ts, _ in held)])
    grid = lo + step_ns * np.arange((hi - lo) // step_ns + 1, dtype=np.int64)
    both = np.full(len(grid), np.nan)
    for ts, value in held:
        both[(ts + step_ns // 2 - lo) // step_ns] = value
    mine = (grid_ns - lo) // step_ns
    both[mine] = np.where(np.isnan(target), both[mine], target)
    return target_markers(both, grid)


def import_prometheus(client: PrometheusClient, out: str | Path, start_ms: int, end_ms: int, step_ms: int,
                      matchers: Sequence[Matcher] = (), engine_config: dict[str, int] | None = None,
                      max_points: int = MAX_POINTS_PER_SERIES, name: str | None = None) -> ImportReport:
    """Query [start, end] at ``step_ms`` and write a new run store at ``out``, or add to the one an
    import of the same server, step and matchers made there (only the rows it lacks)."""
    windows = chunk_windows(start_ms, end_ms, step_ms, max_points)
    n = (end_ms - start_ms) // step_ms + 1
    if n > MAX_STEPS:
        raise UsageError(f"the range holds {n:,} steps of {step_ms} ms (at most {MAX_STEPS:,}): "
                         "use a larger --step or a shorter range")
    grid_ns = (start_ms + step_ms * np.arange(n, dtype=np.int64)) * 1_000_000
    summary = ImportReport(client.base_url, "prometheus", windows=len(windows))

    def fetch(names: Sequence[str], labels: frozenset[str]) -> list[Series]:
        # One metric per query: a window then holds (GPUs x 11,000) points, not (GPUs x metrics x
        # 11,000), which keeps each answer to tens of MB of JSON on large deployments.
        return [s for name in names for s in client.query_range_chunked(
            selector([name], matchers, labels), start_ms, end_ms, step_ms, max_points)]

    gpu_series = fetch([*GPU_FIELDS, mn.GPU_LOST.name], AGENT_LABELS)
    busy_series = fetch([BUSY_COUNTER], AGENT_LABELS)
    busy_scraped_series = client.query_range_chunked(
        f"timestamp({selector([BUSY_COUNTER], matchers, AGENT_LABELS)})", start_ms, end_ms, step_ms,
        max_points) if busy_series else []
    engine_series = fetch(list(ENGINE_FIELDS), ENGINE_LABELS)
    timer_series = fetch(list(ENGINE_TIMER_METRICS), ENGINE_LABELS | {"category", "forward_overlap"})
    target_series = fetch([TARGET_METRIC], LOAD_LABELS)
    inflight_series = fetch([INFLIGHT_METRIC], LOAD_LABELS)
    # the latency sum a half window beyond each end: the window is centred on every step
    margin = max(round(LITTLE_WINDOW_S * 1000 / step_ms / 2), 1)
    in_system_series = [s for name in E2E_SUM_METRICS for s in client.query_range_chunked(
        selector([name], matchers, E2E_LABELS), start_ms - margin * step_ms, end_ms + margin * step_ms,
        step_ms, max_points)]
    interval_ms = data_interval_ms(client, sorted({s.labels.get("__name__", "") for s in gpu_series
                                                   if GPU_FIELDS.get(s.labels.get("__name__", ""), ("",))[0]
                                                   in BUSY_FIELDS}), matchers, start_ms, end_ms)
    refused = coarse_step_reason(step_ms, interval_ms)
    summary.queries = client.queries
    if not gpu_series and not engine_series:
        where = f" matching {{{', '.join(map(str, matchers))}}}" if matchers else ""
        raise SourceError(f"Prometheus {client.base_url}: no gputrace GPU or engine series, nor DCGM_FI_*, "
                          f"sglang:* or vllm:* ones, between {start_ms / 1000:.3f} and "
                          f"{end_ms / 1000:.3f}{where}")
    summary.found = sorted({s.labels.get("__name__", "") for s in
                            [*gpu_series, *busy_series, *engine_series, *timer_series, *target_series,
                             *inflight_series]}
                           | ({E2E_SUM_METRICS[0]} if in_system_series else set()))
    summary.lacking = [role for role, names in SERIES_ROLES.items() if not set(names) & set(summary.found)]
    summary.dcgm_schema = dcgm_schema(summary.found)

    # GPUs: one array per (host, gpu) and field; the labels give the device and its stage.
    gpus: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    devices: dict[tuple[str, int], DeviceInfo] = {}
    placements: dict[tuple[str, int], Placement] = {}
    for s in gpu_series:
        gpu = _int_label(s.labels, "gpu")
        if gpu is None:
            continue
        key = (gpu_host(s.labels), gpu)
        metric = s.labels.get("__name__", "")
        fields = gpus.setdefault(key, {})
        attr, scale = ("lost", 1.0) if metric == mn.GPU_LOST.name else GPU_FIELDS[metric]
        k, v = _place(s, start_ms, step_ms, n)
        _fill(fields.setdefault(attr, np.full(n, np.nan)), k, v / scale)
        lb = s.labels
        devices.setdefault(key, DeviceInfo(key[0], gpu, uuid=lb.get("uuid") or lb.get("UUID") or None,
                                           name=lb.get("model") or lb.get("modelName") or None,
                                           pci_bus_id=lb.get("pci_bus_id") or None))
        pp, tp = _int_label(s.labels, "pp_rank"), _int_label(s.labels, "tp_rank")
        if pp is not None:
            placements.setdefault(key, Placement(key[0], gpu, pp, tp or 0))

    counted = _busy_from_counter(busy_series, busy_scraped_series, start_ms, step_ms, n)
    for key, ratio in counted.items():
        if key in gpus:  # every NVML period of the step, where the gauge holds the last one
            gpus[key]["utilization_ratio"] = np.where(np.isfinite(ratio), ratio,
                                                      gpus[key].get("utilization_ratio", np.nan))

    # Engine ranks: one "decode" line per rank and step.
    ranks: dict[tuple[str, int, int, int], dict[str, np.ndarray]] = {}
    runs: set[str] = set()
    engines: set[str] = set()
    for s in engine_series:
        metric = s.labels.get("__name__", "")
        engines.add(next((e for p, e in ENGINE_PREFIXES.items() if metric.startswith(p)), "unknown"))
        rank = (s.labels.get("host", ""), _int_label(s.labels, "pp_rank") or 0,
                _int_label(s.labels, "tp_rank") or 0, _int_label(s.labels, "dp_rank") or 0)
        runs.add(s.labels.get("run", ""))
        arr = ranks.setdefault(rank, {}).setdefault(ENGINE_FIELDS[s.labels["__name__"]], np.full(n, np.nan))
        _fill(arr, *_place(s, start_ms, step_ms, n))

    target = np.full(n, np.nan)
    for s in sorted(target_series, key=lambda s: s.labels.get("run", "")):
        runs.add(s.labels.get("run", ""))
        _fill(target, *_place(s, start_ms, step_ms, n))
    inflight = np.full(n, np.nan)
    for s in sorted(inflight_series, key=lambda s: s.labels.get("run", "")):
        _fill(inflight, *_place(s, start_ms, step_ms, n))

    # The agents' rank labels give the mapping; without them the engine's ranks give the sizes.
    pp_size = max((p.pp_rank for p in placements.values()), default=-1) + 1 or \
        max((k[1] for k in ranks), default=-1) + 1
    tp_size = max((p.tp_rank for p in placements.values()), default=-1) + 1 or \
        max((k[2] for k in ranks), default=-1) + 1
    dp_size = max((k[3] for k in ranks), default=0) + 1
    ordered = sorted(placements.values(), key=lambda p: (p.host, p.gpu_index))
    topology = topology_to_meta(pp_size, tp_size, dp_size, ordered, "prometheus labels") \
        if placements else None
    summary.runs = sorted(r for r in runs if r)
    extra: PrometheusImportMeta = {
        "source": "prometheus", "prometheus_url": client.base_url, "start_ms": start_ms, "end_ms": end_ms,
        "step_ms": step_ms, "match": [str(m) for m in matchers], "runs": summary.runs,
        "note": "times are Prometheus evaluation times at the step; engine values are the collector's "
                "newest logged line per rank at each scrape; GPU values the agent's newest sample",
        "series_found": summary.found, "series_lacking": summary.lacking,
        "data_interval_ms": interval_ms, "bubble_refused": refused,
        "utilization_from": f"{BUSY_COUNTER} (each step: every NVML period since the previous scrape)"
                            if counted else "the utilization gauge (each step: the NVML period before it)",
    }
    if summary.dcgm_schema:
        extra["dcgm_schema"] = summary.dcgm_schema
    if refused:
        summary.problems.append(refused)
        for fields in gpus.values():  # the busy series at this step are averaged or skipped samples
            for name in BUSY_FIELDS:
                fields.pop(name, None)
    engine = next(iter(engines)) if len(engines) == 1 else "unknown"
    adding = (Path(out) / META_FILE).exists()
    with _run_store(out, name or f"prometheus-{start_ms // 1000}", topology, extra) as store:
        summary.gpus, summary.ranks = len(gpus), len(ranks)
        _write_gpus(store, summary, gpus, grid_ns)
        _write_engine(store, summary, ranks, grid_ns, step_ms, client.base_url, engine)
        write_rows(store, summary, "devices", list(devices.values()), unique=True)
        if timer_series:
            write_rows(store, summary, "engine_metrics", engine_timer_rows(timer_series, client.base_url),
                       unique=True)
        load_source = "prometheus " + INFLIGHT_METRIC
        if np.isnan(inflight).all() and engine in ENGINE_WORDS:
            in_system = requests_in_system(in_system_series, start_ms - margin * step_ms, step_ms,
                                           n + 2 * margin, margin)[margin:margin + n]
            pool = (engine_config or {}).get("max_running_requests")
            inflight, load_source = engine_load(ranks, n, in_system, pool, margin, engine), ENGINE_LOAD_SOURCE
        _write_load(store, summary, inflight, target, grid_ns, step_ms, load_source)
        if adding:
            markers = _markers_of_both(store, load_source, target, grid_ns, step_ms)
            store.replace_markers("prometheus", markers)
        else:
            write_rows(store, summary, "markers", target_markers(target, grid_ns))
        if engine_config:
            host = next(iter(sorted(ranks)), ("",))[0] or next(iter(sorted(gpus)), ("prometheus",))[0]
            config = EngineConfig(host, "command line", engine, 0, pp_size=pp_size or None,
                                  tp_size=tp_size or None, dp_size=dp_size,
                                  max_running_requests=engine_config.get("max_running_requests"),
                                  pp_max_micro_batch_size=engine_config.get("pp_max_micro_batch_size"))
            write_rows(store, summary, "engine_configs", [config], unique=True)
    return summary


def engine_timer_rows(series: Sequence[Series], url: str) -> dict[str, list[Any]]:
    """SGLang's timer counters as engine_metrics rows (Prometheus' evaluation times; the counter's
    value at each step, its canonical name, its labels less the scrape's own)."""
    keys = ("host", "source", "ts_ns", "name", "labels_json", "value")
    cols: dict[str, list[Any]] = {k: [] for k in keys}
    for s in series:
        name = ENGINE_TIMER_METRICS[s.labels.get("__name__", "")]
        labels = json.dumps({k: v for k, v in s.labels.items() if k not in ("__name__", "job", "instance")},
                            sort_keys=True)
        ok = ~np.isnan(s.values)
        n = int(ok.sum())
        cols["host"] += [s.labels.get("host", "") or s.labels.get("instance", "")] * n
        cols["source"] += [url] * n
        cols["ts_ns"] += (s.ts_ms[ok].astype(np.int64) * 1_000_000).tolist()
        cols["name"] += [name] * n
        cols["labels_json"] += [labels] * n
        cols["value"] += s.values[ok].astype(np.float64).tolist()
    return cols


def dcgm_schema(found: Sequence[str]) -> str:
    """Which dcgm-exporter schema the found series are in: "4.8" (the names before 4.9), "4.9",
    "4.10" (only the PCIe/NVLink names tell it from 4.9; "4.9+" without them), both joined by "+"
    (an upgrade within the range), or "" without DCGM_FI_* series."""
    have = set(found)
    old = {m.name for m in mn.DCGM_GAUGES}
    new = {m.name for m in mn.DCGM_GAUGES_4_9} | {m.name for m in mn.DCGM_GAUGES_4_10}
    per_second = {m.name for m in mn.DCGM_GAUGES_4_10} - old - {m.name for m in mn.DCGM_GAUGES_4_9}
    seen = []
    if have & (old - new):
        seen.append("4.8")
    if have & (new - old - per_second):
        seen.append("4.10" if have & per_second else "4.9" if have & (old & new) else "4.9+")
    elif have & per_second:
        seen.append("4.10")
    return "+".join(seen)


def _int_column(v: np.ndarray) -> np.ma.MaskedArray[Any, Any]:
    """Integers with NaN masked (stored as NULL)."""
    nan = np.isnan(v)
    return np.ma.MaskedArray(np.rint(np.where(nan, 0, v)).astype(np.int64), mask=nan)


def _write_gpus(store: Store, report: ImportReport, gpus: dict[tuple[str, int], dict[str, np.ndarray]],
                grid_ns: np.ndarray) -> int:
    total = 0
    for (host, gpu), fields in sorted(gpus.items()):
        values = {a: v for a, v in fields.items() if a != "lost"}
        present = np.zeros(len(grid_ns), dtype=bool)
        for v in values.values():
            present |= ~np.isnan(v)
        if not present.any():
            continue
        cols: dict[str, Column] = {"host": host, "gpu_index": gpu, "ts_ns": grid_ns[present]}
        for attr, v in values.items():
            cols[attr] = v[present]
            if attr in GPU_INT_FIELDS:
                cols[attr] = _int_column(v[present])
        if "lost" in fields:
            cols["lost"] = np.nan_to_num(fields["lost"][present]) > 0.5
        total += write_rows(store, report, "gpu_samples", cols, unique=True)
    return total


def gpu_host(labels: dict[str, str]) -> str:
    """The host of a GPU series: gputrace's ``host``, dcgm-exporter's ``Hostname`` (or
    ``hostname`` after a relabel), else the scrape target's address without its port."""
    for name in ("host", "Hostname", "hostname"):
        if labels.get(name):
            return labels[name]
    return labels.get("instance", "").rsplit(":", 1)[0]


def _write_engine(store: Store, report: ImportReport,
                  ranks: dict[tuple[str, int, int, int], dict[str, np.ndarray]],
                  grid_ns: np.ndarray, step_ms: int, url: str, engine: str = "unknown") -> int:
    total = numbered = 0
    source = f"prometheus {url}"
    # numbered on from the lines an earlier range brought (a line's number orders its source's lines)
    first_line = int(max(store.stored_line_numbers(source), default=-1)) + 1
    for (host, pp, tp, dp), fields in sorted(ranks.items()):
        present = np.zeros(len(grid_ns), dtype=bool)
        for v in fields.values():
            present |= ~np.isnan(v)
        rows = int(present.sum())
        if not rows:
            continue
        t = grid_ns[present]
        step_ns = step_ms * 1_000_000
        cols: dict[str, Column] = {
            "host": host, "source": source, "engine": engine, "kind": "decode",
            # The value at step t is the newest line at a scrape in (t - step, t]: the line goes
            # in the middle of that step, as the GPU cell (t - step, t] it sits beside.
            "line_no": first_line + numbered + np.arange(rows, dtype=np.int64), "log_ts_ns": t - step_ns,
            "ts_resolution_ns": step_ns, "recv_ts_ns": t - step_ns // 2,
            "pp_rank": pp, "tp_rank": tp, "dp_rank": dp,
        }
        for attr, v in fields.items():
            cols[attr] = v[present]
            if attr in ("running_req", "queue_req"):
                cols[attr] = _int_column(v[present])
        total += write_rows(store, report, "scheduler_events", cols, unique=True)
        numbered += rows
    return total


def requests_in_system(series: Sequence[Series], start_ms: int, step_ms: int, n: int,
                       half: int) -> np.ndarray:
    """Requests in the system at each step by Little's law: the growth of the end-to-end latency
    sum (summed over its series) from ``half`` steps before the step to ``half`` after, over that
    time. NaN where the window runs past the range, lacks a value, or a counter restarted."""
    total = np.zeros(n)
    present = np.zeros(n, dtype=bool)
    for s in series:
        values = np.full(n, np.nan)
        _fill(values, *_place(s, start_ms, step_ms, n))
        total += np.nan_to_num(values)
        present |= ~np.isnan(values)
    total[~present] = np.nan
    out = np.full(n, np.nan)
    if n > 2 * half:
        grown = total[2 * half:] - total[:-2 * half]
        out[half:n - half] = np.where(grown >= 0, grown / (2 * half * step_ms / 1000), np.nan)
    return out


def engine_load(ranks: dict[tuple[str, int, int, int], dict[str, np.ndarray]], n: int,
                in_system: np.ndarray | None = None, pool: int | None = None, half: int = 0,
                engine: str = "sglang") -> np.ndarray:
    """The offered load from the engine's own gauges where no client gauge exists: requests running
    plus waiting. SGLang's per-rank gauge holds the micro-batch that rank ran last; in a full
    pipeline every rank holds another one, so their sum is the engine's running requests (short by
    the slots beyond pp_size with --pp-async-batch-depth). Where nothing waits, fewer micro-batches
    than ranks may run and the sum counts one several times: where nothing waited within ``half``
    steps, the requests in the system by Little's law (``in_system``) bound it. The pool
    (max_running_requests, when given) bounds it always. The queue is rank 0's (the others
    replicate it). vLLM's gauges are engine-wide already, but read low: see ``vllm_load``."""
    running, queue = np.zeros(n), np.full(n, np.nan)
    for (_host, pp, tp, _dp), fields in sorted(ranks.items()):
        if tp != 0:
            continue
        if "running_req" in fields:
            running += np.nan_to_num(fields["running_req"])
        if "queue_req" in fields and (pp == 0 or np.isnan(queue).all()):
            queue = fields["queue_req"]
    if not engine_words(engine).microbatch_slots:  # the running gauge is engine-wide (vLLM)
        return np.asarray(vllm_load(np.minimum(running, pool) if pool else running, queue, in_system, half))
    if in_system is not None:
        # only where nothing waited across the law's whole window: a queue in it (a level that
        # fills the slots, or the step into one) leaves the sum standing
        nothing_waits = ~_within(np.nan_to_num(queue) >= 0.5, half) & ~np.isnan(in_system)
        running = np.where(nothing_waits, np.minimum(running, in_system), running)
    if pool:
        running = np.minimum(running, pool)
    total: np.ndarray = running + queue
    if in_system is not None:
        total = _lift_where_requests_wait(total, queue, in_system, half)
    return total


def _lift_where_requests_wait(total: np.ndarray, queue: np.ndarray, in_system: np.ndarray,
                              half: int) -> np.ndarray:
    """Where requests wait, a scrape catches ranks mid-turnover (a finished request's place not yet
    refilled, the next prefill still queued): SGLang's gauges read a level of 16 as 12-14 about as
    often as 16 on the real engine (CI, stop 31), and a level so read sat below the pool. Little's
    law (``in_system``) lifts a reading to the requests in the system, never above the most the
    gauges read within its window (its figure lumps with few completions in the window)."""
    waits = _within(np.nan_to_num(queue) >= 0.5, half)
    lifted = _law_capped_by_readings(in_system, total, half)
    out: np.ndarray = np.where(waits & (lifted > total), lifted, total)  # NaN readings stay NaN
    return out


def _law_capped_by_readings(in_system: np.ndarray, readings: np.ndarray, half: int) -> np.ndarray:
    """Little's law's figure, never above the most the gauges read within ``half`` steps (the
    law's figure lumps with few completions in its window); NaN where the law has no figure."""
    capped: np.ndarray = np.minimum(in_system, _rolling_max(np.nan_to_num(readings, nan=-np.inf), half))
    return capped


def vllm_load(running: np.ndarray, queue: np.ndarray, in_system: np.ndarray | None,
              half: int) -> np.ndarray:
    """vLLM's running and waiting gauges are set from the scheduler's stats on each output the
    front end handles, and at PP=2 they both read 0 at each batch turnover: a level of 16 read
    (8, 8) or (0, 0), and with the cores busy (0, 0) at nearly every scrape. A reading of 0 and 0
    while Little's law (``in_system``) says requests were in the engine is such a turnover, not a
    reading (nor where the law has no figure but one within ``half`` steps says so): it takes
    the mean of the true readings within ``half`` steps, and claims nothing
    (NaN) where there are none (the law's own figure is low: vLLM's end-to-end timer covers about
    half of a request's time on a busy CPU). A reading below the law's figure is then lifted to
    it, never above the most the gauges truly read within the window: the law's figure lumps up
    and down with few completions in its window."""
    total: np.ndarray = running + queue
    if in_system is None:
        return total
    # the law's figure within the window: it has none at some steps (a window short of values)
    turnover = (total == 0) & (_rolling_max(np.nan_to_num(in_system, nan=-np.inf), half) >= 0.5)
    readings = np.where(turnover, np.nan, total)
    read = np.where(turnover, _rolling_mean(readings, half), total)
    lifted = _law_capped_by_readings(in_system, readings, half)
    out: np.ndarray = np.where(lifted > read, lifted, read)  # a step with no reading stays NaN
    return out


def _rolling_mean(values: np.ndarray, half: int) -> np.ndarray:
    """The mean of the values present within ``half`` steps either side; NaN where none is."""
    present = ~np.isnan(values)
    pad = np.zeros(half)
    sums = np.lib.stride_tricks.sliding_window_view(
        np.concatenate([pad, np.where(present, values, 0.0), pad]), 2 * half + 1).sum(axis=1)
    counts = np.lib.stride_tricks.sliding_window_view(
        np.concatenate([pad, present.astype(float), pad]), 2 * half + 1).sum(axis=1)
    mean: np.ndarray = np.divide(sums, counts, out=np.full(len(values), np.nan), where=counts > 0)
    return mean


def _within(flags: np.ndarray, half: int) -> np.ndarray:
    """Where any flag is set within ``half`` steps either side."""
    if not half:
        return flags
    padded = np.concatenate([np.zeros(half, bool), flags, np.zeros(half, bool)])
    return np.asarray(np.lib.stride_tricks.sliding_window_view(padded, 2 * half + 1).any(axis=1))


def _rolling_max(values: np.ndarray, half: int) -> np.ndarray:
    """The largest value within ``half`` steps either side."""
    padded = np.concatenate([np.full(half, -np.inf), values, np.full(half, -np.inf)])
    rolled: np.ndarray = np.lib.stride_tricks.sliding_window_view(padded, 2 * half + 1).max(axis=1)
    return rolled


def _write_load(store: Store, report: ImportReport, inflight: np.ndarray, target: np.ndarray,
                grid_ns: np.ndarray, step_ms: int, source: str = "prometheus " + INFLIGHT_METRIC) -> int:
    """The client's in-flight gauge as load samples: the value at step t was scraped in
    (t - step, t], so it is placed mid-step like the engine's lines."""
    present = ~np.isnan(inflight)
    if not present.any():
        return 0
    return write_rows(store, report, "load_samples", {
        "source": source, "ts_ns": grid_ns[present] - step_ms * 500_000,
        "inflight_requests": inflight[present], "target_concurrency": _int_column(target[present])},
        unique=True)


def target_markers(target: np.ndarray, grid_ns: np.ndarray) -> list[Marker]:
    """A "phase" marker ("C=<n>") where the target concurrency takes a new value; an "end" marker
    where a level stops (a new value, or none: the load finished).

    A change shows at the first scrape after it, so it lies somewhere in the two steps before the
    step that shows it: those steps may hold either level and are left out of both (the level
    before ends two steps early; the new one starts at the step that shows it, whose cells come
    after it).
    """
    out: list[Marker] = []
    step = int(grid_ns[1] - grid_ns[0]) if len(grid_ns) > 1 else 0
    prev = np.concatenate([[np.nan], target[:-1]])
    changed = ~((target == prev) | (np.isnan(target) & np.isnan(prev)))
    phase_start: int | None = None
    for i in np.flatnonzero(changed):  # a handful of level changes
        t = int(grid_ns[i])
        if phase_start is not None:
            out.append(Marker("prometheus", max(t - 2 * step, phase_start), "end", kind="end"))
        if np.isnan(target[i]):
            phase_start = None
            continue
        level = round(float(target[i]))
        out.append(Marker("prometheus", t, f"C={level}", kind="phase", target_concurrency=level))
        phase_start = t
    return out
