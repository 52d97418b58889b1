"""An engine's own Prometheus metrics as the simulated engine would expose them, in the series
its package writes (``Engine.simulated.metric_samples``: SGLang's ``sglang:*`` per ``pp_rank``,
vLLM's engine-wide ``vllm:*``). One snapshot model, two drivers: the virtual run's store (a scrape
every second) and the real-time server's ``/metrics``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from gputrace.engines.simulated import MetricSample, MetricSnapshot
from gputrace.exposition import (
    Collector,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from gputrace.sim.engine import EngineTrace
from gputrace.sim.params import SimParams

SCRAPE_S = 1.0


def snapshot_samples(p: SimParams, snap: MetricSnapshot) -> list[MetricSample]:
    """The samples a scrape of the simulated engine's /metrics would read."""
    simulated = p.engine_spec.simulated
    return [] if simulated is None else simulated.metric_samples(p, snap)


class SnapshotCollector(Collector):
    """A prometheus_client collector over a function that returns the current snapshot."""

    def __init__(self, p: SimParams, snapshot: Callable[[], MetricSnapshot]):
        self.p = p
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        samples = snapshot_samples(self.p, self.snapshot())
        # a histogram's _sum and _count samples, by the histogram's name
        histograms: dict[str, dict[str, MetricSample]] = {}
        for sample in samples:
            if sample.kind == "histogram":
                base, _, part = sample.name.rpartition("_")
                histograms.setdefault(base, {})[part] = sample
        for base, parts in histograms.items():
            labels = parts["sum"].labels
            fam_h = HistogramMetricFamily(base, base, labels=list(labels))
            fam_h.add_metric(list(labels.values()), [("+Inf", parts["count"].value)], parts["sum"].value)
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


def virtual_metric_rows(p: SimParams, start_ns: int, end_s: float, trace: EngineTrace,
                        events: Mapping[str, np.ndarray], host: str, source: str,
                        latencies: tuple[np.ndarray, np.ndarray] = (np.zeros(0), np.zeros(0)),
                        ) -> dict[str, str | np.ndarray]:
    """The ``engine_metrics`` columns a collector scraping every second would have stored (host
    and source constant).

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
    ts_ns: list[int] = []
    names: list[str] = []
    labels_json: list[str] = []
    values: list[float] = []
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
            ts_ns.append(t_ns)
            names.append(name)
            labels_json.append(json.dumps(labels, sort_keys=True))
            values.append(value)
    return {"host": host, "source": source, "ts_ns": np.asarray(ts_ns), "name": np.asarray(names),
            "labels_json": np.asarray(labels_json), "value": np.asarray(values)}


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
