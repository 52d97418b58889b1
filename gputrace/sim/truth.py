"""Ground truth of a virtual run (the form of meta.extra["ground_truth"]): per phase and stage the
true busy and bubble fractions and micro-batch sizes, the throughput, and the causes present.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from gputrace.engines.knobs import interleaving_chunk
from gputrace.sim.params import SCENARIOS, SimParams
from gputrace.sim.samples import cumulative
from gputrace.sim.simulate import SimResult, simulate
from gputrace.sim.truth_records import Fix, FixOutcome, FixResult, GroundTruth, PhaseTruth, StageTruth

STEADY_IN_FLIGHT = 0.1  # micro-batches in flight this close to the slot count: a full pipeline
BUBBLE_MATERIAL = 0.08  # a bubble share worth naming a cause for
UNDERFILLED_SHARE = 0.9  # fewer micro-batches in flight than this share of pp_size
CLIENT_SHORTFALL = 0.85  # client in flight below this share of its target
KV_USAGE_HIGH = 0.9
PCIE_HOP_SHARE = 0.5  # hand-off time against the compute time of a step
IMBALANCE_RATIO = 1.15
# a prefill step longer than a decode cycle (every slot's decode step) holds the other micro-batches'
# decodes back at each stage; this share of stage 0's busy time in such steps is a cause
LONG_PREFILL_SHARE = 0.1


def work_intervals(t: np.ndarray, delta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Spans when the engine held at least one request (running or waiting)."""
    if t.size == 0:
        return np.zeros(0), np.zeros(0)
    order = np.lexsort((-delta, t))  # arrivals before completions at the same instant
    ts, level = t[order], np.cumsum(delta[order])
    prev = np.concatenate(([0], level[:-1]))
    starts = ts[(prev == 0) & (level > 0)]
    ends = ts[(prev > 0) & (level == 0)]
    if ends.size < starts.size:
        ends = np.concatenate((ends, [np.inf]))
    return starts, ends


def _overlap(starts: np.ndarray, ends: np.ndarray, a: float, b: float) -> float:
    xs = np.array([a, b])
    c = cumulative(starts, np.minimum(ends, b + 1.0), xs)
    return float(c[1] - c[0])


def _time_mean(t: np.ndarray, v: np.ndarray, a: float, b: float) -> float | None:
    """Time-weighted mean over [a, b) of a step function set at times t."""
    if t.size == 0:
        return None
    grid = np.linspace(a, b, 2001)[:-1]
    idx = np.searchsorted(t, grid, side="right") - 1
    vals = np.where(idx >= 0, v[np.clip(idx, 0, None)], 0.0)
    return float(vals.mean())


def ground_truth(result: SimResult, scenario_causes: tuple[str, ...]) -> GroundTruth:
    p = result.params
    tr = result.engine.trace
    iv = result.intervals
    w_start, w_end = work_intervals(np.asarray(tr.work_t, dtype=np.float64),
                                    np.asarray(tr.work_delta, dtype=np.int64))
    st_t = np.asarray(tr.st_t, dtype=np.float64)
    tok_t = np.asarray(tr.tok_t, dtype=np.float64)
    tok_n = np.asarray(tr.tok_n, dtype=np.float64)
    kv_stall = np.asarray(tr.kv_stall_t, dtype=np.float64)
    req_start = np.array([r.client_start_s for r in result.requests], dtype=np.float64)
    req_end = np.array([r.finish_s + p.client_latency_s if r.finish_s is not None else np.inf
                        for r in result.requests], dtype=np.float64)
    phases = []
    for ph in result.phases:
        a, b = ph.start_s, ph.end_s
        dur = b - a
        has_work = _overlap(w_start, w_end, a, b)
        stages: list[StageTruth] = []
        for s in range(p.pp_size):
            sel = iv["stage"] == s
            busy = _overlap(iv["start_s"][sel], iv["end_s"][sel], a, b)
            in_phase = sel & iv["decode"] & (iv["start_s"] >= a) & (iv["start_s"] < b)
            sizes = iv["reqs"][in_phase]
            stages.append(StageTruth(
                pp_rank=s,
                busy_fraction=round(busy / dur, 4),
                bubble_fraction=round(max(has_work - busy, 0.0) / dur, 4),
                mean_microbatch_size=round(float(sizes.mean()), 3) if sizes.size else None,
                max_microbatch_size=int(sizes.max()) if sizes.size else None,
                p10_microbatch_size=float(np.percentile(sizes, 10)) if sizes.size else None,
            ))
        in_tok = (tok_t >= a) & (tok_t < b)
        inflight = float(np.clip(np.minimum(req_end, b) - np.maximum(req_start, a), 0, None).sum()) / dur
        sel_st = (st_t >= a) & (st_t < b)
        truth = PhaseTruth(
            label=ph.label, start_ns=result.ns(a), end_ns=result.ns(b),
            target_concurrency=ph.target_concurrency,
            throughput_tok_s=round(float(tok_n[in_tok].sum()) / dur, 3),
            stages=stages,
            microbatches_in_flight=_round4(_time_mean(st_t, np.asarray(tr.st_slots_busy, float), a, b)),
            running_mean=_round4(_time_mean(st_t, np.asarray(tr.st_running, float), a, b)),
            running_max=int(np.max(np.asarray(tr.st_running)[sel_st])) if sel_st.any() else 0,
            queue_mean=_round4(_time_mean(st_t, np.asarray(tr.st_waiting, float), a, b)),
            token_usage_max=round(float(np.max(np.asarray(tr.st_kv_used)[sel_st])) /
                                  p.max_total_num_tokens, 4) if sel_st.any() else 0.0,
            client_inflight_mean=round(inflight, 3),
            kv_admission_stalls=int(((kv_stall >= a) & (kv_stall < b)).sum()),
            pcie_hop_share=_pcie_hop_share(result, a, b),
            long_prefill_share=_long_prefill_share(result, a, b),
            causes=[],  # from the phase's other figures, below
        )
        truth["causes"] = phase_causes(result, truth)
        phases.append(truth)
    return GroundTruth(scenario=result.scenario, seed=p.seed, causes=list(scenario_causes),
                       micro_batch_cap=p.micro_batch_cap, slots=p.slots, phases=phases)


def _round4(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _pcie_hop_share(result: SimResult, a: float, b: float) -> float:
    """Mean hand-off time between stages over the mean compute time of a step, in [a, b)."""
    p = result.params
    iv = result.intervals
    sel = (iv["stage"] == 0) & (iv["start_s"] >= a) & (iv["start_s"] < b)
    if not sel.any():
        return 0.0
    bytes_ = iv["tx_bytes"][sel]
    hop = p.pcie_latency_s + bytes_ / p.pcie_bandwidth_bytes_per_s
    step = iv["end_s"][sel] - iv["start_s"][sel]
    return round(float(hop.mean() / step.mean()), 4)


def _long_prefill_share(result: SimResult, a: float, b: float) -> float:
    """The share of stage 0's busy time in [a, b) spent in prefill steps longer than a decode cycle
    (the slots' count of the phase's median decode step): while one runs, the other micro-batches'
    decodes wait for it at every stage."""
    iv = result.intervals
    sel = (iv["stage"] == 0) & (iv["start_s"] >= a) & (iv["start_s"] < b)
    step = (iv["end_s"] - iv["start_s"])[sel]
    decode = iv["decode"][sel]
    if not decode.any() or not step.sum():
        return 0.0
    cycle = result.params.slots * float(np.median(step[decode]))
    return round(float(step[~decode & (step > cycle)].sum() / step.sum()), 4)


def _load(p: SimParams, ph: PhaseTruth) -> int:
    """The requests the engine is offered in a phase: the client's level (or its own cap)."""
    target = int(ph["target_concurrency"])
    return min(target, p.client_max_inflight) if p.client_max_inflight else target


def spread_cap(p: SimParams, load: int) -> int:
    """The K that spreads ``load`` requests over every micro-batch slot: ceil(load / slots)."""
    return max(-(-load // p.slots), 1)


def phase_causes(result: SimResult, ph: PhaseTruth) -> list[str]:
    """The causes present in one phase, from what the model did in it (the engine's semantics:
    SGLang's K bounds each micro-batch, its pool and vLLM's max_num_seqs the engine)."""
    p = result.params
    causes: list[str] = []
    stages = ph["stages"]
    busy = np.array([s["busy_fraction"] for s in stages])
    bubble = float(np.mean([s["bubble_fraction"] for s in stages]))
    k = p.micro_batch_cap
    mb_max = max((s["max_microbatch_size"] or 0) for s in stages)
    queued = (ph["queue_mean"] or 0) > 0.5
    client_bound = ph["client_inflight_mean"] < CLIENT_SHORTFALL * ph["target_concurrency"]
    kv_bound = ph["kv_admission_stalls"] > 0 and ph["token_usage_max"] >= KV_USAGE_HIGH
    held_elsewhere = client_bound or kv_bound
    pool_full = ph["running_max"] >= p.max_running_requests
    budget = prefill_budget(p)
    if queued and pool_full and not held_elsewhere:
        causes.append("admission_bound")
        if bunched_at_the_bound(p, stages):
            causes.append("pipeline_underfilled")
    elif p.engine_spec.microbatch_slots and queued and not held_elsewhere and p.input_tokens > budget:
        causes.append("prefill_budget")  # the prompts wait for turns, a chunk of one at a time
    elif p.engine_spec.microbatch_slots and queued and not pool_full and mb_max >= k and not held_elsewhere:
        causes.append("microbatch_cap")
    if client_bound:
        causes.append("client_bound")
    if kv_bound:
        causes.append("kv_cache_bound")
    if ph["pcie_hop_share"] >= PCIE_HOP_SHARE:
        causes.append("pcie_bound")
    mults = np.array([p.stage_multiplier(s) for s in range(p.pp_size)])
    if mults.max() >= IMBALANCE_RATIO * float(np.median(mults)) and \
            busy.max() - float(np.median(busy)) > BUBBLE_MATERIAL:
        causes.append("stage_imbalance")
    underfilled = (ph["microbatches_in_flight"] or 0) < UNDERFILLED_SHARE * p.pp_size and \
        bubble > BUBBLE_MATERIAL
    if bubble > BUBBLE_MATERIAL and not underfilled and not causes and \
            ph["long_prefill_share"] >= LONG_PREFILL_SHARE:
        causes.append("prefill_stall")
    if underfilled and not causes and burst_packed(p, _load(p, ph)):
        causes.append("prefill_burst")
    if underfilled and not causes:
        causes.append("pipeline_underfilled")
    # each stage logs every interval-th decode step: with a factor in common with the micro-batches
    # it cycles through, it logs only some of them (told where the pipeline is full: every slot in
    # flight, as the diagnosis can tell it)
    full = (ph["microbatches_in_flight"] or 0.0) >= p.slots - STEADY_IN_FLIGHT
    if p.decode_log_interval > 1 and p.slots >= 2 and full and math.gcd(p.decode_log_interval, p.slots) > 1:
        causes.append("log_sampling_aliased")
    return causes


def prefill_budget(p: SimParams) -> int:
    """The prompt tokens one SGLang prefill turn takes: its chunk, or max_prefill_tokens where
    smaller (which stops admission once spent)."""
    return min(p.chunked_prefill_size, p.max_prefill_tokens)


def burst_packed(p: SimParams, load: int) -> bool:
    """A burst admitted budget-at-a-time lands in fewer micro-batches than slots: the budget,
    not a larger K, sets the micro-batch size (budget // prompt <= K) and packs the load into
    ceil(load / per turn) < slots micro-batches while there are requests enough for every slot."""
    per_turn = prefill_budget(p) // p.input_tokens
    return p.engine_spec.microbatch_slots and p.pp_size >= 2 and 1 <= per_turn <= p.micro_batch_cap and \
        per_turn < load and load >= p.slots and -(-load // per_turn) < p.slots


def bunched_at_the_bound(p: SimParams, stages: list[StageTruth]) -> bool:
    """SGLang at its pool with the running requests far from an even split over the slots (the
    diagnosis's bunched rule, on the true micro-batch sizes)."""
    fair = max(-(-p.max_running_requests // p.slots), 1)
    sizes_max = max((s["max_microbatch_size"] or 0) for s in stages)
    sizes_p10 = min((s["p10_microbatch_size"] or 0) for s in stages)
    return p.engine_spec.microbatch_slots and p.pp_size >= 2 and p.micro_batch_cap > fair and \
        (sizes_max - sizes_p10 >= fair or sizes_max >= 2 * fair)


def underfill_reason(p: SimParams, load: int) -> str:
    """Why a pipeline holds fewer micro-batches than stages: "bunched" when a smaller K would
    spread the load over every slot, else "light_load" (fewer requests than stages)."""
    spreads = p.engine_spec.microbatch_slots and load >= p.pp_size and spread_cap(p, load) < p.micro_batch_cap
    return "bunched" if spreads else "light_load"


def fix_for(p: SimParams, cause: str, ph: PhaseTruth) -> Fix | None:
    """The change that removes ``cause`` in phase ``ph``: the engine setting (flag and value) and
    the simulator parameters that make it; None where no setting of the engine removes it."""
    load = _load(p, ph)
    flag = p.engine_spec.flag_for  # the engine's flag for a setting
    flag_pool = flag("max_running_requests")
    if cause == "admission_bound":
        return {"knob": flag_pool, "value": load, "params": {"max_running_requests": load}}
    if cause == "pipeline_underfilled" and "admission_bound" in ph["causes"]:
        want = max(-(-p.max_running_requests // p.slots), 1)  # spread what the pool holds
        return {"knob": flag("pp_max_micro_batch_size"), "value": want,
                "params": {"pp_max_micro_batch_size": want}}
    bunched = cause == "pipeline_underfilled" and underfill_reason(p, load) == "bunched"
    if cause == "microbatch_cap" or bunched:
        want = spread_cap(p, load)  # K that spreads the load over every slot
        return {"knob": flag("pp_max_micro_batch_size"), "value": want,
                "params": {"pp_max_micro_batch_size": want}}
    if cause == "prefill_budget":  # a turn takes whole prompts: a power of two at least one
        longest = round(p.input_tokens * (1 + p.input_tokens_jitter))
        want = 1 << max(math.ceil(math.log2(max(2 * prefill_budget(p), longest))), 0)
        want = min(want, max(p.context_len, prefill_budget(p)))
        return {"knob": flag("chunked_prefill_size"), "value": want,
                "params": {"chunked_prefill_size": want,
                           "max_prefill_tokens": max(want, p.max_prefill_tokens)}}
    if cause == "prefill_stall":  # chunks that take turns with the other micro-batches' decodes
        want = interleaving_chunk(prefill_budget(p), p.slots)
        return {"knob": flag("chunked_prefill_size"), "value": want, "params": {"chunked_prefill_size": want}}
    if cause == "prefill_burst":  # a turn admits ceil(load / slots) prompts: every slot filled
        spread = spread_cap(p, load)
        want = round((spread - 0.5) * p.input_tokens)
        return {"knob": flag("max_prefill_tokens"), "value": want, "params": {"max_prefill_tokens": want}}
    if cause == "stage_imbalance":
        mean = float(np.mean([p.stage_multiplier(s) for s in range(p.pp_size)]))
        return {"knob": flag("layer_partition"), "value": None,
                "params": {"stage_cost_multipliers": (round(mean, 6),) * p.pp_size}}
    if cause == "client_bound":
        return {"knob": "client", "value": ph["target_concurrency"], "params": {"client_max_inflight": None}}
    if cause == "kv_cache_bound":
        per_request = round(p.input_tokens * (1 + p.input_tokens_jitter)) + p.max_tokens
        want = load * per_request
        return {"knob": flag("max_total_num_tokens"), "value": want, "params": {"max_total_num_tokens": want}}
    if cause == "pcie_bound":
        return {"knob": "link", "value": None,
                "params": {"pcie_bandwidth_bytes_per_s": 25e9, "pcie_latency_s": 0.00002}}
    if cause == "log_sampling_aliased":
        return {"knob": flag("decode_log_interval"), "value": 1, "params": {"decode_log_interval": 1}}
    return None


def scenario_ground_truth(result: SimResult) -> GroundTruth:
    """The ground truth of a run, with the causes its scenario preset puts in (none for custom runs)."""
    return ground_truth(result, SCENARIOS[result.scenario].causes if result.scenario in SCENARIOS else ())


@dataclasses.dataclass(frozen=True, slots=True)
class _Plan:
    """One fix and the causes and phases it is run for."""

    fix: Fix
    causes: set[str] = dataclasses.field(default_factory=set)
    phases: list[str] = dataclasses.field(default_factory=list)


def scenario_fixes(result: SimResult) -> list[FixResult]:
    """For each cause the ground truth names (per phase), its fix run in the simulator with the
    same seed: the phase's throughput with the change and whether the cause is gone."""
    p = result.params
    truth = result.ground_truth
    plans: dict[str, _Plan] = {}
    for ph in truth["phases"]:
        for cause in ph["causes"]:
            fix = fix_for(p, cause, ph)
            if fix is None:
                continue
            key = repr(sorted(fix["params"].items()))
            plan = plans.setdefault(key, _Plan(fix))
            plan.causes.add(cause)
            plan.phases.append(ph["label"])
    out = []
    for plan in plans.values():
        fixed = simulate(p.replaced(plan.fix["params"]), result.scenario, log=False)
        before = {ph["label"]: ph for ph in truth["phases"]}
        after = {ph["label"]: ph for ph in scenario_ground_truth(fixed)["phases"]}
        out.append(FixResult(
            causes=sorted(plan.causes), knob=plan.fix["knob"], value=plan.fix["value"],
            params=dict(plan.fix["params"]),
            phases={label: FixOutcome(throughput_tok_s=before[label]["throughput_tok_s"],
                                      fixed_throughput_tok_s=after[label]["throughput_tok_s"],
                                      causes_after=after[label]["causes"])
                    for label in plan.phases},
        ))
    return out
