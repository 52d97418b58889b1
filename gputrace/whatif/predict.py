"""The fitted model under a change: per phase, what the capture measured, what the model gives
under the change, and the band from the fit's residuals. Also the engine flags findings name,
as the simulator's parameters that make them."""

from __future__ import annotations

import dataclasses

import numpy as np

from gputrace.engines import ENGINE_WORDS, engine_words
from gputrace.engines.common import EngineWords
from gputrace.engines.knobs import Knob
from gputrace.errors import ConfigError, UsageError
from gputrace.sim.params import SimParams, make_params
from gputrace.vocabulary import Change, EngineSettings
from gputrace.whatif.fit import REPLAY_SEEDS, FittedModel, median_outcomes, replay_seeds
from gputrace.whatif.outcome import PhaseOutcome
from gputrace.whatif.param_change import ParamChange, ParamValue
from gputrace.whatif.prediction import PhasePrediction

# What a what-if may change: the deployment's settings and the load. The cost model is the fit's.
CHANGEABLE = ("pp_max_micro_batch_size", "max_running_requests", "pp_async_batch_depth",
              "chunked_prefill_size", "max_prefill_tokens", "max_total_num_tokens", "decode_log_interval",
              "stage_cost_multipliers", "pcie_bandwidth_bytes_per_s", "pcie_latency_s", "concurrency",
              "client_max_inflight", "input_tokens", "max_tokens", "think_s")
# The settings a finding's change can name that the simulator takes as they are.
SIMULATED_KNOBS = frozenset({"pp_max_micro_batch_size", "max_running_requests", "decode_log_interval",
                             "pp_async_batch_depth", "max_total_num_tokens"})
# gputrace's names of the engines' knobs a user can set
SETTING_NAMES = frozenset(k.name for w in ENGINE_WORDS.values() for k in w.knobs if k.settable)
# What a what-if may change beside the engine's knobs (which the run's engine names, from the
# registry in gputrace/engines/): the cost model's layer split, the link, and the load.
MODEL_AND_LOAD = tuple(k for k in CHANGEABLE if k not in SETTING_NAMES)
LOAD_WORDS = "concurrency, input_tokens, max_tokens"
# The load's lengths: a change of them replaces the run's recorded requests with drawn ones
LENGTH_KEYS = frozenset({"input_tokens", "max_tokens", "input_tokens_jitter", "output_tokens_jitter"})
# A healthy link between adjacent stages (what "use NVLink or a full PCIe link" buys): the
# simulator's default, a PCIe gen4 x16 link's payload rate.
HEALTHY_LINK = {"pcie_bandwidth_bytes_per_s": SimParams().pcie_bandwidth_bytes_per_s,
                "pcie_latency_s": SimParams().pcie_latency_s}


# A band widens this much per doubling of the largest micro-batch a change runs past the largest
# the run ran (the step cost there is extrapolated, not measured)
EXTRAPOLATION_PER_DOUBLING = 0.15
# ... and widens by the gap between two step costs that both hold the sizes it ran, where the change
# runs a size between them (predict.interpolation_gap), where that gap is at least this
INTERPOLATION_FLOOR = 0.01


def engine_keys(words: EngineWords) -> dict[str, Knob]:
    """What ``--set`` takes for the run's engine's knobs: its own names (vLLM's max_num_seqs), and
    gputrace's where no other engine uses that name for a setting of its own."""
    own = {k.own_name: k for k in words.knobs if k.settable and k.simulated}
    foreign = {k.own_name for w in ENGINE_WORDS.values() if w is not words for k in w.knobs}
    return {**{k.name: k for k in own.values() if k.name not in foreign}, **own}


def _knob_owner(key: str, words: EngineWords) -> EngineWords | None:
    """The other engine whose setting ``key`` is (its own name for it), None where none is."""
    return next((w for w in ENGINE_WORDS.values() if w is not words
                 and any(k.own_name == key for k in w.knobs)), None)


def check_changes(engine: EngineSettings, pp_size: int, changes: ParamChange) -> dict[str, ParamValue]:
    """The changes under the simulator's names; a knob the run's engine does not have, unknown
    keys and impossible values as one-line errors naming the knobs it has, before any fitting."""
    words = engine_words(engine.kind)
    keys = engine_keys(words)
    has = f"this run is {words.name}'s: its knobs are {', '.join(keys_named(words))}"
    valid = f"valid keys: {', '.join((*keys_named(words), *MODEL_AND_LOAD))}"
    named: dict[str, ParamValue] = {}
    for key, value in changes.items():
        knob = keys.get(key)
        if knob is not None:
            named.update(dict.fromkeys((knob.sim_param or knob.name, *knob.sets_too), value))
        elif key in MODEL_AND_LOAD:
            named[key] = value
        elif (owner := _knob_owner(key, words)) is not None:
            raise UsageError(f"whatif: {key} is {owner.name}'s setting; {has} (and the load: {LOAD_WORDS})")
        else:
            raise UsageError(f"whatif: cannot change {key!r}; {valid}")
    try:
        make_params({"engine": words.kind, "pp_size": pp_size, **named})
    except ConfigError as exc:
        raise UsageError(f"whatif: {exc}; {valid}") from None
    return named


def keys_named(words: EngineWords) -> tuple[str, ...]:
    """The run's engine's knobs as ``--set`` names them (its own words), in its registry's order."""
    return tuple(dict.fromkeys(k.own_name for k in engine_keys(words).values()))


def changed_params(model: FittedModel, changes: ParamChange) -> SimParams:
    """The fitted parameters with ``changes`` applied and checked (one-line errors). A new layer
    split keeps the total: its shares are scaled to the fitted multipliers' sum."""
    base = model.params
    values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    values.update(changes)
    if LENGTH_KEYS & set(changes):  # requests of other lengths: drawn, not the run's own
        values["request_lengths"] = ()
    try:
        p = make_params(values)
    except ConfigError as exc:
        raise UsageError(f"whatif: {exc}") from None
    if "stage_cost_multipliers" in changes and p.stage_cost_multipliers:
        total = sum(base.stage_multiplier(s) for s in range(base.pp_size))
        shares = np.asarray(p.stage_cost_multipliers, dtype=float)
        if (shares <= 0).any():
            raise UsageError("whatif: stage_cost_multipliers must be > 0")
        split = tuple(float(x) for x in shares * total / shares.sum())
        p = dataclasses.replace(p, stage_cost_multipliers=split)
    return p


def _ratio(new: float | None, old: float | None) -> float | None:
    return new / old if new is not None and old is not None and old > 0 else None


def _scaled_by(measured: float | None, new: float | None, old: float | None) -> float | None:
    """measured x new / old; the model's own figure where the ratio is unknown."""
    r = _ratio(new, old)
    return measured * r if r is not None and measured is not None else new


def calibrated(measured: PhaseOutcome, change: PhaseOutcome, as_run: PhaseOutcome) -> PhaseOutcome:
    """The measured phase moved by what the change moves in the model: each figure measured x
    model(change) / model(as run)."""
    def f(name: str) -> float | None:
        return _scaled_by(getattr(measured, name), getattr(change, name), getattr(as_run, name))

    return dataclasses.replace(
        change, label=measured.label, throughput_tok_s=f("throughput_tok_s"), ttft_s_p50=f("ttft_s_p50"),
        ttft_s_p90=f("ttft_s_p90"), itl_s_p50=f("itl_s_p50"), itl_s_p90=f("itl_s_p90"))


def decode_step_s(p: SimParams, size: float) -> float:
    """The model's cost of one stage's decode step of ``size`` requests (sim.engine's step, no
    context, multiplier 1)."""
    memory = p.weight_read_s
    if p.moe_experts:
        memory += (1.0 - (1.0 - p.moe_top_k / p.moe_experts) ** size) * p.expert_read_s
    return p.launch_s + max(memory, p.decode_token_s * size)


def interpolation_gap(p: SimParams, size: float, below: float, above: float) -> float:
    """How far apart two step costs that both hold the run's steps of ``below`` and ``above``
    requests are at ``size`` between them, against the model's: the model's knee (a memory floor,
    then a cost per request) and the straight line between the two measured steps. The run cannot
    tell them apart: a dense model's step has the knee, a MoE's (the experts a step's requests
    read) lies near the line (the motivating deployment's at 4 requests 2 % below the line through
    its steps of 1 and 8); the knee fitted to the demo's live defaults (steps of 1 and 8) is 11 %
    below that line at 4 requests, 7 % at 5."""
    lo, hi = decode_step_s(p, below), decode_step_s(p, above)
    line = lo + (size - below) * (hi - lo) / (above - below)
    return abs(line / decode_step_s(p, size) - 1.0)


def extrapolation_band(model: FittedModel, o: PhaseOutcome, changes: ParamChange
                       ) -> tuple[float, str | None]:
    """The band's widening where the change runs decode micro-batches or prefill turns of sizes
    the run did not run, and why (both where both)."""
    parts = [w for w in (_decode_extrapolation(model, o, changes), _prefill_extrapolation(model, o))
             if w[1] is not None]
    return sum(w for w, _ in parts), "; ".join(why for _, why in parts if why) or None


def _prefill_extrapolation(model: FittedModel, o: PhaseOutcome) -> tuple[float, str | None]:
    """Prefill turns past the largest the run's lines show, by EXTRAPOLATION_PER_DOUBLING per
    doubling: the turn's cost there is the fit's line carried on, and a run whose turns all take
    one chunk cannot tell a turn's fixed cost from its cost per token. SGLang on this machine's
    CPU (tests/engines, prompts of 950-1,900 tokens): a run of 256-token turns priced a
    1,024-token turn's change at x1.11 against x1.31 measured, and a 4,096-token one (turns of up
    to 3,461 tokens, which cost 494 ms where the line carried on says about 1 s) at x0.95 against
    x2.20: 9-20 % per doubling."""
    seen, size = model.largest_prefill_turn, o.prefill_tokens_p90
    if not seen or not size or size <= seen * 1.05:
        return 0.0, None
    return (EXTRAPOLATION_PER_DOUBLING * float(np.log2(size / seen)),
            f"the change runs prefill turns of {size:.0f} prompt tokens; this run never ran more than "
            f"{seen:.0f}, and a turn's cost past that is the fit's line carried on: wide band")


def _decode_extrapolation(model: FittedModel, o: PhaseOutcome, changes: ParamChange
                          ) -> tuple[float, str | None]:
    """Decode micro-batches of sizes the run did not run: past the largest, by
    EXTRAPOLATION_PER_DOUBLING per doubling; between two it ran, by the gap between the step
    costs that both hold the run's (interpolation_gap)."""
    seen = model.largest_microbatch
    size = o.microbatch_size_p90
    if not seen or not size:
        return 0.0, None
    k = changes.get("pp_max_micro_batch_size")
    what = f"K={k} runs" if k is not None else "the change runs"
    # in the engine's words: SGLang's PP slots run micro-batches, vLLM's scheduler batches
    unit = "micro-batches" if model.params.engine_spec.microbatch_slots else "batches"
    if size > seen * 1.05:
        return (EXTRAPOLATION_PER_DOUBLING * float(np.log2(size / seen)),
                f"{what} {unit} of {size:.0f}; this run never ran more than {seen:.0f}: wide band")
    ran = sorted({s for m in model.measured for s in (m.microbatch_size_p90, m.microbatch_size_max) if s})
    below = max((s for s in ran if s <= size), default=None)
    above = min((s for s in ran if s >= size), default=None)
    if below is None or above is None or min(size / below, above / size) <= 1.05:
        return 0.0, None
    gap = interpolation_gap(model.params, size, below, above)
    if gap < INTERPOLATION_FLOOR:
        return 0.0, None
    return (gap, f"{what} {unit} of {size:.0f}, between the {below:.0f} and {above:.0f} this run "
            f"ran: a step cost with a memory floor and one straight between those two differ by "
            f"{gap:.0%} there, and the run cannot tell which holds: band +{gap:.0%}")


def _key(changes: ParamChange, seeds: tuple[int, ...]) -> str:
    return f"{sorted(changes.items())!r} at {seeds!r}"


def _fit_seeds(model: FittedModel) -> tuple[int, ...]:
    return tuple(REPLAY_SEEDS[:len(model.replays)]) if model.replays else REPLAY_SEEDS


def predicted_already(model: FittedModel, changes: ParamChange) -> list[PhasePrediction] | None:
    """The full prediction of ``changes`` (every seed, whole phases) where one was made."""
    return model.predictions.get(_key(changes, _fit_seeds(model)))


def predict(model: FittedModel, changes: ParamChange,
            seeds: tuple[int, ...] | None = None, phase_s: float | None = None,
            latencies: bool = True) -> list[PhasePrediction]:
    """Run the fitted model under ``changes`` (at ``seeds``, default the fit's replay seeds);
    pair each level with the captured phase at it and calibrate it against the model's replay of
    that phase as it ran at the same seeds. ``phase_s``: replay each phase this long at most (a
    search's screening), the run as it ran replayed as long for the ratio; with ``latencies``
    False such a short replay and its ratio's are not drained after their last phase (a quarter
    of a screening's steps): throughput, bubbles and batch sizes are the drained replay's, the
    TTFT and ITL of the requests still in flight at its end are not."""
    p = changed_params(model, changes)
    all_seeds = _fit_seeds(model)
    use = seeds if seeds is not None else all_seeds
    short = phase_s is not None and phase_s < p.phase_s
    undrained = short and not latencies
    key = _key(changes, use) + (f" for {phase_s} s" if short else "") + (" undrained" if undrained else "")
    if key in model.predictions:
        return model.predictions[key]
    if short:
        assert phase_s is not None
        p = dataclasses.replace(p, phase_s=phase_s, drain_s=0.0 if undrained else p.drain_s)
        base_key = f"as run at {use!r} for {phase_s} s" + (" undrained" if undrained else "")
        if base_key not in model.short_replays:
            model.short_replays[base_key] = replay_seeds(
                dataclasses.replace(model.params, phase_s=phase_s,
                                    drain_s=0.0 if undrained else model.params.drain_s), model.labels, use)
        short_runs = model.short_replays[base_key]
    by_level = {m.concurrency: i for i, m in enumerate(model.measured)}
    # as many levels as captured: each phase keeps its place (a finding's level raised stays its
    # phase); other levels pair with the captured phase at the same level, if any
    same_phases = len(p.concurrency) == len(model.measured)
    runs = replay_seeds(p, model.labels if same_phases else None, use)
    outcomes = median_outcomes(runs)
    as_run_runs = [list(model.replays[all_seeds.index(s)]) for s in use if s in all_seeds] \
        if model.replays else []
    if short:
        as_run_runs = short_runs
    as_run = median_outcomes(as_run_runs) if len(as_run_runs) == len(use) else model.simulated
    out = []
    for i, o in enumerate(outcomes):
        j = i if same_phases else by_level.get(o.concurrency)
        measured = model.measured[j] if j is not None else None
        band = model.band_ratio(measured.label) if measured is not None else model.uncertainty_ratio
        widen, why = extrapolation_band(model, o, changes)
        unchanged, predicted = None, o
        if measured is not None and j is not None:
            base = as_run[j]
            predicted = calibrated(measured, o, base)
            corr = model.correction.get(measured.label, 1.0)
            tok_s = None if base.throughput_tok_s is None else base.throughput_tok_s * corr
            unchanged = dataclasses.replace(base, throughput_tok_s=tok_s)
        out.append(PhasePrediction(o.label, o.concurrency, measured, predicted, band + widen, unchanged, o,
                                   why, model.uncertainty_ratio + widen))
    model.predictions[key] = out
    return out


def even_split(model: FittedModel) -> ParamChange:
    """The layer split that gives every stage the same work (the fitted total kept)."""
    return {"stage_cost_multipliers": (1.0,) * model.params.pp_size}


def prefill_budget_change(p: SimParams, chunk: int) -> ParamChange:
    """A prefill budget of ``chunk`` tokens in the simulator's keys: SGLang's chunk, with its
    turn budget (max_prefill_tokens) raised to it where below; vLLM's one step budget
    (max_num_batched_tokens, held under both)."""
    budget = p.engine_spec.knob_named("chunked_prefill_size")
    if budget is not None and "max_prefill_tokens" in budget.sets_too:  # one budget for both (vLLM)
        return {"chunked_prefill_size": chunk, "max_prefill_tokens": chunk}
    return {"chunked_prefill_size": chunk, "max_prefill_tokens": max(chunk, p.max_prefill_tokens)}


def finding_change(model: FittedModel, change: Change, phase: str) -> ParamChange | None:
    """The simulator change that a finding's recommendation makes (its ``change``, at its
    ``phase``), None where the model cannot make it (cooling, a KV flag without a value)."""
    knob, value = change.knob, change.value
    if knob in SIMULATED_KNOBS:
        return {knob: value} if value is not None else None
    if knob == "chunked_prefill_size" and value is not None:
        return prefill_budget_change(model.params, int(value))
    if knob == "max_prefill_tokens" and value is not None and \
            model.params.engine_spec.knob_named("max_prefill_tokens") is not None:
        return {knob: value}  # SGLang's turn budget alone: it stops admission, cuts no prompt
    if knob == "layer_partition":
        return even_split(model)
    if knob == "link":
        return dict(HEALTHY_LINK)
    if knob == "client":  # the client keeps the level it is asked for
        return {"client_max_inflight": None}
    if knob == "concurrency" and value is not None:
        levels = list(model.params.concurrency)
        at = [i for i, m in enumerate(model.measured) if m.label == phase]
        for i in at:
            levels[i] = max(levels[i], int(value))
        return {"concurrency": tuple(levels)} if at else None
    return None
