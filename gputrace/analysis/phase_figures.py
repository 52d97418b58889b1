"""Per phase and stage: busy and bubble fractions, utilization, micro-batch sizes against the
offered load, queue, token usage, power, PCIe, throughput and request latencies.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, TypedDict

import numpy as np

from gputrace.analysis.aligned_run import AlignedRun, StageEvents
from gputrace.analysis.phases import Phase
from gputrace.json_types import JsonObject


@dataclass
class StageSeries:
    """Stage-level series on the grid, (pp, n_cells): GPU values averaged over the stage's TP GPUs."""

    utilization: np.ndarray
    power_w: np.ndarray
    power_share: np.ndarray
    pcie_tx_bytes_per_s: np.ndarray
    pcie_rx_bytes_per_s: np.ndarray
    pcie_tx_share: np.ndarray
    pcie_rx_share: np.ndarray
    sm_clock_hz: np.ndarray
    throttled: np.ndarray
    sm_active: np.ndarray  # GPM SM activity; NaN where the GPU has none (before Hopper, or off)
    idle_power_w: np.ndarray  # per stage: what it draws with no work (see idle_power); NaN without power


def stage_series(run: AlignedRun) -> StageSeries:
    """Each GPU metric averaged over the GPUs of each stage (alignment reduces them as it reads),
    and each stage's idle power from those averages."""
    return StageSeries(**run.stage_gpu, idle_power_w=idle_power(run.stage_gpu["power_w"], run.work_ratio))


IDLE_CELLS_MIN = 10  # cells without work a stage needs before their median is its idle power
IDLE_SMOOTH_CELLS = 3  # power's sample noise (a few W) averaged out before the run's lowest is taken


def idle_power(power_w: np.ndarray, work_ratio: np.ndarray) -> np.ndarray:
    """Per stage (rows of ``power_w``) its power with no work: the median over the cells where the
    engine held no request, else (a run that never idles) the lowest power any stage held over
    a few cells, an upper bound on idle that the ratios of stages' power above it tolerate."""
    out = np.full(power_w.shape[0], np.nan)
    lowest = []
    for s, row in enumerate(power_w):
        ok = ~np.isnan(row)
        if ok.sum() < IDLE_SMOOTH_CELLS:
            lowest.append(np.nan)
            continue
        smooth = np.convolve(row[ok], np.ones(IDLE_SMOOTH_CELLS) / IDLE_SMOOTH_CELLS, "valid")
        lowest.append(float(smooth.min()))
        idle_cells = row[ok & (work_ratio < 0.01)]
        if idle_cells.size >= IDLE_CELLS_MIN:
            out[s] = float(np.median(idle_cells))
    if not np.isnan(lowest).all():
        out = np.where(np.isnan(out), np.nanmin(lowest), out)
    return out


BUSY_SIGNALS = {"utilization": "utilization.gpu (NVML)", "sm_active": "SM activity (GPM)",
                "schedule": "schedule from the log",
                "device_timer": "the engine's device timer (forward_execution_seconds)",
                "loop_timers": "the engine's loop timers (run_batch)",
                "none": "none (no GPU samples)"}
# The one order in which a stage's busy figure is taken, best first; the report states it.
BUSY_RANKING = ("the engine's device timer", "SM activity (GPM, DCGM PROF_SM_ACTIVE)",
                "the engine's loop timers", "the schedule from the log (micro-batches in flight / "
                "pp_size, shared out by each stage's power above idle)",
                "utilization.gpu only where the schedule agrees (NCCL's waiting receive counts in it: "
                "a stage waiting on its link or on another stage reads busy, so a bubble from it or "
                "from the schedule is a lower bound)")
UTILIZATION_AGREES = 0.1  # utilization.gpu this far above the schedule's busy figure is not taken
# A sampled log's generation throughput this far from the client's is not taken as the engine's
# (micro-batches the log never shows: a real SGLang at interval 2 read 42 % above the client at
# one load, 50 % below at another); a phase's edges blur the log's by about a second.
THROUGHPUT_ALIAS_RATIO = 0.25
THROUGHPUT_EDGE_S = 1.0


def throughput_aliased(pm: PhaseMetrics) -> bool:
    """The phase's log throughput was not taken: a sampled log read above the client's tokens."""
    gen, client = pm.engine_gen_throughput_tok_s, pm.client_throughput_tok_s
    return gen is not None and client is not None and pm.throughput_tok_s != gen and \
        abs(gen - client) > client * (THROUGHPUT_ALIAS_RATIO + THROUGHPUT_EDGE_S / max(pm.duration_s, 1.0))


def busy_signal(sm_active: np.ndarray, w: np.ndarray) -> str:
    """Which series gives a stage's busy figure in a phase: SM activity where the GPU has it
    (kernels that only wait, like NCCL's spinning receive, do not count in it), else NVML
    utilization (the share of time any kernel ran)."""
    return "sm_active" if _wmean(sm_active, w) is not None else "utilization"


@dataclass
class StageMetrics:
    """One stage in one phase; None where the data is not there."""

    pp_rank: int
    busy_fraction: float | None
    bubble_fraction: float | None
    utilization_mean: float | None
    utilization_p50: float | None
    utilization_p90: float | None
    utilization_p99: float | None
    microbatch_size_mean: float | None  # SGLang's #running-req under PP
    microbatch_size_max: float | None
    microbatch_size_p10: float | None
    queue_req_mean: float | None
    queue_req_max: float | None
    token_usage_mean: float | None
    token_usage_max: float | None
    power_w_mean: float | None
    power_limit_share_mean: float | None
    power_limit_share_p95: float | None
    pcie_tx_bytes_per_s_mean: float | None
    pcie_rx_bytes_per_s_mean: float | None
    pcie_link_share_p95: float | None  # larger direction, against the link's capacity
    pcie_link_share_mean: float | None
    # link time the hand-offs need (at full link speed) per second of kernel time: ~ hop/step
    pcie_transfer_per_busy: float | None
    sm_clock_hz_mean: float | None
    throttled_fraction: float | None
    log_lines: int
    distinct_microbatch_sizes: int
    busy_signal: str = "utilization.gpu (NVML)"  # the series busy and bubble came from (BUSY_SIGNALS)
    sm_active_mean: float | None = None
    busy_signal_reason: str | None = None  # why a better-ranked signal was not used, or was replaced
    schedule_busy_fraction: float | None = None  # the log schedule's figure, beside an engine timer's


@dataclass(frozen=True, slots=True)
class PrefillFigures:
    """One phase's prefill turns as the last stage logged them (every prefill passes it once)."""

    turns_per_s: float
    tokens_per_turn_mean: float  # #new-token: prompt tokens computed per turn
    budget_tokens: int | None  # the turn's budget: min(chunked_prefill_size, max_prefill_tokens)
    full_turn_share: float | None  # turns whose #new-token reached the budget (None: budget unknown)
    prompt_tokens_mean: float | None  # per request whose prefill ended in the phase
    # #new-seq: requests per turn (a continued chunk counted in each turn it runs in)
    seqs_per_turn_mean: float | None = None
    # the turns the budget ended (the next prompt of the mean length would not have fitted): their
    # mean #new-seq and the requests they admitted together. A burst sent over the network lands
    # over a few ms and its first request starts a turn alone (the demo's C=32: turns of 1, 1, 7,
    # 8, 8, 7), so the mean turn understates what the budget admits
    seqs_per_full_turn: float | None = None
    seqs_in_full_turns: float = 0.0
    seqs_in_turns: float = 0.0  # #new-seq over all the phase's turns
    # where no line per turn exists (vLLM): turns_per_s and tokens_per_turn_mean are of the steps
    # that returned a token, as its step histogram counts them (vllm:iteration_tokens_total
    # observes no step that only ran prompt chunks), so they are not held against the budget
    steps_with_output_only: bool = False


def prefill_budget(engine: Any) -> int | None:
    """The prefill's token budget per turn: SGLang's min(chunked_prefill_size, max_prefill_tokens)
    (vLLM's max_num_batched_tokens is logged under chunked_prefill_size); None where not logged."""
    chunk = engine.chunked_prefill_size
    turn = (engine.fields or {}).get("max_prefill_tokens")
    values = [int(v) for v in (chunk, turn) if isinstance(v, int | float) and v > 0]
    return min(values) if values else None


def prefill_figures(run: AlignedRun, start_ns: int, stop_ns: int) -> PrefillFigures | None:
    """The phase's prefill turns from the last stage's SGLang prefill lines; None without any."""
    ev = next((e for e in reversed(run.stage_events) if len(e.t_ns)), None)
    if ev is None or stop_ns <= start_ns:
        return None
    lo, hi = np.searchsorted(ev.t_ns, [start_ns, stop_ns])
    prefill = ev.kind[lo:hi] == "prefill"
    tokens = ev.new_token[lo:hi][prefill]
    if not len(tokens) or np.isnan(tokens).all():
        return None
    budget = prefill_budget(run.engine)
    seqs = ev.new_seq[lo:hi][prefill].astype(np.float64)
    firsts = float(np.sum(first_tokens(seqs, tokens, run.engine.chunked_prefill_size)))
    prompts = float(np.nansum(tokens) + np.nansum(ev.cached_token[lo:hi][prefill]))
    return PrefillFigures(
        turns_per_s=len(tokens) / ((stop_ns - start_ns) / 1e9),
        tokens_per_turn_mean=float(np.nanmean(tokens)), budget_tokens=budget,
        full_turn_share=float(np.mean(np.nan_to_num(tokens) >= budget)) if budget else None,
        prompt_tokens_mean=prompts / firsts if firsts > 0 else None,
        seqs_per_turn_mean=float(np.nanmean(seqs)) if not np.isnan(seqs).all() else None,
        **_full_turns(tokens, seqs, budget, prompts / firsts if firsts > 0 else None))


class _FullTurns(TypedDict, total=False):
    """PrefillFigures' figures of the turns the budget ended (none where it cannot tell)."""

    seqs_per_full_turn: float
    seqs_in_full_turns: float
    seqs_in_turns: float


def _full_turns(tokens: np.ndarray, seqs: np.ndarray, budget: int | None,
                prompt_tokens: float | None) -> _FullTurns:
    if not budget or not prompt_tokens:
        return {}
    full = (np.nan_to_num(tokens) > budget - prompt_tokens) & np.isfinite(seqs)
    if not full.any():
        return {}
    return {"seqs_per_full_turn": float(np.mean(seqs[full])), "seqs_in_full_turns": float(np.sum(seqs[full])),
            "seqs_in_turns": float(np.nansum(seqs))}


@dataclass
class PhaseMetrics:
    """One phase: the load it offered, what it got, and every stage."""

    label: str
    start_ns: int
    end_ns: int
    duration_s: float
    source: str
    target_concurrency: int | None
    inflight_mean: float | None  # requests in flight (time average): AlignedRun.inflight_counts
    work_share: float  # share of the phase in which the engine had requests
    requests_completed: int
    requests_failed: int  # ended with an error (not the abandoned: those are unfinished)
    throughput_tok_s: float | None  # the engine's, else the client's
    client_throughput_tok_s: float | None  # requests' completion tokens emitted in the phase
    engine_gen_throughput_tok_s: float | None  # from the engine's log (engine_throughput)
    unfinished_requests: int  # with no end, or abandoned at the drain (their tokens are unknown)
    ttft_s_p50: float | None
    ttft_s_p90: float | None
    itl_s_mean: float | None
    itl_s_p90: float | None
    microbatches_in_flight: float | None
    allowed_busy_fraction: float | None  # min(1, micro-batches in flight / pp_size)
    stages: list[StageMetrics]
    # the in-flight gauge's 90th percentile: a gauge read from the engine (running + waiting)
    # dips while finished requests are replaced, so its mean runs under the offered load
    inflight_p90: float | None = None
    # where throughput_tok_s came from: "engine log" (generated tokens the engine logged) or
    # "client records" (completion tokens the client received)
    throughput_source: str | None = None
    # prompt (input) tokens prefilled per second: never counted as generated
    input_tok_s: float | None = None  # the engine's, else the client's
    client_input_tok_s: float | None = None  # requests' prompt tokens, at their first token
    engine_input_tok_s: float | None = None  # from the engine's log (input_throughput)
    prefill: PrefillFigures | None = None  # SGLang's prefill lines in the phase (None: none logged)

    def to_dict(self) -> JsonObject:
        """As findings.json's ``phases`` hold it (the report leaves out the stages: its table holds them)."""
        return asdict(self)


def _f(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if np.isfinite(v) else None


def cell_weights(grid_ns: np.ndarray, period_ns: int, start_ns: int, end_ns: int
                 ) -> tuple[slice, np.ndarray]:
    """The cells (t - P, t] overlapping [start, end) and the share of each inside it."""
    lo = int(np.searchsorted(grid_ns, start_ns, side="right"))
    hi = int(np.searchsorted(grid_ns, end_ns + period_ns, side="left"))
    t = grid_ns[lo:hi].astype(np.float64)
    w = np.clip(np.minimum(t, end_ns) - np.maximum(t - period_ns, start_ns), 0, period_ns) / period_ns
    return slice(lo, hi), w


def busy_and_bubble(utilization: np.ndarray, work_ratio: np.ndarray, weights: np.ndarray | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Per stage (rows of ``utilization``, one column per sample) the busy and bubble fractions.

    ``work_ratio`` is the share of each sample period in which the engine had requests (0..1);
    a sample's bubble is max(0, work - utilization), since kernels only run while there is work.
    NaN samples are left out; a stage with none gets NaN. This is the whole bubble estimate: the
    live collector can call it on its last few seconds of samples.
    """
    u = np.atleast_2d(np.asarray(utilization, dtype=np.float64))
    w = np.ones(u.shape[1]) if weights is None else np.asarray(weights, dtype=np.float64)
    ok = ~np.isnan(u) & (w > 0)
    wt = np.where(ok, w, 0.0)
    total = wt.sum(axis=1)
    with np.errstate(all="ignore"):
        busy = np.where(total > 0, np.sum(np.where(ok, u, 0.0) * wt, axis=1) / total, np.nan)
        gap = np.clip(np.asarray(work_ratio, dtype=np.float64) - np.where(ok, u, 0.0), 0.0, 1.0)
        bubble = np.where(total > 0, np.sum(gap * wt, axis=1) / total, np.nan)
    return busy, bubble


def tokens_emitted(first_token_ns: np.ndarray, end_ns: np.ndarray, completion_tokens: np.ndarray,
                   start_ns: int, stop_ns: int) -> float:
    """Completion tokens that came out in [start, stop): each request's first token at its
    first-token time, the rest spread evenly up to its end (long requests span phases)."""
    ok = ~np.isnan(first_token_ns) & ~np.isnan(end_ns) & ~np.isnan(completion_tokens) & \
        (completion_tokens >= 1)
    first, end, n = first_token_ns[ok], np.maximum(end_ns[ok], first_token_ns[ok]), completion_tokens[ok]
    first_in = ((first >= start_ns) & (first < stop_ns)).astype(np.float64)
    span = end - first
    overlap = np.clip(np.minimum(end, stop_ns) - np.maximum(first, start_ns), 0, None)
    with np.errstate(all="ignore"):
        rest = np.where(span > 0, overlap / span, ((end >= start_ns) & (end < stop_ns)).astype(float))
    return float(np.sum(first_in + (n - 1) * rest))


def engine_tokens(t_ns: np.ndarray, gen_tok_s: np.ndarray, is_decode: np.ndarray, start_ns: int,
                  stop_ns: int, grid_ns: np.ndarray | None = None, work: np.ndarray | None = None
                  ) -> float | None:
    """Tokens a stage generated in [start, stop) from its throughput lines. Each line's rate covers
    the time since the previous line (SGLang resets its counter per line; vLLM averages over its
    10 s window); the first line's window is taken to be the usual gap between lines.

    A window that straddles an edge gives the part inside the share of its tokens that the time
    there, weighted by ``work`` on the grid (no tokens come while no request is in), makes at the
    rate of the neighbouring window on that side: a 10 s window half in a phase at 300 tok/s and
    half in one at 700 gives the first 30 %, not 50 %."""
    sel = is_decode & ~np.isnan(gen_tok_s)
    t, rate = t_ns[sel].astype(np.float64), gen_tok_s[sel]
    if len(t) < 2:
        return None
    prev = np.concatenate([[t[0] - float(np.median(np.diff(t)))], t[:-1]])
    lo = np.maximum(prev, start_ns)
    hi = np.maximum(np.minimum(t, stop_ns), lo)  # (lo, hi]: the part of each window inside
    if grid_ns is not None and work is not None and len(grid_ns):
        w = np.nan_to_num(work)
        step = float(np.median(np.diff(grid_ns))) if len(grid_ns) > 1 else 1.0
        cum = np.concatenate([[0.0], np.cumsum(w)]) * step

        def work_time(x: np.ndarray) -> np.ndarray:  # work-weighted time up to x, linear in a cell:
            # lines closer together than a cell (4 micro-batches logged every 60 ms) keep their share
            cell = np.clip(np.searchsorted(grid_ns, x, "right") - 1, 0, len(grid_ns) - 1)
            into = np.clip(x - grid_ns[cell], 0.0, step)
            return np.asarray(np.where(x < grid_ns[0], 0.0, cum[cell] + w[cell] * into))

        def span(a: np.ndarray, b: np.ndarray) -> np.ndarray:  # work-weighted time in (a, b]
            return np.asarray(np.clip(work_time(b) - work_time(a), 0, None))
    else:
        def span(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            return np.asarray(np.clip(b - a, 0, None))
    inside = span(lo, hi)
    outside = np.clip(span(prev, t) - inside, 0, None)
    rate_before = np.concatenate([[rate[0]], rate[:-1]])
    rate_after = np.concatenate([rate[1:], [rate[-1]]])
    enters = (prev < start_ns) & (t > start_ns) & (t <= stop_ns)  # the inside part comes after
    leaves = (prev >= start_ns) & (prev < stop_ns) & (t > stop_ns)  # the inside part comes first
    rate_in = np.where(enters, rate_after, np.where(leaves, rate_before, rate))
    rate_out = np.where(enters, rate_before, np.where(leaves, rate_after, rate))
    made_in, made_out = inside * rate_in, outside * rate_out
    total = made_in + made_out
    with np.errstate(all="ignore"):
        share = np.nan_to_num(np.where(total > 0, made_in / total, inside / (inside + outside)))
    if np.count_nonzero(share) < 2:
        return None
    # rate x window = the window's tokens, idle time included, so no gap is special.
    return float(np.sum(rate * (t - prev) * share) / 1e9)


def first_tokens(new_seq: np.ndarray, new_token: np.ndarray, chunk_tokens: float | None) -> np.ndarray:
    """Per SGLang prefill line, the requests whose prefill it ends (each makes its first token).
    ``#new-seq`` is the prefill batch's request count (``len(can_run_list)``), a continued chunk
    included, so a prompt cut into n chunks is in n lines; only its last chunk makes a token. A
    line whose ``#new-token`` reached the chunk size (``chunked_prefill_size``) was cut there:
    its last request goes on in the next turn. Without the chunk size every request counts."""
    seqs = np.nan_to_num(new_seq.astype(np.float64))
    if not chunk_tokens or chunk_tokens <= 0:
        return seqs
    cut = np.nan_to_num(new_token.astype(np.float64)) >= chunk_tokens
    return np.clip(seqs - cut, 0.0, None)


def counted_tokens(kind: np.ndarray, running_req: np.ndarray, new_seq: np.ndarray,
                   new_token: np.ndarray | None = None, chunk_tokens: float | None = None) -> float | None:
    """Tokens SGLang generated, counted from one stage's lines logged at --decode-log-interval 1: a
    decode line is one step of its micro-batch (a token per request), a prefill line gives each
    request whose prefill it ends its first token (``first_tokens``: a chunk that goes on makes
    none). Unlike the logged throughput, this does not depend on where the lines fall within
    their one-second stamps."""
    decode = kind == "decode"
    if not decode.any():
        return None
    prefill = kind == "prefill"
    tokens = new_token[prefill] if new_token is not None else np.full(int(prefill.sum()), np.nan)
    firsts = first_tokens(new_seq[prefill], tokens, chunk_tokens)
    return float(np.nansum(running_req[decode]) + np.sum(firsts))


def _last_logging_stage(run: AlignedRun) -> StageEvents | None:
    logging = [ev for ev in run.stage_events if len(ev.t_ns)]
    return logging[-1] if logging else None


def engine_throughput(run: AlignedRun, start_ns: int, stop_ns: int) -> float | None:
    """The engine's generated tokens per second in [start, stop) from its log: SGLang's last stage's
    lines counted (each micro-batch passes it once), vLLM's engine-wide stats lines (filed under
    stage 0) integrated; None without such lines. Prompt tokens are not in it (input_throughput)."""
    duration_s = (stop_ns - start_ns) / 1e9
    ev = _last_logging_stage(run)
    if duration_s <= 0 or ev is None:
        return None
    interval = run.engine.decode_log_interval
    lo, hi = np.searchsorted(ev.t_ns, [start_ns, stop_ns])
    # Every step logged: count them. A sampled log (interval > 1) gives each line the throughput
    # over its interval, which integrates without the sampling's noise.
    steps = run.engine.engine_spec.steps_logged  # SGLang's batch lines, one per micro-batch step
    if interval == 1 and steps:
        tokens = counted_tokens(ev.kind[lo:hi], ev.running_req[lo:hi], ev.new_seq[lo:hi], ev.new_token[lo:hi],
                                run.engine.chunked_prefill_size)
    else:
        tokens = engine_tokens(ev.t_ns, ev.gen_throughput_tok_s, np.isin(ev.kind, ("decode", "stats")),
                               start_ns, stop_ns, run.grid_ns, run.work_ratio)
        if tokens is not None and steps:
            # SGLang's gen throughput counts decode steps only (process_batch_result_decode); each
            # request's first token comes from its prefill, whose lines are never sampled
            prefill = ev.kind[lo:hi] == "prefill"
            tokens += float(np.sum(first_tokens(ev.new_seq[lo:hi][prefill], ev.new_token[lo:hi][prefill],
                                                run.engine.chunked_prefill_size)))
    return tokens / duration_s if tokens is not None else None


def input_throughput(run: AlignedRun, start_ns: int, stop_ns: int) -> float | None:
    """The engine's prompt (input) tokens per second prefilled in [start, stop), from its log:
    SGLang's ``#new-token`` and ``#cached-token`` summed over the last stage's prefill lines (every
    prefill passes it once; the client's prompt is both: the engine computes the new ones and
    reads the rest from its prefix cache), vLLM's ``Avg prompt throughput`` integrated; None
    without such lines."""
    duration_s = (stop_ns - start_ns) / 1e9
    ev = _last_logging_stage(run)
    if duration_s <= 0 or ev is None:
        return None
    if run.engine.engine_spec.steps_logged:
        prefill = ev.kind == "prefill"
        if np.isnan(ev.new_token[prefill]).all():
            return None
        lo, hi = np.searchsorted(ev.t_ns, [start_ns, stop_ns])
        inside = prefill[lo:hi]
        tokens = np.nansum(ev.new_token[lo:hi][inside]) + np.nansum(ev.cached_token[lo:hi][inside])
        return float(tokens) / duration_s
    got = engine_tokens(ev.t_ns, ev.input_throughput_tok_s, ev.kind == "stats", start_ns, stop_ns,
                        run.grid_ns, run.work_ratio)
    return got / duration_s if got is not None else None


def prompt_tokens_prefilled(first_token_ns: np.ndarray, prompt_tokens: np.ndarray, start_ns: int,
                            stop_ns: int) -> float:
    """The client's prompt tokens whose prefill ended in [start, stop): each request's prompt at
    its first token (the prefill's end; a chunked prompt's earlier chunks ran before it)."""
    ok = ~np.isnan(first_token_ns) & ~np.isnan(prompt_tokens)
    inside = ok & (first_token_ns >= start_ns) & (first_token_ns < stop_ns)
    return float(np.sum(prompt_tokens[inside]))


def _wmean(values: np.ndarray, w: np.ndarray) -> float | None:
    ok = ~np.isnan(values) & (w > 0)
    return float(np.sum(values[ok] * w[ok]) / np.sum(w[ok])) if ok.any() else None


def _pct(values: np.ndarray, q: float) -> float | None:
    v = values[~np.isnan(values)]
    return float(np.percentile(v, q)) if len(v) else None


def phase_metrics(run: AlignedRun, series: StageSeries, phase: Phase) -> PhaseMetrics:
    """Everything measured for one phase."""
    cells, w = cell_weights(run.grid_ns, run.period_ns, phase.start_ns, phase.end_ns)
    work = run.work_ratio[cells]
    rq = run.requests
    in_phase = (rq["phase"] == phase.label) if (rq["phase"] == phase.label).any() else \
        (rq["end_ns"] >= phase.start_ns) & (rq["end_ns"] < phase.end_ns)
    done = in_phase & rq["ok"] & ~np.isnan(rq["end_ns"])
    tokens = tokens_emitted(rq["first_token_ns"], rq["end_ns"], rq["completion_tokens"],
                            phase.start_ns, phase.end_ns) if len(rq["start_ns"]) else np.nan
    ttft = (rq["first_token_ns"] - rq["start_ns"])[in_phase & rq["ok"]] / 1e9
    n_tok = rq["completion_tokens"][done]
    with np.errstate(all="ignore"):
        itl = np.where(n_tok > 1, (rq["end_ns"] - rq["first_token_ns"])[done] / 1e9 / (n_tok - 1), np.nan)
    inflight = _wmean(run.inflight[cells], w) if run.inflight is not None else None
    inflight_p90 = _pct(run.inflight[cells][w > 0], 90) if run.inflight is not None else None

    stages: list[StageMetrics] = []
    signals = [busy_signal(series.sm_active[s, cells], w) for s in range(run.pp_size)]
    busy_rows = np.array([series.sm_active[s, cells] if sig == "sm_active" else series.utilization[s, cells]
                          for s, sig in enumerate(signals)]).reshape(run.pp_size, -1)
    busy_all, bubble_all = busy_and_bubble(busy_rows, work, w)
    for s in range(run.pp_size):
        util = series.utilization[s, cells]
        has_util = not np.isnan(util).all()
        has_busy = not np.isnan(busy_rows[s]).all()
        ev = run.stage_events[s]
        lo, hi = np.searchsorted(ev.t_ns, [phase.start_ns, phase.end_ns])
        kinds = ev.kind[lo:hi]
        mb = ev.running_req[lo:hi][kinds == "decode"]
        if not len(mb):
            mb = ev.running_req[lo:hi]
        mb = mb[~np.isnan(mb)]
        q = ev.queue_req[lo:hi]
        usage = ev.token_usage[lo:hi]
        share = np.fmax(series.pcie_tx_share[s, cells], series.pcie_rx_share[s, cells])
        stages.append(StageMetrics(
            pp_rank=s,
            busy_fraction=_f(busy_all[s]) if has_busy else None,
            bubble_fraction=_f(bubble_all[s]) if has_busy else None,
            utilization_mean=_wmean(util, w) if has_util else None,
            utilization_p50=_pct(util, 50), utilization_p90=_pct(util, 90), utilization_p99=_pct(util, 99),
            microbatch_size_mean=_f(np.mean(mb)) if len(mb) else None,
            microbatch_size_max=_f(np.max(mb)) if len(mb) else None,
            microbatch_size_p10=_pct(mb, 10),
            queue_req_mean=_f(np.nanmean(q)) if len(q) and not np.isnan(q).all() else None,
            queue_req_max=_f(np.nanmax(q)) if len(q) and not np.isnan(q).all() else None,
            token_usage_mean=_f(np.nanmean(usage)) if len(usage) and not np.isnan(usage).all() else None,
            token_usage_max=_f(np.nanmax(usage)) if len(usage) and not np.isnan(usage).all() else None,
            power_w_mean=_wmean(series.power_w[s, cells], w),
            power_limit_share_mean=_wmean(series.power_share[s, cells], w),
            power_limit_share_p95=_pct(series.power_share[s, cells], 95),
            pcie_tx_bytes_per_s_mean=_wmean(series.pcie_tx_bytes_per_s[s, cells], w),
            pcie_rx_bytes_per_s_mean=_wmean(series.pcie_rx_bytes_per_s[s, cells], w),
            pcie_link_share_p95=_pct(share, 95),
            pcie_link_share_mean=(share_mean := _wmean(share, w)),
            pcie_transfer_per_busy=share_mean / busy_all[s]
            if share_mean is not None and busy_all[s] > 0.01 else None,
            sm_clock_hz_mean=_wmean(series.sm_clock_hz[s, cells], w),
            throttled_fraction=_wmean(series.throttled[s, cells], w),
            log_lines=int(hi - lo),
            distinct_microbatch_sizes=len(np.unique(mb)),
            busy_signal=BUSY_SIGNALS[signals[s] if has_busy else "none"],
            sm_active_mean=_wmean(series.sm_active[s, cells], w),
            busy_signal_reason="no SM activity on these GPUs" if signals[s] == "utilization" else None,
        ))

    # Micro-batches in flight = requests the engine runs (offered minus queued) / micro-batch size.
    mb_sizes = [st.microbatch_size_mean for st in stages if st.microbatch_size_mean]
    queued = max((st.queue_req_mean for st in stages if st.queue_req_mean is not None), default=0.0)
    running_log = run.engine_running if run.engine_running is not None else run.stage_running[0]
    load = inflight if inflight is not None else (
        float(np.nanmean(np.nan_to_num(running_log[cells]) + run.stage_queue[0, cells])) if len(w) else None)
    mb_in_flight = allowed = None
    if mb_sizes and load is not None:
        slots = run.engine.slots_at(run.pp_size)
        running = max(load - queued, float(np.mean(mb_sizes)))
        mb_in_flight = min(float(slots), running / float(np.mean(mb_sizes)))
        allowed = min(1.0, mb_in_flight / run.pp_size)
    if mb_in_flight is not None:
        above_idle = [_wmean(series.power_w[s, cells], w) for s in range(run.pp_size)]
        stages = [checked_utilization(st, mb_in_flight, run.pp_size, work, w, above, float(idle))
                  for st, above, idle in zip(stages, _power_shares(above_idle, series.idle_power_w),
                                             series.idle_power_w, strict=True)]
    gen = engine_throughput(run, phase.start_ns, phase.end_ns)
    client_tput = _f(tokens / phase.duration_s) if phase.duration_s > 0 else None
    engine_in = input_throughput(run, phase.start_ns, phase.end_ns)
    client_in = _f(prompt_tokens_prefilled(rq["first_token_ns"], rq["prompt_tokens"], phase.start_ns,
                                           phase.end_ns) / phase.duration_s) \
        if phase.duration_s > 0 and len(rq["start_ns"]) and not np.isnan(rq["prompt_tokens"]).all() else None
    # a log that can hide micro-batches: SGLang's, every interval-th step, the interval sharing a
    # factor with the micro-batch slots (coprime, every micro-batch is logged in turn)
    interval = int(run.engine.decode_log_interval or 1)
    slots = run.engine.slots_at(run.pp_size)
    sampled = run.engine.engine_spec.steps_logged and math.gcd(interval, slots) > 1
    if sampled and gen is not None and client_tput is not None and abs(gen - client_tput) > \
            client_tput * (THROUGHPUT_ALIAS_RATIO + THROUGHPUT_EDGE_S / max(phase.duration_s, 1.0)):
        gen_taken = None  # a sampled log that hides micro-batches: its throughput is not the engine's
    else:
        gen_taken = gen
    # abandoned at the drain: the client stopped waiting, so neither failed nor complete
    abandoned = rq.get("abandoned", np.zeros(len(rq["ok"]), dtype=bool))
    unfinished = int((in_phase & (np.isnan(rq["end_ns"]) | abandoned)).sum())
    return PhaseMetrics(
        label=phase.label, start_ns=phase.start_ns, end_ns=phase.end_ns, duration_s=phase.duration_s,
        source=phase.source, target_concurrency=phase.target_concurrency, inflight_mean=inflight,
        inflight_p90=inflight_p90,
        work_share=float(np.sum(work * w) / np.sum(w)) if len(w) else 0.0,
        requests_completed=int(done.sum()),
        requests_failed=int((in_phase & ~rq["ok"] & ~abandoned).sum()),
        throughput_tok_s=gen_taken if gen_taken is not None else client_tput,
        client_throughput_tok_s=client_tput, engine_gen_throughput_tok_s=gen,
        throughput_source="engine log" if gen_taken is not None else
        "client records" if client_tput is not None else None,
        input_tok_s=engine_in if engine_in is not None else client_in,
        client_input_tok_s=client_in, engine_input_tok_s=engine_in,
        prefill=prefill_figures(run, phase.start_ns, phase.end_ns) if run.engine.engine_spec.steps_logged
        else None,
        unfinished_requests=unfinished,
        ttft_s_p50=_pct(ttft, 50), ttft_s_p90=_pct(ttft, 90),
        itl_s_mean=_f(np.nanmean(itl)) if len(itl) and not np.isnan(itl).all() else None,
        itl_s_p90=_pct(itl, 90),
        microbatches_in_flight=mb_in_flight, allowed_busy_fraction=allowed, stages=stages)


def _power_shares(power_w: list[float | None], idle_w: np.ndarray) -> list[float | None]:
    """Each stage's power above idle as a share of the highest stage's (None without power)."""
    above = [None if p is None or np.isnan(i) else max(p - float(i), 0.0) for p, i in zip(power_w, idle_w,
                                                                                          strict=True)]
    top = max((a for a in above if a is not None), default=0.0)
    return [None if a is None or top <= 0 else a / top for a in above]


def checked_utilization(st: StageMetrics, in_flight: float, pp_size: int, work: np.ndarray, w: np.ndarray,
                        power_share: float | None, idle_w: float) -> StageMetrics:
    """A stage whose busy figure is utilization.gpu, checked against the schedule from the log: a
    stage computes at most ``allowed`` (micro-batches in flight / pp_size) of the time it has work,
    the bottleneck stage that much and the others by their power above idle against its. Where
    utilization reads more than that, NCCL's waiting receive is counted in it (a PP rank waiting
    for its input runs a spinning kernel): the schedule's figure is taken instead, and says why."""
    if st.busy_signal != BUSY_SIGNALS["utilization"] or st.busy_fraction is None:
        return st
    allowed = min(1.0, in_flight / pp_size)
    share = 1.0 if power_share is None else power_share
    busy_row = allowed * share * work
    busy, bubble = busy_and_bubble(busy_row[None, :], work, w)
    if st.busy_fraction <= float(busy[0]) + UTILIZATION_AGREES:
        return replace(st, busy_signal_reason=(st.busy_signal_reason or "") + (
            f"; the schedule allows {float(busy[0]):.0%}, utilization agrees"))
    power = "" if st.power_w_mean is None or np.isnan(idle_w) else (
        f", power {st.power_w_mean:.0f} W against {idle_w:.0f} W idle")
    return replace(st, busy_fraction=_f(busy[0]), bubble_fraction=_f(bubble[0]),
                   busy_signal=BUSY_SIGNALS["schedule"],
                   busy_signal_reason=(
                       f"utilization.gpu read {st.busy_fraction:.0%} busy but the schedule from the log "
                       f"allows {allowed:.0%} ({in_flight:.1f} micro-batches in flight for {pp_size} "
                       f"stages){power}: NCCL's waiting kernels count in utilization.gpu; the schedule "
                       "gives an upper bound (hand-offs and the scheduler between forwards idle a stage "
                       "too), so this bubble is a lower bound"))
