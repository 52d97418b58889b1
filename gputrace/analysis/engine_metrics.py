"""The engine's own metrics (its /metrics endpoint, scraped by the collector) against its log, per
phase: the waiting queue and the generation throughput. Where they disagree, the log's sampling
is suspect (a --decode-log-interval that aliases with the micro-batches, lines lost) or the two
sources do not describe the same engine: the report says so.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from gputrace.analysis.phase_figures import (
    BUSY_SIGNALS,
    PhaseMetrics,
    PrefillFigures,
    engine_tokens,
    tokens_emitted,
)

# Per engine: the queue gauge and the generated-tokens counter.
QUEUE_SERIES = ("sglang:num_queue_reqs", "vllm:num_requests_waiting")
TOKEN_SERIES = ("sglang:realtime_tokens_total", "vllm:generation_tokens_total")
# SGLang's own timers per pp_rank (0.5.23): the scheduler loop's wall time by category, whose
# run_batch is the forward (on a CPU the compute itself, on a GPU the host's launch and sync); a PP
# rank's wait for the previous stage's activations (_pp_recv_proxy_tensors, called from the PP loop
# outside any timed stage) falls in "other", its wait for the forwarded requests in recv_requests,
# so neither counts as busy. forward_execution_seconds_total is the device timer
# (SGLANG_ENABLE_METRICS_DEVICE_TIMER=1; without it the counter stays absent and fwd_occupancy NaN).
STAGE_SECONDS = "sglang:scheduler_stage_seconds_total"
DEVICE_SECONDS = "sglang:forward_execution_seconds_total"
LOOP_SERIES = (STAGE_SECONDS, DEVICE_SECONDS)
# vLLM's steps that returned a token (vllm:iteration_tokens_total: their prompt and decode tokens)
# and its requests' prompts (with_engine_steps), each histogram as its sum and count
STEP_TOKENS = "vllm:iteration_tokens_total"
PROMPT_TOKENS = "vllm:request_prompt_tokens"
STEP_SERIES = tuple(f"{name}_{part}" for name in (STEP_TOKENS, PROMPT_TOKENS) for part in ("sum", "count"))
COMPARED = QUEUE_SERIES + TOKEN_SERIES + LOOP_SERIES + STEP_SERIES
LOOP_AGREEMENT = 0.10  # the loop timers' busy and the log schedule's agree within this
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


def counter_tokens(s: MetricSeries, start_ns: int, end_ns: int, grid_ns: np.ndarray | None = None,
                   work: np.ndarray | None = None, requests: Mapping[str, np.ndarray] | None = None
                   ) -> float | None:
    """A counter's rise over [start, end): each interval between scrapes is a window at its mean
    rate (a scrape a second is finer than a 10 s stats window), and one that straddles an edge
    gives the phase the share of its rise that its inside part makes: where the run holds the
    client's requests, the share of the tokens they emitted in the interval that fell inside
    (client_split); else at the rate of the interval on that side (``engine_tokens``: linear
    interpolation across the C=1 -> C=4 edge read C=1 6 % high). None with fewer than MIN_SAMPLES
    scrapes in the phase. A restart's reset adds nothing."""
    inside = (s.ts_ns >= start_ns) & (s.ts_ns < end_ns)
    if inside.sum() < MIN_SAMPLES or end_ns <= start_ns:
        return None
    if requests is not None and (split := client_split(s, start_ns, end_ns, requests)) is not None:
        return split
    t = s.ts_ns.astype(np.float64)
    gap_s = np.diff(t) / 1e9
    with np.errstate(all="ignore"):
        rate = np.where(gap_s > 0, np.clip(np.diff(s.value), 0.0, None) / gap_s, 0.0)
    return engine_tokens(s.ts_ns[1:], rate, np.ones(len(rate), dtype=bool), start_ns, end_ns, grid_ns, work)


def client_split(s: MetricSeries, start_ns: int, end_ns: int, requests: Mapping[str, np.ndarray]
                 ) -> float | None:
    """The counter's rise over [start, end), each interval that straddles an edge split as the
    client's requests emitted their tokens in it (phase_figures.tokens_emitted): the count is the
    engine's, the client's records only place it in time. Over the scrapes inside its phases a
    real vLLM counter and the client agree to 0.1 %; what differs is the edges, where a level's
    first second ramps up (C=16's first 1.8 s ran at 773 tok/s against 965 after): the rate of
    the interval after the edge put C=16 5-7 % above the client in 2 of 7 runs. None where an
    edge interval holds no client token (another's load, or none recorded)."""
    t = s.ts_ns.astype(np.float64)
    rise = np.clip(np.diff(s.value), 0.0, None)
    lo, hi = t[:-1], t[1:]
    overlap = (hi > start_ns) & (lo < end_ns)
    if not overlap.any():
        return None
    within = overlap & (lo >= start_ns) & (hi <= end_ns)
    total = float(rise[within].sum())
    for i in np.flatnonzero(overlap & ~within):  # the (at most two) intervals across an edge
        a, b = lo[i], hi[i]
        emitted = _client_tokens(requests, a, b)
        if emitted <= 0:
            return None
        total += float(rise[i]) * _client_tokens(requests, max(a, start_ns), min(b, end_ns)) / emitted
    return total


def _client_tokens(requests: Mapping[str, np.ndarray], a: float, b: float) -> float:
    return tokens_emitted(requests["first_token_ns"], requests["end_ns"], requests["completion_tokens"],
                          int(a), int(b))


def with_engine_counter(pm: PhaseMetrics, series: Sequence[MetricSeries], counter: str | None,
                        grid_ns: np.ndarray | None = None, work: np.ndarray | None = None,
                        requests: Mapping[str, np.ndarray] | None = None) -> PhaseMetrics:
    """The phase's generated tok/s from the engine's own token counter (``counter``, summed over its
    engines) where the collector scraped it through the phase: vLLM's stats lines average over 10 s
    windows, which a phase of a few windows resolves only to about a window at each edge (a 25 s
    level read 140.6 tok/s from them against the client's 124.5). The log's figure stays beside
    it (engine_gen_throughput_tok_s)."""
    if counter is None:
        return pm
    client = requests if requests is not None and len(requests["first_token_ns"]) else None
    rises = [counter_tokens(s, pm.start_ns, pm.end_ns, grid_ns, work, client)
             for s in series if s.name == counter]
    if not rises or any(r is None for r in rises) or pm.duration_s <= 0:
        return pm
    rate = sum(r for r in rises if r is not None) / pm.duration_s
    return replace(pm, throughput_tok_s=rate, throughput_source=f"engine counter ({counter})")


def _summed_increase(series: Sequence[MetricSeries], name: str, start_ns: int, end_ns: int) -> float | None:
    rises = [_increase(s, start_ns, end_ns) for s in series if s.name == name]
    if not rises or any(r is None for r in rises):
        return None
    return sum(r[0] for r in rises if r is not None)


def with_engine_steps(pm: PhaseMetrics, series: Sequence[MetricSeries], budget_tokens: int | None
                      ) -> PhaseMetrics:
    """The phase's prefill figures from the engine's own metrics where its log has no step lines
    (vLLM): its requests' mean prompt (vllm:request_prompt_tokens) against the budget, and its step
    histogram (vllm:iteration_tokens_total). vLLM's API server observes that histogram only for
    steps that returned a token (async_llm's output handler makes no IterationStats otherwise), and
    counts a prompt's tokens at its first token, so its mean is tokens per step with output, not
    per step: a PP=2 run at a budget of 32 read 65. It is kept as that, never held against the
    budget. Unchanged where the log gave the figures (SGLang's prefill lines) or the histograms were
    not scraped through the phase."""
    if pm.prefill is not None or not budget_tokens or pm.duration_s <= 0:
        return pm
    steps = _summed_increase(series, f"{STEP_TOKENS}_count", pm.start_ns, pm.end_ns)
    tokens = _summed_increase(series, f"{STEP_TOKENS}_sum", pm.start_ns, pm.end_ns)
    if not steps or tokens is None:
        return pm
    prompts = _summed_increase(series, f"{PROMPT_TOKENS}_count", pm.start_ns, pm.end_ns)
    prompt_tokens = _summed_increase(series, f"{PROMPT_TOKENS}_sum", pm.start_ns, pm.end_ns)
    # the steps' rate over the scrapes' span, not the phase's (the increase is read between them)
    span = [s for s in series if s.name == f"{STEP_TOKENS}_count"]
    inside = [s.ts_ns[(s.ts_ns >= pm.start_ns) & (s.ts_ns < pm.end_ns)] for s in span]
    seconds = max(float(t[-1] - t[0]) / 1e9 for t in inside)
    per_step = tokens / steps
    return replace(pm, prefill=PrefillFigures(
        turns_per_s=steps / seconds if seconds > 0 else steps / pm.duration_s,
        tokens_per_turn_mean=per_step, budget_tokens=budget_tokens, full_turn_share=None,
        prompt_tokens_mean=prompt_tokens / prompts if prompts and prompt_tokens is not None else None,
        steps_with_output_only=True))


def _log_queue(pm: PhaseMetrics) -> float | None:
    """The log's queue: rank 0's lines (the other ranks replicate it, lagged)."""
    means = [st.queue_req_mean for st in sorted(pm.stages, key=lambda st: st.pp_rank)
             if st.queue_req_mean is not None]
    return means[0] if means else None


def disagreement_notes(series: Sequence[MetricSeries], phases: Sequence[PhaseMetrics],
                       log_flag: str | None = None) -> list[str]:
    """One note per phase where the engine's metrics and its log disagree on the queue or on
    the generation throughput; ``log_flag`` the engine's flag that samples its log, where it has one."""
    sampling = f" ({log_flag})" if log_flag else ""
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
            notes.append(f"{pm.label}: {'; '.join(said)}: the log's sampling may be aliased{sampling} "
                         "or lines were lost; the engine's metrics are read at every scrape")
    return notes


@dataclass(frozen=True)
class EngineBusy:
    """One stage in one phase, from the engine's own timers: the share of the phase it ran the
    forward (``busy_fraction``), from which timer, and the share its loop's categories account for."""

    pp_rank: int
    busy_fraction: float
    signal: str  # "device timer" | "loop timers"
    loop_share: float | None  # the categories' time over the wall time (about 1 when every scrape is there)


def _rank(s: MetricSeries) -> int | None:
    try:
        return int(s.labels.get("pp_rank", "0"))
    except ValueError:
        return None


def _increase(s: MetricSeries, start_ns: int, end_ns: int) -> tuple[float, float] | None:
    """A counter's rise over the phase's scrapes (a restart's reset skipped) and the seconds it spans."""
    inside = (s.ts_ns >= start_ns) & (s.ts_ns < end_ns)
    if inside.sum() < MIN_SAMPLES:
        return None
    t, v = s.ts_ns[inside], s.value[inside]
    rises = np.diff(v)
    return float(rises[rises >= 0].sum()), (t[-1] - t[0]) / 1e9


def engine_busy(series: Sequence[MetricSeries], start_ns: int, end_ns: int) -> dict[int, EngineBusy]:
    """Per pp_rank (tp_rank 0) the share of [start, end) it spent in the forward by the engine's own
    timers: the device timer where SGLang has it on, else the loop's run_batch category."""
    out: dict[int, EngineBusy] = {}
    by_rank: dict[int, dict[str, float]] = {}
    span: dict[int, float] = {}
    for s in series:
        rank = _rank(s)
        if rank is None or s.labels.get("tp_rank", "0") not in ("0", "") or s.name not in LOOP_SERIES:
            continue
        rise = _increase(s, start_ns, end_ns)
        if rise is None or rise[1] <= 0:
            continue
        key = "device" if s.name == DEVICE_SECONDS else s.labels.get("category", "other")
        acc = by_rank.setdefault(rank, {})
        acc[key] = acc.get(key, 0.0) + rise[0]
        span[rank] = max(span.get(rank, 0.0), rise[1])
    for rank, acc in sorted(by_rank.items()):
        seconds = span[rank]
        loop_total = sum(v for k, v in acc.items() if k != "device")
        loop_share = loop_total / seconds if loop_total > 0 else None
        if "device" in acc:
            out[rank] = EngineBusy(rank, min(acc["device"] / seconds, 1.0), "device timer", loop_share)
        elif "run_batch" in acc:
            out[rank] = EngineBusy(rank, min(acc["run_batch"] / seconds, 1.0), "loop timers", loop_share)
    return out


def with_engine_timers(pm: PhaseMetrics, series: Sequence[MetricSeries]) -> PhaseMetrics:
    """The phase with each stage's busy and bubble taken from the engine's own timers where they rank
    above the stage's signal (the device timer above all; the loop timers below SM activity), the
    bubble by the same definition (the share of the phase with work that the stage did not
    compute), and the log schedule's figure beside it with their agreement."""
    timers = engine_busy(series, pm.start_ns, pm.end_ns)
    if not timers:
        return pm
    schedule = None if pm.allowed_busy_fraction is None else pm.allowed_busy_fraction * pm.work_share
    stages = []
    for st in pm.stages:
        eb = timers.get(st.pp_rank)
        if eb is None or (eb.signal == "loop timers" and st.busy_signal == BUSY_SIGNALS["sm_active"]):
            stages.append(st)
            continue
        if schedule is None:
            beside = "the log gives no schedule to check it against"
        elif abs(eb.busy_fraction - schedule) <= LOOP_AGREEMENT:
            beside = f"the log's schedule gives {schedule:.0%}: they agree within {LOOP_AGREEMENT:.0%}"
        else:
            beside = (f"the log's schedule gives {schedule:.0%}: they differ by "
                      f"{abs(eb.busy_fraction - schedule):.0%}, since the schedule counts a stage busy "
                      "whenever a micro-batch is at it and the timer counts only the forward (the "
                      "scheduling, sampling and hand-off between forwards are not in it)")
        signal = BUSY_SIGNALS["device_timer" if eb.signal == "device timer" else "loop_timers"]
        stages.append(replace(
            st, busy_fraction=eb.busy_fraction, bubble_fraction=max(pm.work_share - eb.busy_fraction, 0.0),
            busy_signal=signal, schedule_busy_fraction=schedule,
            busy_signal_reason=f"{eb.busy_fraction:.0%} busy by the engine's {eb.signal}; {beside}"))
    return replace(pm, stages=stages)
