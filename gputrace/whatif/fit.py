"""The simulator's cost model fitted to a captured run, from what the capture holds: the engine
configuration its log states, the load (phases' levels, the requests' token lengths), and per
phase the stages' GPU busy time against the steps their scheduler lines count (and the prompt
tokens their prefill lines state).

A stage step costs launch + max(weight_read, decode_token x tokens) + context_token x context
(gputrace.sim.engine). Per phase, busy time = a x (steps x flat part) + b x (token part), a and b
fitted by least squares on relative residuals, tied towards a = b (the simulator's shape) where
the phases do not tell them apart; each stage's multiplier is its busy share against the mean
(all stages run the same steps). A simulated replay of the captured phases gives the fit's
quality per phase, whose residuals are the predictions' uncertainty (where no phase could be
fitted, a first replay sets the overall scale).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from gputrace.analysis.diagnose import engine_kind
from gputrace.analysis.phase_figures import PhaseMetrics
from gputrace.analysis.result import Analysis
from gputrace.engines import engine_words
from gputrace.run_tables import EngineSettings
from gputrace.sim.params import SimParams, make_params
from gputrace.whatif.lengths import fit_output_lengths, output_observations, recorded_lengths
from gputrace.whatif.outcome import (
    PhaseOutcome,
    measured_outcomes,
    phase_concurrency,
    relative_error,
    trace_outcomes,
)
from gputrace.whatif.param_change import ParamValue, with_changes
from gputrace.whatif.prediction import PhasePrediction
from gputrace.whatif.replay import Reached, counted, current_session, run_replay

_Scored = TypeVar("_Scored", bound=tuple[Any, ...])  # (error, ...) of one point of a search
COST_FIELDS = ("launch_s", "weight_read_s", "decode_token_s", "prefill_token_s", "context_token_s")
# A captured phase is replayed long enough for a steady state and no longer: a few of its
# requests' lives (the median request's start to end), at least STEADY_MIN_S, at most MAX_PHASE_S
MAX_PHASE_S = 120.0
STEADY_MIN_S = 20.0
STEADY_LIFETIMES = 2.0
# A replay runs at most this many load levels, whatever the number of captured phases (a long
# run holds hundreds, and each replayed phase costs STEADY_MIN_S to MAX_PHASE_S of simulation):
# beyond it, levels spread over the captured range are replayed, ascending, and each phase takes
# the replay of the level nearest its own
MAX_REPLAYED_LEVELS = 16
# the replay of the run as it ran within this of each measured phase, else that phase is
# corrected (its measured / replayed factor applies to what the model gives there)
CALIBRATION_TOLERANCE = 0.05
TIE_WEIGHT = 0.3  # pull of a = b on the least squares (relative units)
UNCERTAINTY_FLOOR = 0.03  # seed-to-seed spread of a phase's throughput in the simulator
LINK_EFFICIENCY = 0.8  # a PCIe link's payload rate against its raw rate (TLP/DLLP overhead)
REPLAY_TOLERANCE = 0.02  # a replay this close keeps the physical fit (one replay less)
REPLAY_SEEDS = (0, 1, 2)  # the replays a predicted figure is the median of
# Without busy figures (a run with no GPU samples: a CPU engine, or only the log) the token part
# against the flat part is found by replays: log2 of b / a searched in this range, this many times
SHAPE_LOG2_RANGE = (-5.0, 7.0)
SHAPE_SEARCH_STEPS = 8
# A CPU run's stages share the host's cores: the cores their forwards have together is tried by
# replay at this many values from one core up to (not including) one a stage, and at no sharing
SHARED_CORE_TRIES = 4
# ... and rank 0's work per queued request each step, as a share of the step's flat part, searched
# in this range this many times (where it replays the run better than none)
QUEUE_COST_RANGE = (0.0, 1.0)
QUEUE_SEARCH_STEPS = 7
CLIENT_SHORTFALL = 0.85  # as diagnose: a client below this share of its level is its own bound
# A prompt token's cost is searched apart from a decode token's (fit_prefill_scale) where the
# replay's median TTFT is this far off the measured (RMS of the log ratio over phases), as a factor
# of 2 ** this range, this many times
TTFT_MISFIT = 0.1
PREFILL_SCALE_LOG2_RANGE = (-4.0, 4.0)
PREFILL_SCALE_STEPS = 8
# a prefix cache holding less of the prompts than this is not replayed (a few shared tokens of a
# chat template move nothing)
MIN_CACHED_SHARE = 0.05


@dataclass(frozen=True, slots=True)
class PhaseWork:
    """What one captured phase's stages did, as the cost model sees it."""

    label: str
    busy_s: float  # mean over stages, multiplier removed
    decode_steps: float
    prefill_steps: float
    microbatch_size: float  # tokens per decode step
    # sizes of the logged decode steps: the compute past the knee is convex in the size, so a
    # bunched load (steps of 1 and of 30) costs more than its mean size says
    logged_sizes: np.ndarray | tuple[float, ...]
    context_tokens: float  # per decode step
    prefill_tokens_per_step: float


@dataclass
class FittedModel:
    """The fitted simulator parameters, how well they replay the run, and its uncertainty.

    ``simulated`` is the model's replay of the run as it ran (per phase the median over
    REPLAY_SEEDS; ``replays`` holds each seed's), ``correction`` per phase the factor that brings
    that replay to the measurement where the model's shape cannot (1 where it is within
    CALIBRATION_TOLERANCE): predictions are measured x model(change) / model(as run)."""

    params: SimParams
    measured: list[PhaseOutcome]
    simulated: list[PhaseOutcome]
    uncertainty_ratio: float  # relative band on a predicted throughput (RMS residual, floored)
    scale: dict[str, float] = field(default_factory=dict)  # a, b and the replay's correction
    notes: list[str] = field(default_factory=list)
    replays: tuple[tuple[PhaseOutcome, ...], ...] = ()  # the run as it ran, one per replay seed
    correction: dict[str, float] = field(default_factory=dict)  # phase label -> factor
    # predictions already replayed (whatif.predict), by change and seeds: the findings' effects
    # and the advice's search share them
    predictions: dict[str, list[PhasePrediction]] = field(default_factory=dict, repr=False)
    # the run as it ran, replayed short for a screening (whatif.predict), by seeds and length
    short_replays: dict[str, list[list[PhaseOutcome]]] = field(default_factory=dict, repr=False)

    @property
    def labels(self) -> list[str]:
        return [m.label for m in self.measured]

    @property
    def largest_microbatch(self) -> float | None:
        """The largest decode micro-batch the run's lines show (what the fit has seen)."""
        seen = [m.microbatch_size_max for m in self.measured if m.microbatch_size_max]
        return max(seen) if seen else None

    @property
    def largest_prefill_turn(self) -> float | None:
        """The most prompt tokens one prefill turn of the run computed (its lines'), if they say."""
        seen = [m.prefill_tokens_max for m in self.measured if m.prefill_tokens_max]
        return max(seen) if seen else None

    def band_ratio(self, label: str) -> float:
        """The band on a phase's predicted throughput: the fit's residual and the phase's own
        spread in the run (what a rerun of the same setting can move it by), in quadrature."""
        spread = next((m.throughput_spread_ratio for m in self.measured if m.label == label), None)
        return float(np.hypot(self.uncertainty_ratio, spread or 0.0))

    def unchanged_tok_s(self, label: str) -> float | None:
        """The calibrated model's throughput for the run as it ran at a phase."""
        for s in self.simulated:
            if s.label == label and s.throughput_tok_s is not None:
                return s.throughput_tok_s * self.correction.get(label, 1.0)
        return None

    def quality_rows(self) -> list[PhaseFit]:
        """Per phase: measured against simulated throughput, TTFT p50 and ITL p50."""
        return [PhaseFit(m.label, m.concurrency, (m.throughput_tok_s, s.throughput_tok_s),
                         (m.ttft_s_p50, s.ttft_s_p50), (m.itl_s_p50, s.itl_s_p50),
                         relative_error(s.throughput_tok_s, m.throughput_tok_s),
                         self.correction.get(m.label, 1.0))
                for m, s in zip(self.measured, self.simulated, strict=True)]


Figures = tuple[float | None, float | None]  # (measured, simulated)


@dataclass(frozen=True, slots=True)
class PhaseFit:
    """One captured phase against the fitted model's replay of it as it ran."""

    phase: str
    concurrency: int
    throughput_tok_s: Figures
    ttft_s_p50: Figures
    itl_s_p50: Figures
    throughput_error: float | None  # simulated / measured - 1
    correction: float  # the phase's calibration factor (1: within CALIBRATION_TOLERANCE)


def deployment_params(engine: EngineSettings, pp_size: int) -> dict[str, ParamValue]:
    """The deployment as the log states it; what it does not state keeps the simulator's default."""
    fields = engine.fields or {}
    kind = engine_kind(engine)
    out: dict[str, ParamValue] = {"engine": kind, "pp_size": pp_size}
    for key in ("tp_size", "max_running_requests", "pp_max_micro_batch_size", "pp_async_batch_depth",
                "chunked_prefill_size", "max_total_num_tokens", "decode_log_interval"):
        if (value := getattr(engine, key)) is not None:
            out[key] = value
    if isinstance(turn := fields.get("max_prefill_tokens"), int | float) and turn:
        out["max_prefill_tokens"] = turn
    # the longest context (SGLang's context_len, vLLM's max_model_len): how far the search takes
    # the prefill budget
    context = next((v for k in ("context_len", "context_length", "max_model_len")
                    if isinstance(v := fields.get(k), int | float) and v > 0), None)
    if context is not None:
        out["context_len"] = int(context)
    words = engine_words(kind)
    for name in ("pp_max_micro_batch_size", "pp_async_batch_depth"):
        if words.knob_named(name) is None:  # a setting the engine does not have (vLLM's K)
            out.pop(name, None)
    return out


def _load_params(analysis: Analysis) -> dict[str, ParamValue]:
    """The load: each phase's level, its length, the requests' token lengths, a client's own cap."""
    rq = analysis.run.requests
    out: dict[str, ParamValue] = {"concurrency": tuple(phase_concurrency(pm) for pm in analysis.metrics)}
    durations = [pm.duration_s for pm in analysis.metrics if pm.duration_s > 0]
    if durations:
        out["phase_s"] = min(float(np.median(durations)), steady_phase_s(rq))
    ok = rq["ok"] & np.isfinite(rq["completion_tokens"].astype(float)) if len(rq["ok"]) else np.zeros(0, bool)
    prompt = rq["prompt_tokens"][ok].astype(float) if len(rq["ok"]) else np.zeros(0)
    prompt = prompt[np.isfinite(prompt)]
    if len(prompt):
        mean_in = float(prompt.mean())
        out["input_tokens"] = max(round(mean_in), 1)
        # uniform +- j x mean has a standard deviation of j x mean / sqrt(3)
        out["input_tokens_jitter"] = float(min(np.sqrt(3) * prompt.std() / mean_in, 0.95))
    if (cached := logged_cached_share(analysis)) >= MIN_CACHED_SHARE:
        out["prefix_cached_share"] = round(cached, 3)
    tokens, finished = output_observations(rq, recording_end_ns(analysis))
    outputs = fit_output_lengths(tokens, finished)
    if outputs is not None:
        out["max_tokens"] = outputs.max_tokens
        out["output_tokens_jitter"] = outputs.jitter
    out["request_lengths"] = recorded_lengths(rq, tokens, finished, outputs)
    if burst_load(analysis):
        # each level sent its requests at once and ended with the last: replay it so (a closed
        # loop would refill the slots turn by turn, where the burst's packing is the point)
        out["client_mode"] = "burst"
        out["phase_s"] = MAX_BURST_S
        out["burst_offsets_s"] = burst_offsets(analysis)
        return out
    short = [pm.inflight_mean for pm in analysis.metrics if pm.target_concurrency and pm.inflight_mean
             and pm.inflight_mean < CLIENT_SHORTFALL * pm.target_concurrency]
    if short:
        out["client_max_inflight"] = max(round(max(short)), 1)
    return out


def logged_cached_share(analysis: Analysis) -> float:
    """The share of the prompts' tokens the engine's prefix cache held, as its prefill lines state
    (SGLang's #cached-token against #new-token, stage 0's lines in the phases; 0 where the log
    does not say)."""
    if not analysis.run.stage_events:
        return 0.0
    ev = analysis.run.stage_events[0]
    cached = new = 0.0
    for pm in analysis.metrics:
        lo, hi = np.searchsorted(ev.t_ns, [pm.start_ns, pm.end_ns])
        prefill = ev.kind[lo:hi] == "prefill"
        c = np.asarray(ev.cached_token[lo:hi][prefill], dtype=float)
        n = np.asarray(ev.new_token[lo:hi][prefill], dtype=float)
        ok = np.isfinite(c) & np.isfinite(n)
        cached += float(c[ok].sum())
        new += float(n[ok].sum())
    return cached / (cached + new) if cached + new > 0 else 0.0


def recording_end_ns(analysis: Analysis) -> float:
    """When the recording ended: its grid's last cell, or the last request's end after it."""
    grid = analysis.run.grid_ns
    ends = analysis.run.requests["end_ns"].astype(float)
    candidates = [float(grid[-1])] if len(grid) else []
    candidates += [float(np.nanmax(ends))] if np.isfinite(ends).any() else []
    return max(candidates, default=float("nan"))


MAX_BURST_S = 600.0  # a replayed burst level ends with its last request, at the latest then
BURST_SPAN = 0.05  # of a phase: its requests all started within it, and it ended with their last


def burst_load(analysis: Analysis) -> bool:
    """Whether every phase was a burst (the motivating figures' way of measuring): it started its
    level's requests at once, none after (no more than the level), and ended with the last."""
    rq = analysis.run.requests
    if not len(rq["ok"]) or not analysis.metrics:
        return False
    start, end = rq["start_ns"].astype(float), rq["end_ns"].astype(float)
    for pm in analysis.metrics:
        span_ns = float(pm.end_ns - pm.start_ns)
        sel = (start >= pm.start_ns) & (start < pm.end_ns)
        level = pm.target_concurrency
        if not level or span_ns <= 0 or not sel.any() or sel.sum() > level:
            return False
        ends = end[sel][np.isfinite(end[sel])]
        if np.ptp(start[sel]) > BURST_SPAN * span_ns or not len(ends) or \
                abs(float(ends.max()) - pm.end_ns) > BURST_SPAN * span_ns:
            return False
    return True


def burst_offsets(analysis: Analysis) -> tuple[float, ...]:
    """When each request of a burst load went out after its level's first, in the order the
    client started them (the order ``recorded_lengths`` replays them in). A client sends a burst
    one request after another (the demo's live C=32: 12 within 2 ms, the rest 25 ms later), and
    the engine's first prefill turn takes what has landed: the first request alone, the next
    turns the budget's worth (1, 7, 8, 8, 8). Sent at once, the replay filled every turn, ran
    the burst faster than it ran, and predicted --max-prefill-tokens 3584 at +84 % where it
    measured +36 to +42 %."""
    start = analysis.run.requests["start_ns"].astype(float)
    if not len(start) or not np.isfinite(start).all():
        return ()
    order = np.sort(start)
    offsets = np.zeros(len(order))
    for pm in analysis.metrics:
        sel = (order >= pm.start_ns) & (order < pm.end_ns)
        if sel.any():
            offsets[sel] = (order[sel] - order[sel].min()) / 1e9
    return tuple(round(float(o), 6) for o in offsets)


def steady_phase_s(requests: Mapping[str, np.ndarray]) -> float:
    """How long a replayed phase must be for a steady state: STEADY_LIFETIMES of the median
    request's life (start to end), within [STEADY_MIN_S, MAX_PHASE_S]."""
    if not len(requests["ok"]):
        return MAX_PHASE_S
    ok = requests["ok"].astype(bool)
    life_s = (requests["end_ns"][ok].astype(float) - requests["start_ns"][ok].astype(float)) / 1e9
    life_s = life_s[np.isfinite(life_s) & (life_s > 0)]
    if not len(life_s):
        return MAX_PHASE_S
    return float(np.clip(STEADY_LIFETIMES * float(np.median(life_s)), STEADY_MIN_S, MAX_PHASE_S))


def _link_params(analysis: Analysis, works: list[PhaseWork], pp_size: int) -> dict[str, ParamValue]:
    """Hand-off: bytes per token from stage 0's PCIe transmit rate, the link's rate from its
    generation and width."""
    run = analysis.run
    if pp_size < 2:
        return {}
    rows = run.stage_gpu_rows(0)
    capacity = float(np.nanmin(run.pcie_capacity_bytes_per_s[rows])) if len(rows) else float("nan")
    out: dict[str, ParamValue] = {}
    if np.isfinite(capacity) and capacity > 0:
        out["pcie_bandwidth_bytes_per_s"] = LINK_EFFICIENCY * capacity
    per_token = []
    for pm, w in zip(analysis.metrics, works, strict=False):
        tx = pm.stages[0].pcie_tx_bytes_per_s_mean if pm.stages else None
        tokens = w.decode_steps * w.microbatch_size + w.prefill_steps * w.prefill_tokens_per_step
        if tx and tokens > 0:
            per_token.append(tx * pm.duration_s / tokens)
    if per_token:
        out["activation_bytes_per_token"] = max(round(float(np.median(per_token))), 1)
    return out


def _phase_work(analysis: Analysis, pm: PhaseMetrics, p: SimParams, mults: np.ndarray,
                mean_in: float, mean_out: float) -> PhaseWork | None:
    """Steps and tokens of one phase from its scheduler lines; None where it has no busy figure
    or no decode."""
    busy = np.array([st.busy_fraction if st.busy_fraction is not None else np.nan for st in pm.stages])
    if np.isnan(busy).all() or not pm.throughput_tok_s or pm.duration_s <= 0:
        return None
    tokens = pm.throughput_tok_s * pm.duration_s
    run = analysis.run
    steps: list[float] = []
    prefills: list[float] = []
    prompt: list[float] = []
    sizes: list[np.ndarray] = []  # arrays, never a Python float per line (a long run has millions)
    for ev in run.stage_events:
        lo, hi = np.searchsorted(ev.t_ns, [pm.start_ns, pm.end_ns])
        kinds = ev.kind[lo:hi]
        sizes.append(ev.running_req[lo:hi][(kinds == "decode") & np.isfinite(ev.running_req[lo:hi])])
        steps.append(float((kinds == "decode").sum()) * p.decode_log_interval)
        prefills.append(float((kinds == "prefill").sum()))
        new_tokens = ev.new_token[lo:hi][kinds == "prefill"]
        if len(new_tokens) and np.isfinite(new_tokens).all():
            prompt.append(float(new_tokens.sum()))
    if p.engine_spec.steps_logged and max(steps, default=0.0) > 0:
        n_dec, n_pf = float(np.median(steps)), float(np.median(prefills))
        mb = tokens / n_dec
    else:  # vLLM logs engine-wide stats: pp_size batches share the running requests
        running = _mean_running(analysis, pm)
        mb = max(running / p.pp_size, 1.0) if running else 1.0
        n_dec, n_pf = tokens / mb, 0.0
    pf_tokens = _prompt_tokens(analysis, pm, prompt, mean_in) / n_pf if n_pf else 0.0
    busy_s = float(np.nanmean(busy / mults)) * pm.duration_s
    logged = np.concatenate(sizes).astype(float) if sizes else np.zeros(0)
    logged = logged[logged > 0]
    # scaled to the counted mean: the lines sample the steps, the tokens count them all
    logged_sizes = logged * mb / logged.mean() if len(logged) else np.array([mb])
    return PhaseWork(pm.label, busy_s, n_dec, n_pf, mb, logged_sizes, mb * (mean_in + mean_out / 2),
                     pf_tokens)


def _prompt_tokens(analysis: Analysis, pm: PhaseMetrics, logged: list[float], mean_in: float) -> float:
    """Prompt tokens the phase's prefills computed: their lines' #new-token (the median over the
    stages, which all run the same prefills); without it, the requests the phase started times the
    mean prompt, which misses how many of them wait in the queue past the phase's end (or came
    from the phase before) where admission holds them back, and the prompts a retraction
    recomputes."""
    if logged:
        return float(np.median(logged))
    return _requests_started(analysis, pm) * mean_in


def _requests_started(analysis: Analysis, pm: PhaseMetrics) -> float:
    start = analysis.run.requests["start_ns"]
    return float(((start >= pm.start_ns) & (start < pm.end_ns)).sum()) if len(start) else 0.0


def _mean_running(analysis: Analysis, pm: PhaseMetrics) -> float | None:
    ev = analysis.run.stage_events[0] if analysis.run.stage_events else None
    if ev is None:
        return None
    lo, hi = np.searchsorted(ev.t_ns, [pm.start_ns, pm.end_ns])
    running = ev.running_req[lo:hi]
    running = running[np.isfinite(running)]
    return float(running.mean()) if len(running) else None


def _design(w: PhaseWork, p: SimParams) -> tuple[float, float]:
    """(flat part, token part) of a phase's busy time under the cost fields of ``p``."""
    flat, decode, prefill = _design_parts(w, p)
    return flat, decode + prefill


def _design_parts(w: PhaseWork, p: SimParams) -> tuple[float, float, float]:
    """(flat part, decode tokens' part, prompt tokens' part) of a phase's busy time under the cost
    fields of ``p``: the prompt tokens' part apart, since a prompt token's cost is fitted apart
    (fit_prefill_scale)."""
    flat = (w.decode_steps + w.prefill_steps) * (p.launch_s + p.weight_read_s)
    sizes = np.asarray(w.logged_sizes)
    over = float(np.mean(np.maximum(0.0, p.decode_token_s * sizes - p.weight_read_s))) + \
        p.context_token_s * w.context_tokens
    prefill = w.prefill_steps * max(0.0, p.prefill_token_s * w.prefill_tokens_per_step - p.weight_read_s)
    if p.engine_spec.policy.mixed_prefill:  # prompts ride in the decode steps (vLLM)
        prefill += w.decode_steps * p.prefill_token_s * w.prefill_tokens_per_step
    return flat, w.decode_steps * over, prefill


def fit_scales(works: list[PhaseWork], p: SimParams,
               hold_prefill: bool = False) -> tuple[float, float] | None:
    """Least squares for (a, b) on relative residuals of busy time, with a tie towards a = b.
    ``hold_prefill``: the prompt tokens' part stays as ``p`` costs it and b scales the decode
    tokens' alone (None where that part alone is more than a phase's busy time)."""
    rows, ys = [], []
    for w in works:
        flat, decode, prefill = _design_parts(w, p)
        tok, rest = (decode, w.busy_s - prefill) if hold_prefill else (decode + prefill, w.busy_s)
        if w.busy_s > 0 and flat + tok > 0:
            if rest <= 0:
                return None
            rows.append([flat / w.busy_s, tok / w.busy_s])
            ys.append(rest / w.busy_s)
    if not rows:
        return 1.0, 1.0
    rows.append([TIE_WEIGHT, -TIE_WEIGHT])
    ys.append(0.0)
    (a, b), *_ = np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)
    if a <= 0 or b <= 0:  # the phases cannot tell the parts apart: one scale for both
        x = np.array(rows[:-1]).sum(axis=1)
        a = b = float((x * np.array(ys[:-1])).sum() / (x * x).sum())
    return float(a), float(b)


def _scaled(p: SimParams, a: float, b: float, prefill: float | None = None) -> SimParams:
    """The flat part's costs times ``a``, the tokens' times ``b`` (a prompt token's times
    ``prefill`` where given)."""
    return dataclasses.replace(p, launch_s=p.launch_s * a, weight_read_s=p.weight_read_s * a,
                               decode_token_s=p.decode_token_s * b,
                               prefill_token_s=p.prefill_token_s * (b if prefill is None else prefill),
                               context_token_s=p.context_token_s * b)


def stage_multipliers(metrics: Sequence[PhaseMetrics], pp_size: int) -> np.ndarray:
    """Each stage's busy share against the stages' mean, averaged over phases by busy time."""
    num, den = np.zeros(pp_size), 0.0
    for pm in metrics:
        busy = np.array([st.busy_fraction if st.busy_fraction is not None else np.nan for st in pm.stages])
        if len(busy) != pp_size or np.isnan(busy).any() or busy.mean() <= 0:
            continue
        num += busy  # sum of busy over sum of the means: phases weighted by busy time
        den += busy.mean()
    return num / den if den > 0 else np.ones(pp_size)


def runs_on_cpu(engine: EngineSettings) -> bool:
    """Whether the engine's log states a CPU device (SGLang's ``device``, vLLM's ``device_config``)."""
    return engine.runs_on_cpu


def without_memory_floor(p: SimParams) -> SimParams:
    """The step of a CPU forward: its flat part (launch and weight read) plus compute per token.
    A GPU's decode step reads the weights whatever the batch, so a few tokens cost no more than
    one (the roofline's flat floor); a CPU computes every token on the same cores, so each adds
    its cost from the first. (vLLM on this machine's CPU: about 6 ms a step at 4 tokens, 9 at 16;
    the floor fitted to batches of at most 4 put its knee at 4 and doubled the step at 16.)"""
    return dataclasses.replace(p, launch_s=p.launch_s + p.weight_read_s, weight_read_s=0.0,
                               expert_read_s=0.0, moe_experts=0)


def on_cpu(p: SimParams) -> SimParams:
    """A CPU engine's step (no memory-bound floor) and, for SGLang, its forward run inside rank 0's
    scheduler loop (tests/test_sim_vs_engines.py: how the real engine spreads C=4 over slots)."""
    in_loop = p.engine_spec.policy.cpu_forward_in_loop
    return dataclasses.replace(without_memory_floor(p), synchronous_forward=in_loop)


def shared_core_candidates(pp_size: int) -> tuple[float, ...]:
    """How many cores the stages' forwards may share, tried by replay on a CPU run: from one (the
    forwards take turns) up to one a stage, which is no sharing (0)."""
    if pp_size < 2:
        return (0.0,)
    steps = min(2 * (pp_size - 1), SHARED_CORE_TRIES)
    return (*(round(float(c), 3) for c in np.linspace(1.0, pp_size, steps + 1)[:-1]), 0.0)


def initial_params(analysis: Analysis) -> tuple[SimParams, list[PhaseWork]]:
    """The deployment and load from the capture, and the cost model fitted to its busy time."""
    pp = analysis.run.pp_size
    values = {**deployment_params(analysis.run.engine, pp), **_load_params(analysis)}
    p = make_params(values)
    if runs_on_cpu(analysis.run.engine):
        p = on_cpu(p)
    mults = stage_multipliers(analysis.metrics, pp)
    mean_in = float(p.input_tokens)
    mean_out = p.max_tokens * (1 - p.output_tokens_jitter / 2)
    works = [w for pm in analysis.metrics
             if (w := _phase_work(analysis, pm, p, mults, mean_in, mean_out)) is not None]
    for _ in range(3):  # the knee moves with a / b: refit under the new fields
        a, b = fit_scales(works, p) or (1.0, 1.0)
        p = _scaled(p, a, b)
    uneven = float(mults.max() - mults.min()) > 0.02
    split = tuple(round(float(m), 4) for m in mults) if uneven else ()
    p = dataclasses.replace(p, stage_cost_multipliers=split)
    link = _link_params(analysis, works, pp)
    return with_changes(p, link), works


def _outcomes(p: SimParams, labels: list[str] | None, seed: int) -> list[PhaseOutcome]:
    """One replay's outcomes (gputrace.whatif.replay's driver: each phase stopped once settled),
    from the open replay session's cache where these parameters and seed were replayed."""
    stats = current_session()
    named = tuple(labels) if labels else None
    known = stats.find(p, seed, named) if stats is not None else None
    if known is not None:
        return [dataclasses.replace(o) for o in known]
    ran = counted(run_replay(p, seed))
    out = trace_outcomes(ran.result, labels, [(ph.rest_s, ph.rest_tok_s) for ph in ran.phases])
    if stats is not None:
        stats.cache[(p, seed, named)] = (tuple(out), Reached.of(ran))
    return out


def replayed_levels(levels: tuple[int, ...]) -> tuple[tuple[int, ...], np.ndarray] | None:
    """For more than MAX_REPLAYED_LEVELS phases: the levels a replay runs (ascending, spread
    over the distinct captured ones) and, per phase, the index of the replayed level nearest its
    own; None where every phase is replayed as captured."""
    if len(levels) <= MAX_REPLAYED_LEVELS:
        return None
    distinct = np.unique(np.asarray(levels, dtype=np.int64))
    if len(distinct) > MAX_REPLAYED_LEVELS:
        at = np.round(np.linspace(0, len(distinct) - 1, MAX_REPLAYED_LEVELS)).astype(np.int64)
        distinct = distinct[np.unique(at)]
    nearest = np.abs(np.asarray(levels, dtype=np.int64)[:, None] - distinct[None, :]).argmin(axis=1)
    return tuple(int(c) for c in distinct), nearest


def replay_outcomes(p: SimParams, labels: list[str] | None, seed: int = 0) -> list[PhaseOutcome]:
    """One replay's outcome per phase of ``p`` (named ``labels[i]`` where given): the phases as
    they are, or beyond MAX_REPLAYED_LEVELS, each phase the outcome of the replayed level nearest
    its own (see ``replayed_levels``)."""
    reduced = replayed_levels(p.concurrency)
    if reduced is None:
        return _outcomes(p, labels, seed)
    levels, nearest = reduced
    ran = _outcomes(dataclasses.replace(p, concurrency=levels), None, seed)
    return [dataclasses.replace(ran[int(j)], concurrency=c,
                                label=labels[i] if labels and i < len(labels) else f"C={c}")
            for i, (c, j) in enumerate(zip(p.concurrency, nearest, strict=True))]


def replay_note(p: SimParams) -> str | None:
    """What a replay runs where the run has more phases than it replays."""
    reduced = replayed_levels(p.concurrency)
    if reduced is None:
        return None
    levels = reduced[0]
    return (f"the run has {len(p.concurrency)} phases: the model replays {len(levels)} load levels "
            f"({', '.join(str(c) for c in levels)}, {p.phase_s:.0f} s each) and each phase takes "
            "the replay of the level nearest its own")


def replay_seeds(p: SimParams, labels: list[str] | None, seeds: tuple[int, ...] = REPLAY_SEEDS,
                 done: Mapping[int, list[PhaseOutcome]] | None = None) -> list[list[PhaseOutcome]]:
    """One replay's outcomes per seed; ``done``: seeds already replayed with these parameters
    (a replay is deterministic in its parameters and seed). Where the replay draws no request
    length (a load of fixed lengths) every seed's replay is the same: it runs once."""
    if not p.draws_lengths and seeds:
        known = next(iter(done.values()), None) if done else None
        once = known if known is not None else replay_outcomes(p, labels, seeds[0])
        return [list(once) for _ in seeds]
    return [list(done[seed]) if done and seed in done else replay_outcomes(p, labels, seed)
            for seed in seeds]


def median_outcomes(runs: list[list[PhaseOutcome]]) -> list[PhaseOutcome]:
    """Per phase, the run's outcome of median throughput."""
    out = []
    for phase in zip(*runs, strict=True):
        ranked = sorted(phase, key=lambda o: -1.0 if o.throughput_tok_s is None else o.throughput_tok_s)
        out.append(ranked[len(ranked) // 2])
    return out


def replayed_outcomes(p: SimParams, labels: list[str] | None) -> list[PhaseOutcome]:
    """Per phase, the outcome of median throughput over replays at REPLAY_SEEDS: one seed's
    arrivals and lengths can hold a phase 5 % off the others (kv-bound at C=64: 681 tok/s at
    seed 0, 722 at seeds 1 and 2), and a prediction is of the setting, not of one draw."""
    return median_outcomes(replay_seeds(p, labels))


def _scale_correction(measured: list[PhaseOutcome], simulated: list[PhaseOutcome]) -> float:
    """The factor on every stage cost that best matches the measured throughputs (geometric mean
    of simulated / measured: throughput goes as 1 / step time at every level)."""
    ratios = [s.throughput_tok_s / m.throughput_tok_s for m, s in zip(measured, simulated, strict=True)
              if m.throughput_tok_s and s.throughput_tok_s and m.throughput_tok_s > 0]
    return float(np.exp(np.mean(np.log(ratios)))) if ratios else 1.0


def _rms_error(measured: list[PhaseOutcome], simulated: list[PhaseOutcome]) -> float:
    errors = [e for m, s in zip(measured, simulated, strict=True)
              if (e := relative_error(s.throughput_tok_s, m.throughput_tok_s)) is not None]
    return float(np.sqrt(np.mean(np.square(errors)))) if errors else 0.0


def _fit_shape_by_replay(p: SimParams, measured: list[PhaseOutcome], labels: list[str]
                         ) -> tuple[SimParams, list[PhaseOutcome], float]:
    """The token part's weight against the flat part (b / a) that replays the phases' throughputs
    best, each candidate at its own overall scale: a golden-section search on log2(b / a), since
    the levels' throughputs tell the two apart (a flat cost gives throughput growing with the
    level up to the knee, a token cost gives it flat). Returns the parameters, their replay and
    the overall correction."""
    def at(log2_ratio: float) -> tuple[float, SimParams, list[PhaseOutcome], float]:
        shaped = _scaled(p, 1.0, 2.0 ** log2_ratio)
        first = replay_outcomes(shaped, labels)
        c = _scale_correction(measured, first)
        scaled = _scaled(shaped, c, c)
        sim = replay_outcomes(scaled, labels)
        return _rms_error(measured, sim), scaled, sim, c

    _, best, sim, c = golden_minimum(at, SHAPE_LOG2_RANGE, SHAPE_SEARCH_STEPS)
    return best, sim, c


def golden_minimum(at: Callable[[float], _Scored], bounds: tuple[float, float], steps: int) -> _Scored:
    """A golden-section search of ``at`` (whose result's first item is the error) over
    ``bounds`` in ``steps`` evaluations: the best result seen at the last two points."""
    lo, hi = bounds
    golden = (np.sqrt(5.0) - 1.0) / 2.0
    x1, x2 = hi - golden * (hi - lo), lo + golden * (hi - lo)
    f1, f2 = at(x1), at(x2)
    for _ in range(steps - 2):
        if f1[0] <= f2[0]:
            hi, x2, f2 = x2, x1, f1
            x1 = hi - golden * (hi - lo)
            f1 = at(x1)
        else:
            lo, x1, f1 = x1, x2, f2
            x2 = lo + golden * (hi - lo)
            f2 = at(x2)
    return min(f1, f2, key=lambda f: f[0])


def _fit_sharing_and_shape(p: SimParams, measured: list[PhaseOutcome], labels: list[str]
                           ) -> tuple[SimParams, float]:
    """On a CPU run: the cores the stages' forwards share (shared_core_candidates) that, with its
    own shape and scale, replays the phases best. The run shows it where it ran micro-batches at
    once (a level above one request per stage): whether that raised the throughput as a stage
    per core would. Returns the parameters and the overall correction."""
    best: tuple[float, SimParams, float] | None = None
    for cores in shared_core_candidates(p.pp_size):
        rms, shaped, c = fit_at_cores(p, cores, measured, labels)
        if best is None or rms < best[0] - REPLAY_TOLERANCE:  # the fewest cores unless clearly worse
            best = (rms, shaped, c)
    assert best is not None
    return best[1], best[2]


def fit_at_cores(p: SimParams, cores: float, measured: list[PhaseOutcome], labels: list[str]
                 ) -> tuple[float, SimParams, float]:
    """The stages sharing ``cores`` cores (0: one each): the shape and scale by replay, rank 0's
    cost per queued request where it replays the run better, the shape again under it. Returns
    the replay's RMS error, the parameters and the overall correction."""
    shaped, sim, c = _fit_shape_by_replay(dataclasses.replace(p, shared_cores=cores, queued_request_s=0.0),
                                          measured, labels)
    queued = _fit_queue_cost(shaped, measured, labels, _rms_error(measured, sim))
    if queued is not None:
        shaped, sim, c = _fit_shape_by_replay(queued, measured, labels)
    return _rms_error(measured, sim), shaped, c


def _fit_queue_cost(p: SimParams, measured: list[PhaseOutcome], labels: list[str], rms_without: float
                    ) -> SimParams | None:
    """Rank 0's work per queued request (``queued_request_s``), as a share of the step's flat part,
    that replays the phases best at its own scale: a golden-section search on QUEUE_COST_RANGE;
    None where it does not replay the run better than without it by REPLAY_TOLERANCE (a run with
    no queue cannot show it)."""
    flat = p.launch_s + p.weight_read_s

    def at(share: float) -> tuple[float, SimParams]:
        queued = dataclasses.replace(p, queued_request_s=share * flat)
        c = _scale_correction(measured, replay_outcomes(queued, labels))
        scaled = _scaled(queued, c, c)
        return _rms_error(measured, replay_outcomes(scaled, labels)), queued

    rms, queued = golden_minimum(at, QUEUE_COST_RANGE, QUEUE_SEARCH_STEPS)
    return queued if rms < rms_without - REPLAY_TOLERANCE else None


def _ttft_misfit(measured: list[PhaseOutcome], simulated: list[PhaseOutcome]) -> float | None:
    """The replay's median time to first token against the measured: RMS over phases of the log
    ratio (None where no phase has both)."""
    logs = [np.log(s.ttft_s_p50 / m.ttft_s_p50) for m, s in zip(measured, simulated, strict=True)
            if m.ttft_s_p50 and s.ttft_s_p50 and m.ttft_s_p50 > 0 and s.ttft_s_p50 > 0]
    return float(np.sqrt(np.mean(np.square(logs)))) if logs else None


def with_prefill_scale(p: SimParams, works: list[PhaseWork], scale: float) -> SimParams | None:
    """``p`` with a prompt token costing ``scale`` times as much, the flat and decode parts refitted
    to the phases' busy time around it; None where the prompt tokens alone would take more than
    a phase's busy time."""
    q = dataclasses.replace(p, prefill_token_s=p.prefill_token_s * scale)
    for _ in range(3):  # the knee moves with a / b, as in initial_params
        scales = fit_scales(works, q, hold_prefill=True)
        if scales is None:
            return None
        q = _scaled(q, *scales, prefill=1.0)
    return q


def fit_prefill_scale(p: SimParams, works: list[PhaseWork], measured: list[PhaseOutcome],
                      labels: list[str], measured_phase_s: float) -> tuple[SimParams, str | None]:
    """A prompt token's cost apart from a decode token's, where the busy time cannot tell them
    apart (one phase; prefill turns under the memory floor) and the requests' time to first token
    can: a burst's prompts wait for the turns before theirs, a long prompt for its chunks. Only
    where the prompts are at least as many tokens as the outputs (a prefill-heavy load). Searched
    by replay (golden section on log2 of the scale), the flat and decode parts refitted to the
    busy time at each scale, where the replay's TTFT is off by TTFT_MISFIT; kept where it replays
    TTFT and throughput together better by REPLAY_TOLERANCE. The replays here run the phases as
    long as they were measured: a phase's first requests arrive together and wait behind each
    other's prompts, and a shorter phase gives them more weight in its median TTFT (prefill-mixed:
    0.06 s measured over 120 s, 1.05 s replayed over 28). Returns the parameters and a note."""
    mean_out = p.max_tokens * (1 - p.output_tokens_jitter / 2)
    if not any(w.prefill_steps for w in works) or p.input_tokens < mean_out:
        # where decode tokens are most of the work, a replay's TTFT off the measured is the
        # schedule's (bunched at K 64: 2.2 in log ratio, and a prompt token fitted at x14 broke
        # the K change's prediction, 782 tok/s for 1118), not a prompt's cost
        return p, None
    steady_s = p.phase_s
    p = dataclasses.replace(p, phase_s=max(p.phase_s, measured_phase_s))
    base = replay_outcomes(p, labels)
    misfit = _ttft_misfit(measured, base)
    if misfit is None or misfit < TTFT_MISFIT:
        return dataclasses.replace(p, phase_s=steady_s), None
    before = misfit + _rms_error(measured, base)

    def at(log2_scale: float) -> tuple[float, SimParams, float]:
        q = with_prefill_scale(p, works, 2.0 ** log2_scale)
        if q is None:
            return float("inf"), p, log2_scale
        sim = replay_outcomes(q, labels)
        ttft = _ttft_misfit(measured, sim)
        return (float("inf") if ttft is None else ttft + _rms_error(measured, sim)), q, log2_scale

    error, fitted, log2_scale = golden_minimum(at, PREFILL_SCALE_LOG2_RANGE, PREFILL_SCALE_STEPS)
    if error >= before - REPLAY_TOLERANCE:
        return dataclasses.replace(p, phase_s=steady_s), None
    note = (f"a prompt token's cost is fitted apart from a decode token's, by the requests' time to "
            f"first token (replayed {misfit:.0%} off in log ratio with one cost for both): "
            f"x{2.0 ** log2_scale:.2f} the decode token's scale")
    return dataclasses.replace(fitted, phase_s=steady_s), note


def sharing_note(p: SimParams) -> str:
    """What the fit found of the stages' sharing of the host's cores."""
    if not p.shared_cores:
        return ("the replay fits best with each stage on a core of its own: stages' forwards overlap "
                "as on separate devices")
    text = (f"the replay fits best with the stages' forwards sharing {p.shared_cores:g} core(s): "
            "micro-batches in flight at once take turns on them, so more of them gain less than "
            "on separate devices")
    if p.queued_request_s:
        text += (f"; and with rank 0 working {p.queued_request_s * 1e3:.2f} ms a step per request "
                 "waiting in its queue")
    return text


def fit_model(analysis: Analysis) -> FittedModel:
    """Fit the simulator to ``analysis``: the physical fit and the replay that measures its
    quality (without a physical fit, a replay's throughput sets the scale first)."""
    p, works = initial_params(analysis)
    measured = measured_outcomes(analysis)
    labels = [m.label for m in measured]
    notes = []
    durations = [pm.duration_s for pm in analysis.metrics if pm.duration_s > 0]
    p, prefill_note = fit_prefill_scale(p, works, measured, labels,
                                        float(np.median(durations)) if durations else p.phase_s)
    if prefill_note is not None:
        notes.append(prefill_note)
    if not works:
        notes.append("no phase has both GPU busy figures and decode lines: the cost model is the "
                     "simulator's default, scaled by the replay alone")
    levels = len([m for m in measured if m.throughput_tok_s])
    if not works and levels < 2 and runs_on_cpu(analysis.run.engine) and p.pp_size > 1:
        # one level cannot tell sharing from not: a CPU host's stages are taken to share its cores
        p = dataclasses.replace(p, shared_cores=1.0)
        notes.append("one level cannot show how the stages share the host's cores: the model takes "
                     "their forwards to take turns on one core (a CPU engine's ranks on one host)")
    first = p
    simulated = replay_outcomes(p, labels)
    # The replay corrects the scale where the steps were not counted (no fit, or vLLM's
    # engine-wide lines, whose steps are estimated), and where every phase replays off the same
    # way (a bias of the whole cost: the real-time server's own overhead, say); a replay's
    # throughput also moves with how the load bunches into micro-batches (a K of 64 under 32
    # requests), which a cost scale must not absorb where the phases disagree: there the
    # per-phase calibration below takes it.
    counted = bool(works) and p.engine_spec.steps_logged
    correction = _scale_correction(measured, simulated) if not counted or _one_way(measured, simulated) \
        else 1.0
    if not works and levels >= 2:
        cpu = runs_on_cpu(analysis.run.engine)
        p, correction = _fit_sharing_and_shape(p, measured, labels) if cpu else \
            _fit_shape_by_replay(p, measured, labels)[::2]
        notes[-1] = ("no phase has both GPU busy figures and decode lines: the cost model's scale and "
                     "its token part against its flat part are fitted by replaying the phases")
        if cpu:
            notes.append(sharing_note(p))
    elif abs(correction - 1.0) > REPLAY_TOLERANCE:
        p = _scaled(p, correction, correction)
    if runs_on_cpu(analysis.run.engine):
        notes.append("the log states a CPU device: each step costs its flat part plus compute per "
                     "token from the first token (no memory-bound floor)")
    # the fit's quality, as a prediction is made (the first replay is seed 0's where it kept p)
    runs = replay_seeds(p, labels, done={0: simulated} if p is first else None)
    if (reduced := replay_note(p)) is not None:
        notes.append(reduced)
    simulated = median_outcomes(runs)
    rms = _rms_error(measured, simulated)
    calibration = phase_corrections(measured, simulated)
    if calibration:
        notes.append("the model's shape does not replay every phase within "
                     f"{CALIBRATION_TOLERANCE:.0%}: corrected per phase (measured / replayed) "
                     + ", ".join(f"{k} x{v:.2f}" for k, v in calibration.items())
                     + "; predictions are measured x model(change) / model(as run) at every phase")
    return FittedModel(p, measured, simulated, max(rms, UNCERTAINTY_FLOOR),
                       {"cost_scale": round((p.launch_s + p.weight_read_s) /
                                            (SimParams().launch_s + SimParams().weight_read_s), 4),
                        "token_scale": round(p.decode_token_s / SimParams().decode_token_s, 4),
                        "replay_correction": round(correction, 4)}, notes,
                       tuple(tuple(r) for r in runs), calibration)


def _one_way(measured: list[PhaseOutcome], simulated: list[PhaseOutcome]) -> bool:
    """Whether every phase replays off the measurement the same way, beyond REPLAY_TOLERANCE."""
    errors = [e for m, s in zip(measured, simulated, strict=True)
              if (e := relative_error(s.throughput_tok_s, m.throughput_tok_s)) is not None]
    return bool(errors) and (all(e > REPLAY_TOLERANCE for e in errors) or
                             all(e < -REPLAY_TOLERANCE for e in errors))


def phase_corrections(measured: list[PhaseOutcome], simulated: list[PhaseOutcome]) -> dict[str, float]:
    """Per phase whose replay is off its measurement by more than CALIBRATION_TOLERANCE: the
    factor measured / replayed."""
    out = {}
    for m, s in zip(measured, simulated, strict=True):
        error = relative_error(s.throughput_tok_s, m.throughput_tok_s)
        # a replay of 0 tok/s (error -1) has no factor that corrects it: report ended in ZeroDivisionError
        if error is not None and abs(error) > CALIBRATION_TOLERANCE and error > -1.0:
            out[m.label] = round(1.0 / (1.0 + error), 4)
    return out
