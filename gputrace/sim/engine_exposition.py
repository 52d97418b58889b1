"""The engine's own Prometheus metrics as the simulated engine would expose them: SGLang's
``sglang:*`` gauges per ``pp_rank`` (set when a rank logs a batch, as SGLang's metrics collector
is), its token and forward-time counters and its end-to-end latency histogram; vLLM's
engine-wide ``vllm:*`` series. One snapshot model, two drivers: the virtual run's store (a scrape
every second) and the real-time server's ``/metrics``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gputrace.exposition import (
    Collector,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from gputrace.sim.params import SimParams

SCRAPE_S = 1.0
# The log fields whose newest value each SGLang rank's gauge holds.
SGLANG_GAUGES = {"running_req": "sglang:num_running_reqs", "queue_req": "sglang:num_queue_reqs",
                 "token_usage": "sglang:token_usage", "gen_throughput": "sglang:gen_throughput"}


@dataclass
class MetricSnapshot:
    """What the engine's metrics say at one moment."""

    stage_fields: list[dict[str, float]]  # per PP rank: the newest logged value of each field
    tokens_total: float = 0.0  # tokens generated so far (every rank runs every micro-batch)
    forward_s: list[float] = field(default_factory=list)  # per rank: kernel time so far
    running: int = 0  # engine-wide (vLLM's scheduler stats)
    waiting: int = 0
    kv_usage_ratio: float = 0.0
    e2e_latency_sum_s: float = 0.0  # the finished requests' end-to-end latencies, summed
    e2e_count: int = 0  # the finished requests


# sample name, labels, value, and "gauge", "counter" or "histogram" (a histogram's _sum or _count)
Sample = tuple[str, dict[str, str], float, str]
E2E = "sglang:e2e_request_latency_seconds"  # SGLang's histogram (its _sum and _count; no buckets here)


def snapshot_samples(p: SimParams, snap: MetricSnapshot) -> list[Sample]:
    """The samples a scrape of the engine's /metrics would read."""
    if p.engine == "vllm":
        labels = {"model_name": p.model_path, "engine": "0"}
        return [("vllm:num_requests_running", labels, float(snap.running), "gauge"),
                ("vllm:num_requests_waiting", labels, float(snap.waiting), "gauge"),
                ("vllm:kv_cache_usage_perc", labels, snap.kv_usage_ratio, "gauge"),
                ("vllm:generation_tokens_total", labels, snap.tokens_total, "counter")]
    model = {"model_name": p.model_path}
    out: list[Sample] = [(E2E + "_sum", model, snap.e2e_latency_sum_s, "histogram"),
                         (E2E + "_count", model, float(snap.e2e_count), "histogram")]
    for s, fields in enumerate(snap.stage_fields):
        labels = {"model_name": p.model_path, "engine_type": "unified", "tp_rank": "0", "pp_rank": str(s)}
        out += [(name, labels, float(fields[f]), "gauge") for f, name in SGLANG_GAUGES.items() if f in fields]
        out.append(("sglang:realtime_tokens_total", labels, snap.tokens_total, "counter"))
        if p.device_timer and s < len(snap.forward_s):  # SGLANG_ENABLE_METRICS_DEVICE_TIMER=1 only
            out.append(("sglang:forward_execution_seconds_total", labels, snap.forward_s[s], "counter"))
    return out


class SnapshotCollector(Collector):
    """A prometheus_client collector over a function that returns the current snapshot."""

    def __init__(self, p: SimParams, snapshot: Any):
        self.p = p
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        samples = snapshot_samples(self.p, self.snapshot())
        histogram = {name: (labels, value) for name, labels, value, kind in samples if kind == "histogram"}
        if histogram:
            labels, total = histogram[E2E + "_sum"]
            fam_h = HistogramMetricFamily(E2E, E2E, labels=list(labels))
            fam_h.add_metric(list(labels.values()), [("+Inf", histogram[E2E + "_count"][1])], total)
            yield fam_h
        for name, labels, value, kind in samples:
            if kind == "histogram":
                continue
            fam = families.get(name)
            if fam is None:
                base = name.removesuffix("_total")
                fam = (CounterMetricFamily(base, base, labels=list(labels)) if kind == "counter"
                       else GaugeMetricFamily(name, name, labels=list(labels)))
                families[name] = fam
            fam.add_metric(list(labels.values()), value)
        yield from families.values()


# -- the virtual run: a scrape every second ------------------------------------------------------

def _newest(t_ns: np.ndarray, values: np.ndarray, at_ns: np.ndarray) -> np.ndarray:
    """The newest value at or before each of ``at_ns`` (NaN before the first); t_ns sorted."""
    i = np.searchsorted(t_ns, at_ns, side="right") - 1
    out = np.where(i >= 0, values[np.maximum(i, 0)], np.nan)
    return np.asarray(out, dtype=np.float64)


def _cumulative(t: np.ndarray, amounts: np.ndarray, at: np.ndarray) -> np.ndarray:
    order = np.argsort(t, kind="stable")
    total = np.concatenate([[0.0], np.cumsum(amounts[order])])
    return np.asarray(total[np.searchsorted(t[order], at, side="right")], dtype=np.float64)


def virtual_metric_rows(p: SimParams, start_ns: int, end_s: float, trace: Any,
                        events: Mapping[str, np.ndarray], host: str, source: str,
                        latencies: tuple[np.ndarray, np.ndarray] = (np.zeros(0), np.zeros(0)),
                        ) -> dict[str, Any]:
    """The ``engine_metrics`` columns a collector scraping every second would have stored.

    ``events`` are the run's parsed scheduler lines (columns with ``recv_ts_ns`` the emission time);
    ``latencies`` the finished requests' (finish times, end-to-end latencies) in seconds.
    """
    at_s = np.arange(SCRAPE_S / 2, end_s, SCRAPE_S)
    at_ns = start_ns + np.rint(at_s * 1e9).astype(np.int64)
    tokens = _cumulative(np.asarray(trace.tok_t, dtype=np.float64),
                         np.asarray(trace.tok_n, dtype=np.float64), at_s)
    intervals = trace.interval_columns()
    stage, iv_end = intervals["stage"], intervals["end_s"]
    busy = iv_end - intervals["start_s"]
    forward = [_cumulative(iv_end[stage == s], busy[stage == s], at_s) for s in range(p.pp_size)]
    finish_s, latency_s = latencies
    e2e_sum = _cumulative(finish_s, latency_s, at_s)
    e2e_count = _cumulative(finish_s, np.ones_like(finish_s), at_s)
    columns: dict[str, list[Any]] = {"ts_ns": [], "name": [], "labels_json": [], "value": []}
    per_stage = _stage_gauges(p, events, at_ns)
    st_t = np.asarray(trace.st_t, dtype=np.float64)
    for k, t_ns in enumerate(at_ns.tolist()):
        last = int(np.searchsorted(st_t, at_s[k], side="right")) - 1
        snap = MetricSnapshot(
            stage_fields=[{f: float(v[k]) for f, v in fields.items() if not np.isnan(v[k])}
                          for fields in per_stage],
            tokens_total=float(tokens[k]), forward_s=[float(f[k]) for f in forward],
            running=trace.st_running[last] if last >= 0 else 0,
            waiting=trace.st_waiting[last] if last >= 0 else 0,
            kv_usage_ratio=trace.st_kv_used[last] / p.max_total_num_tokens if last >= 0 else 0.0,
            e2e_latency_sum_s=float(e2e_sum[k]), e2e_count=int(e2e_count[k]))
        for name, labels, value, _kind in snapshot_samples(p, snap):
            columns["ts_ns"].append(t_ns)
            columns["name"].append(name)
            columns["labels_json"].append(json.dumps(labels, sort_keys=True))
            columns["value"].append(value)
    return {"host": host, "source": source, **{k: np.asarray(v) for k, v in columns.items()}}


def _stage_gauges(p: SimParams, events: Mapping[str, np.ndarray], at_ns: np.ndarray
                  ) -> list[dict[str, np.ndarray]]:
    """Per rank and field, the newest logged value at each scrape (gen throughput from decode lines)."""
    if not p.engine_spec.steps_logged or not len(events.get("recv_ts_ns", ())):  # vLLM: no rank lines
        return [{} for _ in range(p.pp_size)]
    out = []
    for s in range(p.pp_size):
        mine = np.asarray(events["pp_rank"]) == s
        t = np.asarray(events["recv_ts_ns"])[mine]
        order = np.argsort(t, kind="stable")
        t = t[order]
        decode = (np.asarray(events["kind"])[mine] == "decode")[order]
        fields = {f: _newest(t, np.asarray(events[c], dtype=np.float64)[mine][order], at_ns)
                  for f, c in (("running_req", "running_req"), ("queue_req", "queue_req"),
                               ("token_usage", "token_usage"))}
        gen = np.asarray(events["gen_throughput_tok_s"], dtype=np.float64)[mine][order]
        fields["gen_throughput"] = _newest(t[decode], gen[decode], at_ns)
        out.append(fields)
    return out
