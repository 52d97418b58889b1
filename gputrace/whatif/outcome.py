"""What a phase gave, in one form for a captured phase and a simulated one: throughput, TTFT and
ITL percentiles, bubble per stage. The same latency definitions as gputrace.analysis.phase_figures."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

import numpy as np

from gputrace.analysis.phase_figures import PhaseMetrics
from gputrace.analysis.result import Analysis
from gputrace.sim.samples import cumulative
from gputrace.sim.truth import work_intervals
from gputrace.sim.virtual import SimResult

NOISE_WINDOWS = 4  # a captured phase's throughput is taken in this many windows for its spread
MIN_NOISE_TOKENS = 100  # fewer tokens in a phase tell no spread

class PhaseOutcomeRow(TypedDict):
    """A ``PhaseOutcome`` as whatif.json gives it (the same fields)."""

    label: str
    concurrency: int
    throughput_tok_s: float | None
    ttft_s_p50: float | None
    ttft_s_p90: float | None
    itl_s_p50: float | None
    itl_s_p90: float | None
    bubble_fraction_by_stage: tuple[float | None, ...]
    microbatch_size_p90: float | None
    microbatch_size_max: float | None
    throughput_spread_ratio: float | None
    prefill_tokens_p90: float | None
    prefill_tokens_max: float | None


@dataclass(frozen=True, slots=True)
class PhaseOutcome:
    """One load level's result; None where it is not known."""

    label: str
    concurrency: int
    throughput_tok_s: float | None
    ttft_s_p50: float | None
    ttft_s_p90: float | None
    itl_s_p50: float | None
    itl_s_p90: float | None
    bubble_fraction_by_stage: tuple[float | None, ...]
    # decode micro-batch sizes the phase ran (requests per step): its 90th percentile and largest
    microbatch_size_p90: float | None = None
    microbatch_size_max: float | None = None
    # a captured phase: its throughput's spread over NOISE_WINDOWS windows of it (std / mean),
    # what the same setting rerun can move by (None: simulated, or too few tokens to tell)
    throughput_spread_ratio: float | None = None
    # prompt tokens per prefill turn (SGLang's #new-token; a step's prompt tokens in a replay): its
    # 90th percentile and largest (None where the log has no turns: vLLM's stats lines)
    prefill_tokens_p90: float | None = None
    prefill_tokens_max: float | None = None

    def to_dict(self) -> PhaseOutcomeRow:
        return {"label": self.label, "concurrency": self.concurrency,
                "throughput_tok_s": self.throughput_tok_s, "ttft_s_p50": self.ttft_s_p50,
                "ttft_s_p90": self.ttft_s_p90, "itl_s_p50": self.itl_s_p50, "itl_s_p90": self.itl_s_p90,
                "bubble_fraction_by_stage": self.bubble_fraction_by_stage,
                "microbatch_size_p90": self.microbatch_size_p90,
                "microbatch_size_max": self.microbatch_size_max,
                "throughput_spread_ratio": self.throughput_spread_ratio,
                "prefill_tokens_p90": self.prefill_tokens_p90, "prefill_tokens_max": self.prefill_tokens_max}


def _pct(values: np.ndarray, q: float) -> float | None:
    v = values[np.isfinite(values)]
    return float(np.percentile(v, q)) if len(v) else None


Latencies = tuple[float | None, float | None, float | None, float | None]
NO_LATENCIES: Latencies = (None, None, None, None)


def latency_percentiles(start_s: np.ndarray, first_s: np.ndarray, end_s: np.ndarray,
                        tokens: np.ndarray) -> Latencies:
    """TTFT p50/p90 and per-request ITL p50/p90 (the request's decode time over its tokens - 1)."""
    ttft = first_s - start_s
    with np.errstate(all="ignore"):
        itl = np.where(tokens > 1, (end_s - first_s) / (tokens - 1), np.nan)
    return _pct(ttft, 50), _pct(ttft, 90), _pct(itl, 50), _pct(itl, 90)


def phase_concurrency(pm: PhaseMetrics) -> int:
    """The level a phase offered: its target, else its mean in flight."""
    if pm.target_concurrency:
        return int(pm.target_concurrency)
    return max(round(pm.inflight_mean or 1.0), 1)


def measured_outcomes(analysis: Analysis) -> list[PhaseOutcome]:
    """Each captured phase, from the analysis and the run's request records."""
    rq = analysis.run.requests
    out = []
    for pm in analysis.metrics:
        if len(rq["start_ns"]):
            labelled = rq["phase"] == pm.label
            ended = (rq["end_ns"] >= pm.start_ns) & (rq["end_ns"] < pm.end_ns)
            in_phase = labelled if labelled.any() else ended
            sel = in_phase & rq["ok"]
            lat = latency_percentiles(rq["start_ns"][sel] / 1e9, rq["first_token_ns"][sel] / 1e9,
                                      rq["end_ns"][sel] / 1e9, rq["completion_tokens"][sel].astype(float))
        else:
            lat = NO_LATENCIES
        sizes = _logged_microbatch_sizes(analysis, pm.start_ns, pm.end_ns)
        turns = _logged_prefill_turns(analysis, pm.start_ns, pm.end_ns)
        out.append(PhaseOutcome(pm.label, phase_concurrency(pm), pm.throughput_tok_s, *lat,
                                tuple(st.bubble_fraction for st in pm.stages), *_p90_max(sizes),
                                throughput_spread(rq, pm.start_ns, pm.end_ns), *_p90_max(turns)))
    return out


def _p90_max(values: np.ndarray) -> tuple[float | None, float | None]:
    return (float(np.percentile(values, 90)), float(values.max())) if len(values) else (None, None)


def throughput_spread(requests: dict[str, np.ndarray], start_ns: int, end_ns: int,
                      windows: int = NOISE_WINDOWS) -> float | None:
    """The phase's throughput in ``windows`` equal windows (each request's tokens spread evenly
    from its first token to its end), their standard deviation over their mean. On this machine's
    CPU engines a level's windows moved 1-38 % within a 20 s phase, and the same setting rerun
    back to back moved a level by up to 54 %: a prediction cannot be judged closer than that."""
    if not len(requests["start_ns"]) or end_ns <= start_ns:
        return None
    ok = requests["ok"].astype(bool)
    first = requests["first_token_ns"][ok].astype(float)
    end = requests["end_ns"][ok].astype(float)
    tokens = requests["completion_tokens"][ok].astype(float)
    started = requests["start_ns"][ok].astype(float)
    keep = np.isfinite(first) & np.isfinite(end) & np.isfinite(tokens) & (end > start_ns) & (first < end_ns)
    first, end, tokens, started = first[keep], end[keep], tokens[keep], started[keep]
    if tokens.sum() < MIN_NOISE_TOKENS:
        return None
    edges = np.linspace(float(start_ns), float(end_ns), windows + 1)
    if not np.any(started >= edges[1]):
        # one round: every request went out in the first window (a burst), so the windows hold
        # its prefill ramp, its decode and its tail, not a steady load's variation (the demo's
        # C=32 burst: 0.67, where its reruns move 1 %)
        return None
    life = np.maximum(end - first, 1.0)
    overlap = np.clip(np.minimum(end[:, None], edges[None, 1:])
                      - np.maximum(first[:, None], edges[None, :-1]), 0.0, None)
    per_window = (tokens[:, None] * overlap / life[:, None]).sum(axis=0)
    mean = float(per_window.mean())
    return float(per_window.std() / mean) if mean > 0 else None


def _logged_microbatch_sizes(analysis: Analysis, start_ns: int, end_ns: int) -> np.ndarray:
    """The decode lines' running requests in [start, end): SGLang's per micro-batch; vLLM's
    engine-wide lines over its pp_size batches in flight."""
    run = analysis.run
    parts = []
    for ev in run.stage_events:
        lo, hi = np.searchsorted(ev.t_ns, [start_ns, end_ns])
        running = ev.running_req[lo:hi][ev.kind[lo:hi] != "prefill"]
        parts.append(running[np.isfinite(running) & (running > 0)])
    sizes = np.concatenate(parts) if parts else np.zeros(0)
    if not run.engine.engine_spec.steps_logged and run.pp_size > 1:  # vLLM's engine-wide running
        sizes = np.maximum(sizes / run.pp_size, 1.0)
    return sizes


def _logged_prefill_turns(analysis: Analysis, start_ns: int, end_ns: int) -> np.ndarray:
    """The prompt tokens each prefill turn in [start, end) computed: the first stage's prefill
    lines' #new-token (every stage logs the same turn). Empty where the engine logs no turns
    (vLLM's periodic stats lines)."""
    run = analysis.run
    if not run.stage_events or not run.engine.engine_spec.steps_logged:
        return np.zeros(0)
    ev = run.stage_events[0]
    lo, hi = np.searchsorted(ev.t_ns, [start_ns, end_ns])
    tokens: np.ndarray = np.asarray(ev.new_token[lo:hi][ev.kind[lo:hi] == "prefill"], dtype=float)
    kept: np.ndarray = tokens[np.isfinite(tokens) & (tokens > 0)]
    return kept


def simulated_outcomes(result: SimResult, labels: list[str] | None = None) -> list[PhaseOutcome]:
    """Each phase of a virtual run (named ``labels[i]`` where given) from its ground truth and
    its requests as the client saw them."""
    lat_s = result.params.client_latency_s
    out = []
    for i, (ph, truth) in enumerate(zip(result.phases, result.ground_truth["phases"], strict=True)):
        reqs = [r for r in result.requests if r.phase == ph.label and r.first_token_s is not None
                and r.finish_s is not None and r.generated >= r.output_tokens]
        start = np.array([r.client_start_s for r in reqs])
        first = np.array([r.first_token_s + lat_s for r in reqs if r.first_token_s is not None])
        end = np.array([r.finish_s + lat_s for r in reqs if r.finish_s is not None])
        tokens = np.array([r.generated for r in reqs], dtype=float)
        lat = latency_percentiles(start, first, end, tokens) if reqs else NO_LATENCIES
        label = labels[i] if labels and i < len(labels) else ph.label
        out.append(PhaseOutcome(label, ph.target_concurrency, float(truth["throughput_tok_s"]), *lat,
                                tuple(float(s["bubble_fraction"]) for s in truth["stages"])))
    return out


def _overlap(starts: np.ndarray, ends: np.ndarray, a: float, b: float) -> float:
    c = cumulative(starts, np.minimum(ends, b + 1.0), np.array([a, b]))
    return float(c[1] - c[0])


def stage_busy_s(result: SimResult, edges_s: np.ndarray) -> np.ndarray:
    """Per stage (rows), its kernel-busy seconds up to each of ``edges_s`` (columns): one pass
    over each stage's intervals, read from the trace without the interval table (a replay's
    trace holds pp_size intervals per step, a million in a long one)."""
    tr = result.engine.trace
    pp = result.params.pp_size
    # every step appends one interval per stage, in stage order: column s is stage s's, sorted
    # and non-overlapping (a stage runs its micro-batches one after another)
    starts = np.asarray(tr.iv_start, dtype=np.float64).reshape(-1, pp)
    ends = np.asarray(tr.iv_end, dtype=np.float64).reshape(-1, pp)
    return np.array([cumulative(starts[:, s], ends[:, s], edges_s) for s in range(pp)])


def trace_outcomes(result: SimResult, labels: list[str] | None = None,
                   rest: Sequence[tuple[float, float | None]] | None = None) -> list[PhaseOutcome]:
    """Each phase of a replay from its engine trace and requests alone (no log, no ground truth):
    throughput (tokens out of the last stage in the phase over its length), TTFT of the requests
    it started, ITL of each request from its first token to its latest (a phase replayed shorter
    than a request's life still has one), bubble per stage and the decode micro-batch sizes.
    ``rest``: per phase, (seconds it stands for beyond its replayed span, tokens/s taken for them)
    where the replay stopped it once settled (gputrace.whatif.replay)."""
    p = result.params
    tr = result.engine.trace
    tok_t, tok_n = np.asarray(tr.tok_t, dtype=np.float64), np.asarray(tr.tok_n, dtype=np.float64)
    w_start, w_end = work_intervals(np.asarray(tr.work_t, dtype=np.float64),
                                    np.asarray(tr.work_delta, dtype=np.int64))
    reqs = result.requests
    start = np.array([r.client_start_s for r in reqs], dtype=np.float64)
    first = np.array([np.nan if r.first_token_s is None else r.first_token_s + p.client_latency_s
                      for r in reqs], dtype=np.float64)
    last = np.array([np.nan if r.last_token_s is None else r.last_token_s + p.client_latency_s
                     for r in reqs], dtype=np.float64)
    generated = np.array([r.generated for r in reqs], dtype=np.float64)
    phase_of = np.array([r.phase for r in reqs], dtype=object)
    # stage 0's entry of each step (the first of its pp_size)
    step_sizes = np.asarray(tr.step_reqs, dtype=np.int64)
    step_decode = np.asarray(tr.step_decode, dtype=bool)
    step_start = np.asarray(tr.iv_start[::p.pp_size], dtype=np.float64)
    decode_sizes, decode_start = step_sizes[step_decode], step_start[step_decode]
    turn_t, turn_n = np.asarray(tr.pf_t, dtype=np.float64), np.asarray(tr.pf_n, dtype=np.float64)
    edges = np.array([[ph.start_s, ph.end_s] for ph in result.phases], dtype=np.float64).reshape(-1)
    busy_to = stage_busy_s(result, edges).reshape(p.pp_size, len(result.phases), 2)
    out = []
    for i, ph in enumerate(result.phases):
        a, b = ph.start_s, ph.end_s
        dur = b - a
        in_tok = (tok_t >= a) & (tok_t < b)
        rest_s, rest_tok_s = rest[i] if rest is not None else (0.0, None)
        if rest_tok_s is not None and rest_s > 0:
            throughput = (float(tok_n[in_tok].sum()) + rest_tok_s * rest_s) / (dur + rest_s)
        else:
            throughput = float(tok_n[in_tok].sum()) / dur if dur > 0 else 0.0
        sel = phase_of == ph.label
        lat = latency_percentiles(start[sel], first[sel], last[sel], generated[sel]) if sel.any() \
            else NO_LATENCIES
        has_work = _overlap(w_start, w_end, a, b)
        busy = busy_to[:, i, 1] - busy_to[:, i, 0]
        bubbles = tuple(round(max(has_work - float(x), 0.0) / dur, 4) for x in busy) if dur > 0 else ()
        sizes = decode_sizes[(decode_start >= a) & (decode_start < b)]
        turns = turn_n[(turn_t >= a) & (turn_t < b)]
        label = labels[i] if labels and i < len(labels) else ph.label
        out.append(PhaseOutcome(label, ph.target_concurrency, throughput, *lat, bubbles, *_p90_max(sizes),
                                None, *_p90_max(turns)))
    return out


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or measured <= 0:
        return None
    return float(predicted / measured - 1.0)  # a float in JSON where the inputs are numpy's
