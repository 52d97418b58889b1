"""Findings: per phase, which cause keeps the stages idle (or the measurement unreliable), with the
numbers that show it, how sure, and what to change. A healthy phase yields no finding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import NotRequired, TypeAlias, TypedDict

import numpy as np

from gputrace.analysis.phase_figures import PhaseMetrics, StageMetrics, throughput_aliased
from gputrace.engines import engine_words
from gputrace.engines.knobs import interleaving_chunk
from gputrace.json_types import JsonObject
from gputrace.vocabulary import Cause, Change, EngineSettings

CAUSES = tuple(c.value for c in Cause)



@dataclass(frozen=True)
class Thresholds:
    """The decision thresholds, in one place so the report can print them."""

    bubble_material: float = 0.08  # mean bubble share worth a finding
    cap_tolerance: float = 0.5  # micro-batch max within this of K counts as "at K"
    underfilled_allowed_max: float = 0.9  # schedule allows less than this busy share
    imbalance_gap: float = 0.08  # busiest stage minus median stage busy share
    imbalance_ratio: float = 1.15
    client_shortfall: float = 0.85  # in flight below this share of the target
    # the engine's running total within max(1.5, this share) of its admission limit is "at" it: the
    # total is offered minus queued, and a queue sampled once a second catches requests mid-turnover
    limit_tolerance: float = 0.2
    kv_usage: float = 0.9
    pcie_transfer_per_busy: float = 0.4  # hand-off time at link speed per unit of kernel time
    throttled_share: float = 0.1
    # utilization.gpu this far above SM activity counts kernels that only wait (NCCL's spinning
    # receive on a PP rank waiting for its input): the report warns and uses SM activity
    utilization_spin_gap: float = 0.2
    # micro-batches in flight within this of the slot count: the pipeline is full, each rank cycles
    # through every slot, and a log interval sharing a factor with them keeps logging the same few
    steady_in_flight: float = 0.1


def changes_the_deployment(flag: object) -> bool:
    """Whether a finding's change (its flag, as findings.json names it) is a setting of the
    deployment (an engine flag, an environment variable, the hardware) rather than the load: a
    sweep's light levels are chosen, so a report leads with the first finding a deployment change
    answers (`gputrace demo` applies it too)."""
    return isinstance(flag, str) and Change.of_flag(flag).changes_the_deployment


Figure: TypeAlias = float | None  # a measured figure, rounded for findings.json (None: not measured)


class AdmissionEvidence(TypedDict):
    engine: str
    admission_limit: int
    limit_flag: str
    offered_load: Figure
    engine_running_estimate: Figure
    queue_req_mean: Figure
    token_usage_max: Figure
    token_usage_projected: Figure
    limit_is_lower_bound: bool  # without the client's own level, the load seen only bounds it


class ClientEvidence(TypedDict):
    target_concurrency: int
    inflight_mean: Figure
    mean_bubble_fraction: Figure


class MicrobatchCapEvidence(TypedDict):
    K: int
    K_from: str
    max_running_requests: int | None
    pp_size: int
    microbatch_slots: int
    microbatch_size_max: Figure
    microbatch_size_mean: Figure
    offered_load: Figure
    queue_req_mean: Figure
    engine_running_estimate: Figure
    microbatches_in_flight: Figure
    allowed_busy_fraction: Figure
    mean_busy_fraction: Figure
    mean_bubble_fraction: Figure


class ImbalanceEvidence(TypedDict):
    busy_fraction_by_stage: list[Figure]
    median_busy_fraction: Figure
    busiest_stage: int
    busiest_busy_fraction: Figure


class KvCacheEvidence(TypedDict):
    token_usage_max: Figure
    token_usage_mean: Figure
    queue_req_mean: Figure
    queue_req_max: Figure
    kv_capacity_tokens: int | None
    kv_tokens_wanted: int | None


class PcieEvidence(TypedDict):
    pcie_transfer_per_busy_by_stage: list[Figure]
    pcie_link_share_mean_by_stage: list[Figure]
    pcie_link_share_p95_max: Figure


class ThrottlingEvidence(TypedDict):
    throttled_fraction_by_stage: list[Figure]
    power_limit_share_p95_by_stage: list[Figure]
    sm_clock_mhz_by_stage: list[Figure]


class UnderfilledEvidence(TypedDict):
    microbatches_in_flight: Figure
    pp_size: int
    allowed_busy_fraction: Figure
    mean_busy_fraction: Figure
    mean_bubble_fraction: Figure
    offered_load: Figure
    K: int | None
    reason: str  # "bunched" | "light_load"
    bubble_is_the_bottleneck: NotRequired[bool]  # light load: False, fewer requests than stages


class BunchedEvidence(TypedDict):
    reason: str  # "bunched"
    K: int
    K_from: str
    engine_running: Figure
    microbatch_slots: int
    microbatch_size_max: Figure
    microbatch_size_p10: Figure
    even_split: int
    microbatches_in_flight: Figure


class PrefillBudgetEvidence(TypedDict):
    prefill_budget_tokens: int
    full_turn_share: Figure
    prefill_tokens_per_turn_mean: Figure
    prefill_turns_per_s: Figure
    prompt_tokens_mean: Figure
    queue_req_mean: Figure
    engine_running_estimate: Figure
    max_running_requests: int | None
    mean_bubble_fraction: Figure
    token_usage_max: Figure  # vLLM: the KV cache's use, which had room (None on SGLang's turn lines)


class PrefillBurstEvidence(TypedDict):
    prefill_budget_tokens: int
    prefill_tokens_per_turn_mean: Figure
    full_turn_share: Figure
    prompt_tokens_mean: Figure
    prompts_per_turn: int
    K: int
    K_from: str
    offered_load: Figure
    microbatches_packed: int
    microbatches_in_flight: Figure
    microbatch_size_max: Figure
    microbatch_slots: int
    pp_size: int
    mean_bubble_fraction: Figure


class PrefillStallEvidence(TypedDict):
    prefill_budget_tokens: int
    full_turn_share: Figure
    prefill_tokens_per_turn_mean: Figure
    prompt_tokens_mean: Figure
    engine_running_estimate: Figure
    chunk_tokens_per_decode_round: Figure
    microbatches_in_flight: Figure
    microbatch_slots: int
    allowed_busy_fraction: Figure
    mean_bubble_fraction: Figure


class AliasedPhase(TypedDict):
    """One phase whose log hides micro-batches: those in flight, the interval's common factor
    with them, those each stage logs, and what shows it below a full pipeline."""

    microbatches_in_flight: int
    common_factor: int
    microbatches_logged: int
    evidence: NotRequired[str]


class LogSamplingEvidence(TypedDict):
    decode_log_interval: int
    microbatch_slots: int
    interval_mod_slots: int
    aliased_phases: dict[str, AliasedPhase]
    phases_with_constant_running_req: list[str]


class MissingEvidence(TypedDict):
    missing: str  # "gpu_samples" | "scheduler_lines"


Evidence: TypeAlias = (AdmissionEvidence | ClientEvidence | MicrobatchCapEvidence | ImbalanceEvidence
                       | KvCacheEvidence | PcieEvidence | ThrottlingEvidence | UnderfilledEvidence
                       | BunchedEvidence | PrefillBudgetEvidence | PrefillBurstEvidence
                       | PrefillStallEvidence | LogSamplingEvidence | MissingEvidence)
"""The numbers that show a finding, by its cause (findings.json's ``evidence``)."""


class FindingDetails(TypedDict, total=False):
    caps_phases: int  # other phases of the run that offered more than this K admits


@dataclass(frozen=True)
class Finding:
    """One diagnosed cause in one phase ("*" for the whole run). Built once by the rules; what is
    computed about it later (its predicted effect, the advice) is data beside it, keyed by ``key``."""

    cause: Cause
    phase: str
    stages: list[int]
    evidence: Evidence
    confidence: float
    recommendation: str
    summary: str
    impact: float = 0.0  # share of stage-time lost to it, for ordering
    details: FindingDetails = field(default_factory=FindingDetails)
    change: Change | None = None  # the setting the recommendation changes, where it names one

    def __post_init__(self) -> None:
        object.__setattr__(self, "cause", Cause(self.cause))  # a plain string names its Cause

    def to_dict(self) -> JsonObject:
        """As findings.json's ``findings`` hold it (before the report drops what it leaves out)."""
        return asdict(self)

    @property
    def key(self) -> str:
        """The finding's identity within its run: its cause, phase and knob (the rules give at most
        one finding of a cause per phase)."""
        return f"{self.cause}@{self.phase}:{self.change.flag if self.change else ''}"


def _vals(stages: Sequence[StageMetrics], name: str) -> np.ndarray:
    return np.array([getattr(s, name) if getattr(s, name) is not None else np.nan for s in stages],
                    dtype=float)


def default_microbatch_cap(engine: EngineSettings, pp_size: int) -> tuple[int | None, str]:
    """SGLang's cap (``EngineSettings.microbatch_cap_at``) and where it came from."""
    k = engine.microbatch_cap_at(pp_size)
    if engine.pp_max_micro_batch_size:
        return k, engine.engine_spec.flag_for("pp_max_micro_batch_size")
    if k is not None:
        return k, f"max_running_requests // pp_size = {engine.admission_limit} // {pp_size}"
    return None, "unknown (no engine configuration)"


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None or not np.isfinite(x) else round(float(x), nd)


def engine_kind(engine: EngineSettings) -> str:
    """"sglang" or "vllm" from the run's engine configuration (SGLang when unknown)."""
    return engine.kind


def at_limit(running: float | None, limit: int | None, th: Thresholds) -> bool:
    """Whether an engine-wide running total is at its admission limit."""
    return running is not None and limit is not None and \
        running >= limit - max(1.5, th.limit_tolerance * limit)


def admission_bound(pm: PhaseMetrics, engine: EngineSettings, load: float | None,
                    queue_mean: float | None, engine_running: float | None,
                    th: Thresholds) -> Finding | None:
    """The engine runs as many requests as it admits (SGLang's request pool, vLLM's max_num_seqs)
    while requests wait: raise the limit to the offered load, if the KV cache holds that many."""
    limit = engine.admission_limit
    if load is None or queue_mean is None or queue_mean <= 0.5 or not at_limit(engine_running, limit, th):
        return None
    assert limit is not None
    if load <= limit + 0.5:
        return None  # offered no more than the limit admits: the queue is turnover, not a bound
    assert limit is not None and engine_running is not None
    kind = engine_kind(engine)
    # the limit to cover the offered load; without the client's level, the load's 90th percentile
    # where higher: a gauge read from the engine dips while finished requests are replaced, and on
    # vLLM at PP=2 with the cores shared most readings of a level of 16 fell at a turnover (the
    # level found in them read 9), while the readings between turnovers hold the whole level
    clients_level = bool(pm.target_concurrency) and not pm.source.startswith("detected")
    offered = load if clients_level else max(load, float(pm.target_concurrency or 0), pm.inflight_p90 or 0.0)
    want = max(int(np.ceil(offered)), limit + 1)
    usage = _vals(pm.stages, "token_usage_max")
    usage_max = float(np.nanmax(usage)) if not np.isnan(usage).all() else None
    projected = usage_max * want / max(engine_running, 1.0) if usage_max is not None else None
    kv_short = projected is not None and projected >= th.kv_usage
    flag = engine.engine_spec.flag_for("max_running_requests")  # the engine-wide admission limit's
    setting = f"{flag} {want}"
    if not clients_level:
        # the load seen never exceeds what was offered, and a gauge read at a turnover reads low
        setting += f" (at least {want}: without the client's own level, the load seen is a lower bound)"
    if kv_short:
        recommendation = (f"{flag} {want} would not fit the KV cache (token usage {usage_max:.2f} at "
                          f"{engine_running:.0f} running, about {projected:.2f} at {want}): give the cache "
                          f"more memory first ({engine.engine_spec.kv_advice}), then {setting}")
    else:
        recommendation = setting
        if usage_max is None:
            recommendation += " (KV headroom unknown: no token usage logged)"
    return Finding(
        Cause.ADMISSION_BOUND, pm.label, list(range(len(pm.stages))),
        {"engine": kind, "admission_limit": limit, "limit_flag": flag, "offered_load": _r(load, 1),
         "engine_running_estimate": _r(engine_running, 1), "queue_req_mean": _r(queue_mean, 2),
         "token_usage_max": _r(usage_max), "token_usage_projected": _r(projected),
         "limit_is_lower_bound": not clients_level},
        0.9, recommendation,
        f"the engine runs {engine_running:.0f} requests, its limit ({flag.lstrip('-').replace('-', '_')} "
        f"= {limit}), while {load:.0f} are offered and {queue_mean:.0f} wait",
        impact=1.5, change=Change.of_flag(flag, want))


@dataclass(frozen=True)
class PhaseContext:
    """What every rule reads about one phase, derived once."""

    pm: PhaseMetrics
    engine: EngineSettings
    pp_size: int
    th: Thresholds
    busy: np.ndarray
    mean_bubble: float
    mean_busy: float | None
    load: float | None  # requests offered: the client's in flight, else its target
    queue_mean: float | None  # the engine's waiting queue (the busiest stage's view)
    engine_running: float | None  # offered minus queued: the engine's running total
    pool_full: bool  # the running total at the engine's admission limit

    @property
    def stages(self) -> list[int]:
        return list(range(self.pp_size))

    @property
    def slots(self) -> int:
        return self.engine.slots_at(self.pp_size)

    @property
    def k_flag(self) -> str:
        """The flag of the micro-batch cap K, in the run's engine's words."""
        return self.engine.engine_spec.flag_for("pp_max_micro_batch_size")

    def spread_cap(self) -> int | None:
        """The K that spreads the load over every slot: ceil(load / slots), the load being the
        client's level where known (its in-flight mean runs a little over it at turnover)."""
        load = self.pm.target_concurrency or self.load
        return None if load is None else max(int(np.ceil(round(load, 1) / self.slots)), 1)


def phase_context(pm: PhaseMetrics, engine: EngineSettings, pp_size: int, th: Thresholds) -> PhaseContext:
    st = pm.stages
    busy = _vals(st, "busy_fraction")
    bubble = _vals(st, "bubble_fraction")
    queue = _vals(st, "queue_req_mean")
    load = pm.inflight_mean if pm.inflight_mean is not None else pm.target_concurrency
    queue_mean = float(np.nanmax(queue)) if not np.isnan(queue).all() else None
    # offered - queued estimates the engine's running total; a queue sampled once a second (log
    # interval, Prometheus scrape) catches requests mid-turnover, hence at_limit's band
    mrr = engine.admission_limit
    if queue_mean is not None and load is not None and mrr is not None and load > mrr + 0.5:
        # the engine runs at most its limit, so of the requests in flight at least load - limit
        # wait: a queue read lower than that caught the engine mid-turnover (vLLM's gauges and its
        # stats line flip between 0 and the limit at PP=2 on a CPU), not a shorter queue
        queue_mean = max(queue_mean, load - mrr)
    engine_running = (load - queue_mean) if load is not None and queue_mean is not None else None
    if engine_running is not None and mrr is not None:
        # the engine admits at most its limit: a queue gauge that flips between 0 and the limit at
        # each batch turnover (vLLM at PP=2 on a CPU) reads low on average, never the running high
        engine_running = min(engine_running, float(mrr))
    return PhaseContext(
        pm=pm, engine=engine, pp_size=pp_size, th=th, busy=busy,
        mean_bubble=float(np.nanmean(bubble)) if not np.isnan(bubble).all() else 0.0,
        mean_busy=float(np.nanmean(busy)) if not np.isnan(busy).all() else None,
        load=load, queue_mean=queue_mean, engine_running=engine_running,
        pool_full=at_limit(engine_running, engine.admission_limit, th))


def rule_client_bound(c: PhaseContext) -> Finding | None:
    """The generator cannot keep the level it was asked for. A level detected from the in-flight
    gauge itself says nothing of what was asked: its shortfall from that gauge is no evidence."""
    pm, th = c.pm, c.th
    if pm.source.startswith("detected"):
        return None
    if not (pm.target_concurrency and pm.inflight_mean is not None and
            pm.inflight_mean < th.client_shortfall * pm.target_concurrency):
        return None
    short = 1 - pm.inflight_mean / pm.target_concurrency
    return Finding(
        Cause.CLIENT_BOUND, pm.label, c.stages,
        {"target_concurrency": pm.target_concurrency, "inflight_mean": _r(pm.inflight_mean, 2),
         "mean_bubble_fraction": _r(c.mean_bubble)},
        min(0.95, 0.5 + short), "the load generator keeps fewer requests in flight than asked: "
        "give it more workers/connections or remove its think time before reading the bubbles",
        f"client kept {pm.inflight_mean:.1f} of {pm.target_concurrency} requests in flight",
        impact=c.mean_bubble * short + 0.5, change=Change.of_flag("client", pm.target_concurrency))


def rule_admission_bound(c: PhaseContext) -> Finding | None:
    """The engine runs at its admission limit while requests wait: raise it to the offered load,
    within the KV cache's headroom."""
    return admission_bound(c.pm, c.engine, c.load, c.queue_mean, c.engine_running, c.th)


def rule_microbatch_cap(c: PhaseContext) -> Finding | None:
    """K binds while the request pool has free rows: every micro-batch at K, requests waiting.
    At the pool's limit raising K admits nothing (SGLang's get_num_allocatable_reqs takes the
    smaller of the two), so the pool rule speaks there instead."""
    pm, th = c.pm, c.th
    k, k_from = default_microbatch_cap(c.engine, c.pp_size)
    if not c.engine.engine_spec.microbatch_slots or not k or c.load is None or c.pool_full:
        return None
    mb_max = _vals(pm.stages, "microbatch_size_max")
    at_k = np.abs(mb_max - k) <= th.cap_tolerance
    plateau = at_k.sum() >= max(1, len(pm.stages) // 2) or (
        c.engine_running is not None and abs(c.engine_running - k) <= max(1.5, 0.2 * k))
    waiting = c.queue_mean > 0.5 if c.queue_mean is not None else (
        c.load > k + 0.5 and c.mean_bubble > th.bubble_material)
    # K binds only once every slot holds K (a slot with room admits at its turn): the engine runs
    # K x slots; fewer running with a queue is requests between turns, not the cap
    every_slot_at_k = c.engine_running is None or \
        c.engine_running >= k * c.slots - max(1.5, th.limit_tolerance * k * c.slots)
    if not (plateau and waiting and every_slot_at_k):
        return None
    mrr = c.engine.admission_limit
    want = max(c.spread_cap() or k + 1, k + 1)
    return Finding(
        Cause.MICROBATCH_CAP, pm.label, [int(i) for i in np.flatnonzero(at_k)] or c.stages,
        {"K": k, "K_from": k_from, "max_running_requests": mrr, "pp_size": c.pp_size,
         "microbatch_slots": c.slots, "microbatch_size_max": _r(float(np.nanmax(mb_max)), 1),
         "microbatch_size_mean": _r(float(np.nanmean(_vals(pm.stages, "microbatch_size_mean"))), 2),
         "offered_load": _r(c.load, 1), "queue_req_mean": _r(c.queue_mean, 2),
         "engine_running_estimate": _r(c.engine_running, 1),
         "microbatches_in_flight": _r(pm.microbatches_in_flight, 2),
         "allowed_busy_fraction": _r(pm.allowed_busy_fraction),
         "mean_busy_fraction": _r(c.mean_busy), "mean_bubble_fraction": _r(c.mean_bubble)},
        0.9 if c.engine.max_running_requests or c.engine.pp_max_micro_batch_size else 0.6,
        f"{c.k_flag} {want} (ceil({c.load:.0f} offered / {c.slots} micro-batch slots))",
        f"every micro-batch holds K = {k} ({k_from}): the engine runs about "
        f"{c.engine_running or k * c.slots:.0f} of its {mrr or '?'} pool rows while {c.load:.0f} requests "
        f"are offered and {c.queue_mean or 0:.0f} wait in the queue",
        impact=c.mean_bubble + 1.0, change=Change.of_flag(c.k_flag, want))


def rule_stage_imbalance(c: PhaseContext) -> Finding | None:
    """One stage is the bottleneck, the others wait for it."""
    busy, th = c.busy, c.th
    if np.sum(~np.isnan(busy)) < 2:
        return None
    med = float(np.nanmedian(busy))
    top = int(np.nanargmax(busy))
    if not (busy[top] - med > th.imbalance_gap and busy[top] > th.imbalance_ratio * med):
        return None
    slow = [int(i) for i in np.flatnonzero(busy - med > th.imbalance_gap)]
    split = c.engine.engine_spec.flag_for("layer_partition")
    return Finding(
        Cause.STAGE_IMBALANCE, c.pm.label, slow,
        {"busy_fraction_by_stage": [_r(b) for b in busy], "median_busy_fraction": _r(med),
         "busiest_stage": top, "busiest_busy_fraction": _r(float(busy[top]))},
        min(0.95, 0.5 + (busy[top] - med)),
        f"rebalance the layer split ({split}) to move layers off stage " + ", ".join(map(str, slow)),
        f"stage {top} is busy {busy[top]:.0%} against a median of {med:.0%}",
        impact=float(busy[top] - med) + 0.3, change=Change.of_flag(split, None))


def rule_kv_cache_bound(c: PhaseContext) -> Finding | None:
    """Admission stalls on token usage (not a bubble of the pipeline)."""
    st, th = c.pm.stages, c.th
    usage = _vals(st, "token_usage_max")
    q_max = _vals(st, "queue_req_max")
    if np.isnan(usage).all() or np.nanmax(usage) < th.kv_usage or np.nanmax(np.nan_to_num(q_max)) <= 0:
        return None
    pool = c.engine.engine_spec.knob_named("max_total_num_tokens")
    in_tokens = pool is not None and pool.value_flag is None  # its flag takes the pool in tokens
    usage_max = float(np.nanmax(usage))
    capacity = c.engine.max_total_num_tokens
    want = None
    if capacity and c.load and c.engine_running:
        # the tokens the running requests hold, scaled to the offered load
        want = int(np.ceil(int(capacity) * usage_max * c.load / max(c.engine_running, 1.0)))
    flag = c.engine.engine_spec.flag_for("max_total_num_tokens")
    size = f" (about {want} tokens for {c.load:.0f} requests)" if want and in_tokens else ""
    return Finding(
        Cause.KV_CACHE_BOUND, c.pm.label, c.stages,
        {"token_usage_max": _r(usage_max),
         "token_usage_mean": _r(float(np.nanmean(_vals(st, "token_usage_mean")))),
         "queue_req_mean": _r(c.queue_mean, 2), "queue_req_max": _r(float(np.nanmax(q_max)), 0),
         "kv_capacity_tokens": capacity, "kv_tokens_wanted": want},
        0.8, f"more KV cache ({c.engine.engine_spec.kv_advice}){size} or shorter contexts; requests wait "
             "for cache, not for the pipeline",
        f"token usage reaches {usage_max:.2f} while requests queue", impact=c.mean_bubble + 0.3,
        change=Change.of_flag(flag, want if in_tokens else None))


def rule_pcie_bound(c: PhaseContext) -> Finding | None:
    """Moving activations takes as long as a good share of the compute."""
    st, th = c.pm.stages, c.th
    hop = _vals(st, "pcie_transfer_per_busy")
    if np.isnan(hop).all() or np.nanmax(hop) < th.pcie_transfer_per_busy:
        return None
    hot = [int(i) for i in np.flatnonzero(hop >= th.pcie_transfer_per_busy)]
    return Finding(
        Cause.PCIE_BOUND, c.pm.label, hot,
        {"pcie_transfer_per_busy_by_stage": [_r(p) for p in hop],
         "pcie_link_share_mean_by_stage": [_r(p) for p in _vals(st, "pcie_link_share_mean")],
         "pcie_link_share_p95_max": _r(float(np.nanmax(_vals(st, "pcie_link_share_p95"))))},
        0.75, "the stage hand-offs saturate PCIe: use NVLink-connected GPUs for adjacent stages, "
              "fewer stages, or more TP within a node",
        f"hand-offs need {np.nanmax(hop):.0%} of the compute time at full PCIe link speed",
        impact=c.mean_bubble + 0.3, change=Change.of_flag("link", None))


def rule_throttling(c: PhaseContext) -> Finding | None:
    """Clock-event reasons say power or thermal slowdown."""
    st, th = c.pm.stages, c.th
    thr = _vals(st, "throttled_fraction")
    if np.isnan(thr).all() or np.nanmax(thr) < th.throttled_share:
        return None
    hot = [int(i) for i in np.flatnonzero(thr >= th.throttled_share)]
    return Finding(
        Cause.THROTTLING, c.pm.label, hot,
        {"throttled_fraction_by_stage": [_r(t) for t in thr],
         "power_limit_share_p95_by_stage": [_r(p) for p in _vals(st, "power_limit_share_p95")],
         "sm_clock_mhz_by_stage": [_r(hz / 1e6, 0) for hz in _vals(st, "sm_clock_hz_mean")]},
        0.8, "the GPUs slow down for power or temperature: check cooling and power limits "
             "(nvidia-smi -q -d PERFORMANCE)",
        f"clocks throttled {np.nanmax(thr):.0%} of the phase", impact=float(np.nanmax(thr)) * 0.5,
        change=Change.of_flag("cooling/power", None))


def rule_pipeline_underfilled(c: PhaseContext) -> Finding | None:
    """Fewer micro-batches in flight than stages, when nothing else explains the bubble. A
    pipeline whose slots are all filled keeps some bubble (hand-offs, uneven steps): that is its
    cost, not a cause. The knob depends on why: a K that lets the load bunch into few
    micro-batches (SGLang), or too little load for the depth."""
    pm, th = c.pm, c.th
    allowed = pm.allowed_busy_fraction
    if c.mean_bubble <= th.bubble_material or allowed is None or allowed >= th.underfilled_allowed_max:
        return None
    k, _ = default_microbatch_cap(c.engine, c.pp_size)
    spread = c.spread_cap()
    bunched = c.engine.engine_spec.microbatch_slots and k is not None and spread is not None and \
        c.load is not None and c.load >= c.pp_size - 0.5 and spread < k
    evidence: UnderfilledEvidence = {
        "microbatches_in_flight": _r(pm.microbatches_in_flight, 2), "pp_size": c.pp_size,
        "allowed_busy_fraction": _r(allowed), "mean_busy_fraction": _r(c.mean_busy),
        "mean_bubble_fraction": _r(c.mean_bubble), "offered_load": _r(c.load, 1),
        "K": k, "reason": "bunched" if bunched else "light_load"}
    in_flight = f"{pm.microbatches_in_flight or 0:.1f} micro-batches in flight for {c.pp_size} stages"
    if bunched:
        assert spread is not None and c.load is not None
        return Finding(
            Cause.PIPELINE_UNDERFILLED, pm.label, c.stages, evidence, 0.7,
            f"{c.k_flag} {spread} (ceil({c.load:.0f} offered / {c.slots} slots)) "
            f"spreads the load over every stage; K = {k} lets requests that arrive together share "
            "few micro-batches",
            f"{in_flight}: {c.load:.0f} requests bunched in micro-batches of up to K = {k}; the "
            f"schedule allows {allowed:.0%} busy",
            impact=c.mean_bubble, change=Change.of_flag(c.k_flag, spread))
    # fewer requests than stages: no setting fills the pipeline at this load (a request is in one
    # stage at a time), so the bubble is what the depth costs, not what holds throughput back
    light = c.load is not None and c.load < c.pp_size - 0.5
    evidence["bubble_is_the_bottleneck"] = not light
    verdict = (f"; the bubble is not the bottleneck at this load: {c.load or 0:.0f} requests keep at "
               f"most {c.load or 0:.0f} of {c.pp_size} stages busy whatever the settings") if light else ""
    return Finding(
        Cause.PIPELINE_UNDERFILLED, pm.label, c.stages, evidence, 0.7,
        f"offer at least {c.pp_size} requests (one micro-batch per stage), or use fewer pipeline "
        "stages (more TP) for this load: with fewer requests than stages the idle stages are the "
        "price of the depth, not a setting",
        f"{in_flight} at a load of {c.load or 0:.0f}: the schedule allows {allowed:.0%} busy" + verdict,
        impact=c.mean_bubble, change=Change.of_flag("concurrency", c.pp_size))


def bunched(sizes_max: float, sizes_p10: float, fair: int) -> bool:
    """Micro-batch sizes far from an even split of ``fair`` each: one slot holds most (7 and 1, or
    8 and none, for a fair 4)."""
    return sizes_max - sizes_p10 >= fair or sizes_max >= 2 * fair


def rule_bunched_at_the_bound(c: PhaseContext) -> Finding | None:
    """At the admission bound, the running requests share few micro-batches: a K above an even
    split lets requests that arrive together bunch (SGLang: a freed row returns to the slot it
    left). K = ceil(running / slots) spreads them; this is separate from raising the pool."""
    pm = c.pm
    k, k_from = default_microbatch_cap(c.engine, c.pp_size)
    if not c.engine.engine_spec.microbatch_slots or not k or not c.pool_full or c.engine_running is None \
            or c.queue_mean is None or c.queue_mean <= 0.5 or c.pp_size < 2:
        return None
    # at the bound the engine runs its limit (offered - queued only estimates it)
    limit = c.engine.admission_limit
    running = float(limit) if limit else c.engine_running
    fair = max(int(np.ceil(round(running, 1) / c.slots)), 1)
    sizes_max = float(np.nanmax(_vals(pm.stages, "microbatch_size_max")))
    sizes_p10 = float(np.nanmin(_vals(pm.stages, "microbatch_size_p10")))
    if np.isnan(sizes_max) or np.isnan(sizes_p10) or k <= fair or not bunched(sizes_max, sizes_p10, fair):
        return None
    measured = c.mean_busy is not None
    caveat = "" if measured else (
        "; this run has no busy figure (no GPU samples), so whether the spread steps raise throughput "
        "is not measured here (on a CPU, where a rank's forward blocks its loop, larger steps can win)")
    return Finding(
        Cause.PIPELINE_UNDERFILLED, pm.label, c.stages,
        {"reason": "bunched", "K": k, "K_from": k_from, "engine_running": _r(running, 1),
         "microbatch_slots": c.slots, "microbatch_size_max": _r(sizes_max, 1),
         "microbatch_size_p10": _r(sizes_p10, 1), "even_split": fair,
         "microbatches_in_flight": _r(pm.microbatches_in_flight, 2)},
        0.7 if measured else 0.5,
        f"{c.k_flag} {fair} (ceil({running:.0f} running / {c.slots} slots)) "
        f"spreads the running requests over every stage; K = {k} lets them bunch" + caveat,
        f"the {running:.0f} running requests share micro-batches of {sizes_max:.0f} down to "
        f"{sizes_p10:.0f} (K = {k}, {k_from}) where an even split over {c.slots} slots is {fair} each: "
        "the stages wait on the smaller ones",
        impact=c.mean_bubble + 0.2, change=Change.of_flag(c.k_flag, fair))


PREFILL_FULL_SHARE = 0.5  # of a phase's prefill turns at their budget: the budget binds


def rule_prefill_budget(c: PhaseContext) -> Finding | None:
    """Requests wait while every prefill turn fills its token budget and the pool has free rows:
    the prefill budget admits the prompts a chunk at a time, so they wait for turns, not for rows.
    (The budget: SGLang's chunked_prefill_size / max_prefill_tokens, vLLM's max_num_batched_tokens;
    the report's rule table shows the first sentence with the run's own flag.) The change: a
    budget that takes a whole prompt per turn at least, twice the run's, up to the context length.
    SGLang's prefill lines show each turn full. vLLM logs no step's tokens, but its scheduler
    (v1/core/sched/scheduler.py) admits a waiting request in every step that has budget, a row
    (max_num_seqs) and KV blocks left: requests that wait while rows and the KV cache have room wait
    for the budget, which each step spent."""
    pf = c.pm.prefill
    if pf is None or pf.budget_tokens is None or c.pool_full:
        return None
    prompt = pf.prompt_tokens_mean or 0.0
    usage = _vals(c.pm.stages, "token_usage_max")
    kv_room = not np.isnan(usage).all() and float(np.nanmax(usage)) < c.th.kv_usage
    if pf.full_turn_share is not None:
        bound = pf.full_turn_share >= PREFILL_FULL_SHARE
    else:
        bound = pf.steps_with_output_only and kv_room
    # too small for the prompts: a prompt takes more than one turn, and the turns are full
    if not (c.queue_mean is not None and c.queue_mean > 0.5 and bound and prompt > pf.budget_tokens):
        return None
    want = 1 << max(math.ceil(math.log2(max(2 * pf.budget_tokens, prompt, 1))), 0)
    fields = c.engine.fields or {}
    context = fields.get("context_len") or fields.get("context_length") or fields.get("max_model_len")
    if isinstance(context, int | float) and context > pf.budget_tokens:
        want = min(want, int(context))
    words = c.engine.engine_spec
    flag, turn = words.flag_for("chunked_prefill_size"), words.flag("max_prefill_tokens")
    running = f"about {c.engine_running or 0:.0f} of {c.engine.admission_limit or '?'} running"
    if pf.full_turn_share is not None:
        said = (f"{pf.full_turn_share:.0%} of the prefill turns fill the {pf.budget_tokens}-token budget "
                f"while {c.queue_mean:.1f} requests wait and the pool has free rows ({running})")
        unit = "turn"
    else:  # vLLM's words: its scheduler admits a waiting request in any step with budget left
        said = (f"{c.queue_mean:.1f} requests wait while {words.setting('max_running_requests')} leaves "
                f"room ({running}) and the KV cache has room (at most {float(np.nanmax(usage)):.0%} used): "
                f"each step spent its {words.setting('chunked_prefill_size')} = {pf.budget_tokens} tokens")
        unit = "step"
    return Finding(
        Cause.PREFILL_BUDGET, c.pm.label, c.stages,
        {"prefill_budget_tokens": pf.budget_tokens, "full_turn_share": _r(pf.full_turn_share, 2),
         "prefill_tokens_per_turn_mean": _r(pf.tokens_per_turn_mean, 1),
         "prefill_turns_per_s": _r(pf.turns_per_s, 2), "prompt_tokens_mean": _r(pf.prompt_tokens_mean, 0),
         "queue_req_mean": _r(c.queue_mean, 2), "engine_running_estimate": _r(c.engine_running, 1),
         "max_running_requests": c.engine.admission_limit, "mean_bubble_fraction": _r(c.mean_bubble),
         "token_usage_max": _r(float(np.nanmax(usage))) if kv_room else None},
        0.8, f"{flag} {want} (a {unit} takes whole prompts: they average {prompt:.0f} tokens)"
        + (f" with {turn} at least as large" if turn and turn != flag else ""),
        f"{said}: prompts of {prompt:.0f} tokens enter a chunk at a time",
        impact=c.mean_bubble + 0.9, change=Change.of_flag(flag, want))


PREFILL_BURST_FILL = 0.75  # of the budget, a phase's prefill turns' mean: the budget, not K, ends them
# or of the phase's admissions, by turns the budget ended: a burst's (the demo's live C=32: 30 of 32;
# a burst whose first request lands alone: 31 of 32), not a closed loop's, whose replacements
# trickle in one or two a turn (bunched and bunched-at-pool: 32 of 66, their first turn)
BURST_FULL_TURNS_SHARE = 0.75


def rule_prefill_burst(c: PhaseContext) -> Finding | None:
    """A burst admitted budget-at-a-time lands in fewer micro-batches than stages. SGLang's
    prefill turn takes waiting prompts while its token budget lasts, so a turn admits
    budget // prompt of them (the motivating deployment: 8,192 tokens, prompts of 1,024, 8 a
    turn) and each turn fills one slot's micro-batch; 32 requests then run as 4 micro-batches for
    8 stages whatever K allows above 8. The change: a budget of about ceil(load / slots) prompts
    (--max-prefill-tokens stops admission once spent and cuts no prompt), or K = ceil(load / slots);
    more slots (--pp-async-batch-depth) only add empty ones."""
    pm, pf = c.pm, c.pm.prefill
    k, k_from = default_microbatch_cap(c.engine, c.pp_size)
    load = pm.target_concurrency or c.load
    words = c.engine.engine_spec
    if not words.microbatch_slots or c.pp_size < 2 or pf is None or not pf.budget_tokens \
            or not pf.seqs_per_turn_mean or not k or load is None or pm.microbatches_in_flight is None:
        return None
    # the turns' own count (#new-seq), not prompt / budget: a burst's turns are what it admitted;
    # where the turns the budget ended admitted most of the load, theirs (a burst's first arrivals
    # start a turn alone before the rest land)
    prompt, budget = pf.tokens_per_turn_mean / pf.seqs_per_turn_mean, pf.budget_tokens
    full = pf.seqs_per_full_turn
    budget_bound = full is not None and pf.seqs_in_full_turns >= BURST_FULL_TURNS_SHARE * pf.seqs_in_turns
    per_turn = round(full if budget_bound and full else pf.seqs_per_turn_mean)
    slots = c.slots
    packed = -(-round(load) // per_turn) if per_turn else 0
    if not (1 <= per_turn <= k and per_turn < load - 0.5 and load >= slots - 0.5 and packed < slots
            and pm.microbatches_in_flight < slots - 0.5 and c.mean_bubble > c.th.bubble_material
            and (budget_bound or pf.tokens_per_turn_mean >= PREFILL_BURST_FILL * budget)):
        return None
    spread = max(-(-round(load) // slots), 1)
    want = round((spread - 0.5) * prompt)  # spread prompts spend it, spread - 1 do not
    turn = words.flag_for("max_prefill_tokens")  # the turn's budget
    mb = float(np.nanmax(_vals(pm.stages, "microbatch_size_max")))
    k_words = (f"K does not bind (K = {k}, {k_from})" if per_turn < k else
               f"K = {k} ({k_from}) caps each micro-batch, not the engine, and admits as many")
    return Finding(
        Cause.PREFILL_BURST, pm.label, c.stages,
        {"prefill_budget_tokens": budget, "prefill_tokens_per_turn_mean": _r(pf.tokens_per_turn_mean, 1),
         "full_turn_share": _r(pf.full_turn_share, 2),
         "prompt_tokens_mean": _r(prompt, 0),
         "prompts_per_turn": per_turn, "K": k, "K_from": k_from, "offered_load": _r(load, 1),
         "microbatches_packed": packed, "microbatches_in_flight": _r(pm.microbatches_in_flight, 2),
         "microbatch_size_max": _r(mb, 1), "microbatch_slots": slots, "pp_size": c.pp_size,
         "mean_bubble_fraction": _r(c.mean_bubble)},
        0.8,
        f"{turn} {want} (a turn then admits {spread} prompts of about {prompt:.0f} tokens: "
        f"{load:.0f} requests over {-(-round(load) // spread)} micro-batches), or {c.k_flag} "
        f"{spread}; {words.flag_for('pp_async_batch_depth')} adds slots the budget leaves empty",
        f"`#running-req: {mb:.0f}` is one micro-batch; {k_words}: the prefill budget ({budget} tokens, "
        f"{pf.tokens_per_turn_mean:.0f} a turn) admits {per_turn} prompts per turn, so {load:.0f} requests "
        f"run as {packed} micro-batches for {c.pp_size} stages ({pm.microbatches_in_flight:.1f} in flight)",
        impact=c.mean_bubble + 0.8, change=Change.of_flag(turn, want))


PREFILL_STALL_FULL_SHARE = 0.05  # of a phase's prefill turns at the chunk: long prompts arrive in it
# the chunk's tokens against a decode round of every micro-batch (one token per running request):
# a turn this much larger holds each stage for many decode steps (the memory floor of a step is a
# few hundred tokens at most; the prefill-mixed scenario's 8,192 against 48 is 170)
PREFILL_STALL_TOKENS_PER_DECODE_ROUND = 32


def rule_prefill_stall(c: PhaseContext) -> Finding | None:
    """Long prefills stall the other micro-batches' decode: the pipeline holds all its micro-batches,
    yet the stages idle, and some prefill turns fill a chunk far larger than a decode round (a
    mixed load: long prompts among short ones). A chunk holds each stage for its whole step, and
    the decodes of the micro-batches behind it wait at every stage in turn. The change: a smaller
    chunk (SGLang's chunked_prefill_size, vLLM's max_num_batched_tokens), so a long prompt's
    chunks interleave with the others' decodes. Tried where no other cause explains the bubble."""
    pm, pf, th = c.pm, c.pm.prefill, c.th
    allowed = pm.allowed_busy_fraction
    running = c.engine_running if c.engine_running is not None else c.load
    if pf is None or not pf.budget_tokens or pf.full_turn_share is None or allowed is None \
            or running is None or running < 1 or c.mean_bubble <= th.bubble_material:
        return None
    budget = pf.budget_tokens
    ratio = budget / running
    if allowed < th.underfilled_allowed_max or pf.full_turn_share < PREFILL_STALL_FULL_SHARE \
            or ratio < PREFILL_STALL_TOKENS_PER_DECODE_ROUND:
        return None
    want = interleaving_chunk(budget, c.slots)
    if want >= budget:
        return None
    flag = c.engine.engine_spec.flag_for("chunked_prefill_size")
    return Finding(
        Cause.PREFILL_STALL, pm.label, c.stages,
        {"prefill_budget_tokens": budget, "full_turn_share": _r(pf.full_turn_share, 2),
         "prefill_tokens_per_turn_mean": _r(pf.tokens_per_turn_mean, 1),
         "prompt_tokens_mean": _r(pf.prompt_tokens_mean, 0), "engine_running_estimate": _r(running, 1),
         "chunk_tokens_per_decode_round": _r(ratio, 0),
         "microbatches_in_flight": _r(pm.microbatches_in_flight, 2), "microbatch_slots": c.slots,
         "allowed_busy_fraction": _r(allowed), "mean_bubble_fraction": _r(c.mean_bubble)},
        0.7,
        f"{flag} {want} (a long prompt then runs as chunks of {want} tokens that take turns with the "
        f"other micro-batches' decodes, rather than {budget}-token steps they wait behind)",
        f"the stages idle {c.mean_bubble:.0%} of the time with {pm.microbatches_in_flight or 0:.1f} "
        f"micro-batches in flight for {c.slots} slots: {pf.full_turn_share:.0%} of the prefill turns "
        f"compute a {budget}-token chunk, {ratio:.0f}x the {running:.0f} tokens of a decode round, and "
        "the other micro-batches' decodes wait behind it at every stage",
        impact=c.mean_bubble + 0.5, change=Change.of_flag(flag, want))


# The rules of a phase in the order they are tried; prefill_stall, then pipeline_underfilled, run
# last, only where none of them explains the bubble.
RULES = (rule_client_bound, rule_admission_bound, rule_bunched_at_the_bound, rule_microbatch_cap,
         rule_prefill_budget, rule_prefill_burst, rule_stage_imbalance, rule_kv_cache_bound, rule_pcie_bound,
         rule_throttling)


def diagnose_phase(pm: PhaseMetrics, engine: EngineSettings, pp_size: int,
                   th: Thresholds = Thresholds()) -> list[Finding]:
    """The findings of one phase."""
    ctx = phase_context(pm, engine, pp_size, th)
    out = [f for f in (rule(ctx) for rule in RULES) if f is not None]
    # Admission is the cause only when the engine got the load and nothing else held it back: a
    # short client or a full KV cache also leaves requests queued at a plateau.
    if any(f.cause in ("client_bound", "kv_cache_bound") for f in out):
        out = [f for f in out if f.cause not in ("microbatch_cap", "admission_bound", "pipeline_underfilled")]
    if not out:
        # where nothing else explains the bubble: a full pipeline's long prefills, else too few
        # micro-batches in flight
        last = rule_prefill_stall(ctx) or rule_pipeline_underfilled(ctx)
        if last is not None:
            out.append(last)
    return out


HIDDEN_TOLERANCE_REQS = 0.75  # a running mean this far from every whole number of logged sizes


def aliased_cycle(interval: int, in_flight: int) -> int:
    """The common factor of the decode log interval and the micro-batches a rank cycles through:
    above 1, each rank logs only in_flight / factor of them (every interval-th decode step)."""
    return math.gcd(interval, in_flight) if in_flight >= 2 else 1


def hidden_microbatches(p: PhaseMetrics, slots: int) -> str | None:
    """Evidence from one phase that its log hides micro-batches (the interval sharing a factor with
    the slots below a full pipeline): every stage logs one size while the running requests are no
    whole number of such micro-batches (C=6 run as 4 and 2, logged as 4s only), or the log's
    generation throughput is above the client's by more than the log's noise."""
    sizes = [st.microbatch_size_mean for st in p.stages if st.log_lines >= 3 and st.microbatch_size_mean]
    load = p.inflight_mean if p.inflight_mean is not None else p.target_concurrency
    queued = max((st.queue_req_mean or 0.0 for st in p.stages), default=0.0)
    if sizes and load and all(st.distinct_microbatch_sizes <= 1 for st in p.stages if st.log_lines >= 3):
        size, running = float(sizes[0] or 0.0), max(float(load) - queued, 0.0)
        whole = [m * size for m in range(1, slots + 1)]
        if size > 0 and min(abs(running - w) for w in whole) > HIDDEN_TOLERANCE_REQS:
            return (f"every stage logs micro-batches of {size:.0f} only while {running:.1f} requests run: "
                    f"no whole number of them")
    if throughput_aliased(p):
        return (f"the log's generation throughput {p.engine_gen_throughput_tok_s:.1f} tok/s against the "
                f"client's {p.client_throughput_tok_s:.1f} tok/s")
    return None


def diagnose_log_sampling(phases: Sequence[PhaseMetrics], engine: EngineSettings, pp_size: int,
                          th: Thresholds = Thresholds()) -> Finding | None:
    """--decode-log-interval shares a factor with the micro-batches in flight: each stage logs only
    some of them, so #running-req per stage misrepresents the micro-batches."""
    interval = engine.decode_log_interval
    if pp_size < 2 or not interval or int(interval) <= 1:
        return None
    interval = int(interval)
    slots = engine.slots_at(pp_size)
    flag = engine.engine_spec.flag_for("decode_log_interval")
    # only a full pipeline (every slot non-empty) holds its number in flight steady enough to tell
    # from the mean (a partly filled one varies, and the measured mean is not close enough)
    factor = aliased_cycle(interval, slots)
    aliased: dict[str, AliasedPhase] = {}
    for p in phases:
        mean = p.microbatches_in_flight
        if factor <= 1:
            continue
        if mean is not None and mean < slots - th.steady_in_flight:
            hidden = hidden_microbatches(p, slots)  # below a full pipeline: only on evidence
            if hidden is not None:
                aliased[p.label] = {"microbatches_in_flight": slots, "common_factor": factor,
                                    "microbatches_logged": slots // factor, "evidence": hidden}
            continue
        if (p.inflight_mean or p.target_concurrency or 0) > 1:
            aliased[p.label] = {"microbatches_in_flight": slots, "common_factor": factor,
                                "microbatches_logged": slots // factor}
    if not aliased:
        return None
    frozen = [p.label for p in phases if p.label in aliased and p.stages and all(
        s.log_lines >= 3 and s.distinct_microbatch_sizes <= 1 for s in p.stages)]
    worst = min(a["microbatches_logged"] for a in aliased.values())
    in_flight = {label: a["microbatches_in_flight"] for label, a in aliased.items()}
    return Finding(
        Cause.LOG_SAMPLING_ALIASED, "*", list(range(pp_size)),
        {"decode_log_interval": interval, "microbatch_slots": slots,
         "interval_mod_slots": interval % slots, "aliased_phases": aliased,
         "phases_with_constant_running_req": frozen},
        0.9 if frozen else 0.6,
        f"{flag} 1 (or a value coprime with {slots}) for diagnosis runs",
        f"{flag} {interval} shares a factor with the micro-batches in flight "
        f"({', '.join(f'{k}: {v}' for k, v in in_flight.items())}): each stage "
        f"logs {worst} of them every time", impact=0.05,
        change=Change.of_flag(flag, 1))


def note_k_trade_offs(found: Sequence[Finding], phases: Sequence[PhaseMetrics],
                      engine: EngineSettings, pp_size: int) -> list[Finding]:
    """A K chosen for one phase's load caps the engine at K x slots: say so where another phase of
    the run offered more (that phase would then queue behind K)."""
    slots = engine.slots_at(pp_size)
    loads = {pm.label: pm.inflight_mean if pm.inflight_mean is not None else pm.target_concurrency
             for pm in phases}
    out = []
    for f in found:
        if f.change is None or f.change.knob != "pp_max_micro_batch_size" or not f.change.value:
            out.append(f)
            continue
        bound = f.change.value * slots
        higher = [f"{label} ({load:.0f})" for label, load in loads.items()
                  if label != f.phase and load is not None and load > bound + 0.5]
        if higher:
            f = replace(f, recommendation=f.recommendation + (
                f"; at this K the engine admits at most {bound} (K x {slots} slots), "
                f"fewer than offered in {', '.join(higher)}"),
                details={**f.details, "caps_phases": len(higher)},
                impact=f.impact / (1 + 2 * len(higher)))  # a change that costs other phases ranks lower
        out.append(f)
    return out


AGENT = "run `gputrace agent` on each GPU host (or import nvidia-smi or DCGM data) with the capture"


def busy_remedy(engine: EngineSettings) -> str:
    """The source that would give a busy figure on this run's engine and hosts: the engine's own
    per-stage timers (SGLang's) where it runs on a CPU (no GPU for an agent to sample), the agent
    or the timers on GPUs, the agent alone for an engine without timers (vLLM); on such an engine on
    a CPU, nothing can."""
    words = engine.engine_spec
    timers = words.stage_timers
    if engine.runs_on_cpu:
        return timers or (f"none on this deployment: {words.name} logs no per-stage timers and a CPU "
                          "engine has no GPU to sample")
    return f"{AGENT}, or {timers}" if timers else AGENT


def cannot_tell(phases: Sequence[PhaseMetrics], pp_size: int,
                engine: EngineSettings | None = None) -> list[Finding]:
    """What the run lacks for the causes it could not look at: a cause without its data is
    "cannot tell", never read as absent. The remedy names the source that fits the run's engine
    and hosts (busy_remedy)."""
    out: list[Finding] = []
    stages = list(range(pp_size))
    if phases and all(s.busy_fraction is None for pm in phases for s in pm.stages):
        on_cpu = engine is not None and engine.runs_on_cpu
        out.append(Finding(
            Cause.CANNOT_TELL, "*", stages, {"missing": "gpu_samples"}, 1.0,
            busy_remedy(engine if engine is not None else EngineSettings()),
            "cannot tell how busy the stages were or how much they idled: the run has no GPU samples "
            + ("and no engine timers" if on_cpu else
               "(stage imbalance, PCIe and throttling need them too)"), impact=0.0))
    words = (engine or EngineSettings()).engine_spec
    follow = "follow the engine's log during the run" + (
        f" ({words.name} with {words.log_advice})" if words.log_advice else "")
    for pm in phases:
        if all(s.log_lines == 0 for s in pm.stages):
            out.append(Finding(
                Cause.CANNOT_TELL, pm.label, stages, {"missing": "scheduler_lines"}, 1.0, follow,
                "cannot tell what the engine ran in this phase: no scheduler lines (admission, "
                "micro-batch, KV-cache and pipeline-fill causes need them)", impact=0.0))
    return out


# Rules that read per-slot micro-batches and their cap K, which only a slot scheduler has (SGLang's
# PP loop): an engine that admits engine-wide (vLLM) is never checked for them.
SLOT_RULES = frozenset({"microbatch_cap", "bunched_at_the_bound", "log_sampling"})
# The setting a rule's text names, said with the run's engine's flag.
RULE_KNOBS = {"admission_bound": "max_running_requests", "prefill_budget": "chunked_prefill_size",
              "prefill_stall": "chunked_prefill_size"}


def rule_table(engine: str | None = None) -> list[tuple[str, str]]:
    """(rule, what it checks) for every rule the diagnosis applies to the run's engine, in the
    order it tries them, in that engine's words: the report prints this with the thresholds."""
    words = engine_words(engine)
    rules = (*RULES, rule_prefill_stall, rule_pipeline_underfilled, diagnose_log_sampling, cannot_tell)
    out = []
    for r in rules:
        name = r.__name__.removeprefix("rule_").removeprefix("diagnose_")
        if name in SLOT_RULES and not words.microbatch_slots:
            continue
        text = " ".join((r.__doc__ or "").split(".")[0].split())
        flag = words.flag(RULE_KNOBS.get(name, ""))
        out.append((name, f"{text} ({flag})" if flag else text))
    return out


def diagnose(phases: Sequence[PhaseMetrics], engine: EngineSettings, pp_size: int,
             th: Thresholds = Thresholds()) -> list[Finding]:
    """All findings of a run, most important first (by confidence times stage-time lost); what the
    run lacks for a diagnosis comes last, as "cannot tell"."""
    found: list[Finding] = []
    for pm in phases:
        found.extend(diagnose_phase(pm, engine, pp_size, th))
    found = note_k_trade_offs(found, phases, engine, pp_size)
    aliased = diagnose_log_sampling(phases, engine, pp_size, th)
    if aliased:
        found.append(aliased)
    found.sort(key=lambda f: -(f.confidence * f.impact))
    return found + cannot_tell(phases, pp_size, engine)
