"""The engine's own metrics (its /metrics endpoint, scraped by the collector) against its log, per
phase: the waiting queue and the generation throughput. Where they disagree, the log's sampling
is suspect (a --decode-log-interval that aliases with the micro-batches, lines lost) or the two
sources do not describe the same engine: the report says so.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from gputrace.analysis.metrics import PhaseMetrics

# Per engine: the queue gauge and the generated-tokens counter.
QUEUE_SERIES = ("sglang:num_queue_reqs", "vllm:num_requests_waiting")
TOKEN_SERIES = ("sglang:realtime_tokens_total", "vllm:generation_tokens_total")
COMPARED = QUEUE_SERIES + TOKEN_SERIES
MIN_SAMPLES = 3  # scrapes a phase needs before its figures are compared
QUEUE_TOLERANCE_REQS = 2.0  # a queue read at other moments differs by a few requests
QUEUE_TOLERANCE_RATIO = 0.25
THROUGHPUT_TOLERANCE_RATIO = 0.15
# The log's tokens near a phase's edges are placed within its lines' one-second stamps: a short
# phase's log throughput is uncertain by about this much time at its edges (measured: a 6 s phase
# read 21 % low, a 14 s one within 15 %).
EDGE_UNCERTAINTY_S = 1.0


@dataclass(frozen=True)
class MetricSeries:
    """One series of the engine's metrics (times in the collector's clock)."""

    name: str
    labels: dict[str, str]
    ts_ns: np.ndarray
    value: np.ndarray


def series_from_columns(cols: Mapping[str, np.ndarray]) -> list[MetricSeries]:
    """Group the ``engine_metrics`` columns into series (host and labels apart)."""
    groups: dict[tuple[str, str, str], list[int]] = {}
    for i, key in enumerate(zip(cols["host"].tolist(), cols["name"].tolist(), cols["labels_json"].tolist(),
                                strict=True)):
        groups.setdefault(key, []).append(i)
    out = []
    for (_host, name, labels), rows in sorted(groups.items()):
        idx = np.asarray(rows)
        order = np.argsort(cols["ts_ns"][idx], kind="stable")
        out.append(MetricSeries(name, json.loads(labels), np.asarray(cols["ts_ns"][idx][order], np.int64),
                                np.asarray(cols["value"][idx][order], np.float64)))
    return out


def _one_rank(series: Sequence[MetricSeries], names: Sequence[str]) -> list[MetricSeries]:
    """The series of one engine-wide view: SGLang's lowest pp_rank (every rank holds the same
    queue and runs every micro-batch) and decode mode where a mode label exists; vLLM's every
    engine (summed by the caller)."""
    chosen = [s for s in series if s.name in names and s.labels.get("mode", "decode") == "decode"]
    ranked = [s for s in chosen if "pp_rank" in s.labels]
    if ranked:
        low = min(int(s.labels["pp_rank"]) for s in ranked)
        chosen = [s for s in ranked if int(s.labels["pp_rank"]) == low
                  and s.labels.get("tp_rank", "0") in ("0", "") and s.labels.get("dp_rank", "0") in ("0", "")]
    return chosen


def gauge_mean(series: Sequence[MetricSeries], start_ns: int, end_ns: int) -> float | None:
    """The summed gauges' mean over the phase's scrapes (None with too few)."""
    total = 0.0
    for s in series:
        inside = (s.ts_ns >= start_ns) & (s.ts_ns < end_ns)
        if inside.sum() < MIN_SAMPLES:
            return None
        total += float(np.mean(s.value[inside]))
    return total if series else None


def counter_rate(series: Sequence[MetricSeries], start_ns: int, end_ns: int) -> float | None:
    """The summed counters' increase per second over the phase (a restart's reset skipped)."""
    total = 0.0
    for s in series:
        inside = (s.ts_ns >= start_ns) & (s.ts_ns < end_ns)
        if inside.sum() < MIN_SAMPLES:
            return None
        t, v = s.ts_ns[inside], s.value[inside]
        rises = np.diff(v)
        total += float(rises[rises >= 0].sum()) / ((t[-1] - t[0]) / 1e9)
    return total if series else None


def _log_queue(pm: PhaseMetrics) -> float | None:
    """The log's queue: rank 0's lines (the other ranks replicate it, lagged)."""
    means = [st.queue_req_mean for st in sorted(pm.stages, key=lambda st: st.pp_rank)
             if st.queue_req_mean is not None]
    return means[0] if means else None


def disagreement_notes(series: Sequence[MetricSeries], phases: Sequence[PhaseMetrics]) -> list[str]:
    """One note per phase where the engine's metrics and its log disagree on the queue or on
    the generation throughput."""
    queue = _one_rank(series, QUEUE_SERIES)
    tokens = _one_rank(series, TOKEN_SERIES)
    notes = []
    for pm in phases:
        said = []
        m_queue, l_queue = gauge_mean(queue, pm.start_ns, pm.end_ns), _log_queue(pm)
        if m_queue is not None and l_queue is not None and abs(m_queue - l_queue) > max(
                QUEUE_TOLERANCE_REQS, QUEUE_TOLERANCE_RATIO * max(m_queue, l_queue)):
            said.append(f"engine metrics say {m_queue:.1f} requests waiting on average, the log says "
                        f"{l_queue:.1f}")
        m_tput, l_tput = counter_rate(tokens, pm.start_ns, pm.end_ns), pm.engine_gen_throughput_tok_s
        duration_s = max((pm.end_ns - pm.start_ns) / 1e9, 1.0)
        tolerance = THROUGHPUT_TOLERANCE_RATIO + EDGE_UNCERTAINTY_S / duration_s
        if m_tput is not None and l_tput is not None and abs(m_tput - l_tput) > \
                tolerance * max(m_tput, l_tput, 1e-9):
            said.append(f"the engine's token counter gives {m_tput:.0f} tok/s, the log's throughput "
                        f"lines {l_tput:.0f} tok/s")
        if said:
            notes.append(f"{pm.label}: {'; '.join(said)}: the log's sampling may be aliased "
                         "(--decode-log-interval) or lines were lost; the engine's metrics are read at "
                         "every scrape")
    return notes
