"""Findings: per phase, which cause keeps the stages idle (or the measurement unreliable), with the
numbers that show it, how sure, and what to change. A healthy phase yields no finding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from gputrace.analysis.metrics import PhaseMetrics, StageMetrics

CAUSES = ("admission_bound", "microbatch_cap", "pipeline_underfilled", "stage_imbalance", "client_bound",
          "kv_cache_bound", "pcie_bound", "throttling", "log_sampling_aliased", "cannot_tell")

# The engine-wide admission limit's flag, and the flags that size the KV cache, per engine.
ADMISSION_FLAG = {"sglang": "--max-running-requests", "vllm": "--max-num-seqs"}
KV_FLAGS = {"sglang": "--mem-fraction-static or --max-total-tokens",
            "vllm": "--gpu-memory-utilization (VLLM_CPU_KVCACHE_SPACE on the CPU build)"}


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


@dataclass
class Finding:
    """One diagnosed cause in one phase ("*" for the whole run)."""

    cause: str
    phase: str
    stages: list[int]
    evidence: dict[str, Any]
    confidence: float
    recommendation: str
    summary: str
    impact: float = 0.0  # share of stage-time lost to it, for ordering
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _vals(stages: Sequence[StageMetrics], name: str) -> np.ndarray:
    return np.array([getattr(s, name) if getattr(s, name) is not None else np.nan for s in stages],
                    dtype=float)


def default_microbatch_cap(engine: dict[str, Any], pp_size: int) -> tuple[int | None, str]:
    """SGLang's cap: the flag when set, else max(max_running_requests // pp_size, 1)."""
    flag = engine.get("pp_max_micro_batch_size")
    if flag:
        return int(flag), "--pp-max-micro-batch-size"
    mrr = engine.get("max_running_requests")
    if mrr:
        return max(int(mrr) // pp_size, 1), f"max_running_requests // pp_size = {int(mrr)} // {pp_size}"
    return None, "unknown (no engine configuration)"


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None or not np.isfinite(x) else round(float(x), nd)


def engine_kind(engine: dict[str, Any]) -> str:
    """"sglang" or "vllm" from the run's engine configuration (SGLang when unknown)."""
    kind = str(engine.get("engine") or "sglang")
    return kind if kind in ADMISSION_FLAG else "sglang"


def at_limit(running: float | None, limit: int | None, th: Thresholds) -> bool:
    """Whether an engine-wide running total is at its admission limit."""
    return running is not None and limit is not None and \
        running >= limit - max(1.5, th.limit_tolerance * limit)


def admission_bound(pm: PhaseMetrics, engine: dict[str, Any], load: float | None,
                    queue_mean: float | None, engine_running: float | None,
                    th: Thresholds) -> Finding | None:
    """The engine runs as many requests as it admits (SGLang's request pool, vLLM's max_num_seqs)
    while requests wait: raise the limit to the offered load, if the KV cache holds that many."""
    limit = int(engine["max_running_requests"]) if engine.get("max_running_requests") else None
    if load is None or queue_mean is None or queue_mean <= 0.5 or not at_limit(engine_running, limit, th):
        return None
    assert limit is not None and engine_running is not None
    kind = engine_kind(engine)
    want = max(int(np.ceil(load)), limit + 1)
    usage = _vals(pm.stages, "token_usage_max")
    usage_max = float(np.nanmax(usage)) if not np.isnan(usage).all() else None
    projected = usage_max * want / max(engine_running, 1.0) if usage_max is not None else None
    kv_short = projected is not None and projected >= th.kv_usage
    flag = ADMISSION_FLAG[kind]
    if kv_short:
        recommendation = (f"{flag} {want} would not fit the KV cache (token usage {usage_max:.2f} at "
                          f"{engine_running:.0f} running, about {projected:.2f} at {want}): give the cache "
                          f"more memory first ({KV_FLAGS[kind]}), then {flag} {want}")
    else:
        recommendation = f"{flag} {want}"
        if usage_max is None:
            recommendation += " (KV headroom unknown: no token usage logged)"
    return Finding(
        "admission_bound", pm.label, list(range(len(pm.stages))),
        {"engine": kind, "admission_limit": limit, "limit_flag": flag, "offered_load": _r(load, 1),
         "engine_running_estimate": _r(engine_running, 1), "queue_req_mean": _r(queue_mean, 2),
         "token_usage_max": _r(usage_max), "token_usage_projected": _r(projected)},
        0.9, recommendation,
        f"the engine runs {engine_running:.0f} requests, its limit ({flag.lstrip('-').replace('-', '_')} "
        f"= {limit}), while {load:.0f} are offered and {queue_mean:.0f} wait",
        impact=1.5, details={"knob": flag, "value": want})


def diagnose_phase(pm: PhaseMetrics, engine: dict[str, Any], pp_size: int,
                   th: Thresholds = Thresholds()) -> list[Finding]:
    """The findings of one phase."""
    out: list[Finding] = []
    st = pm.stages
    busy = _vals(st, "busy_fraction")
    bubble = _vals(st, "bubble_fraction")
    mb_max = _vals(st, "microbatch_size_max")
    mb_mean = _vals(st, "microbatch_size_mean")
    queue = _vals(st, "queue_req_mean")
    mean_bubble = float(np.nanmean(bubble)) if not np.isnan(bubble).all() else 0.0
    mean_busy = float(np.nanmean(busy)) if not np.isnan(busy).all() else None
    load = pm.inflight_mean if pm.inflight_mean is not None else pm.target_concurrency
    k, k_from = default_microbatch_cap(engine, pp_size)
    all_stages = list(range(pp_size))

    # Client-bound: the generator cannot keep the level it was asked for.
    if pm.target_concurrency and pm.inflight_mean is not None and \
            pm.inflight_mean < th.client_shortfall * pm.target_concurrency:
        short = 1 - pm.inflight_mean / pm.target_concurrency
        out.append(Finding(
            "client_bound", pm.label, all_stages,
            {"target_concurrency": pm.target_concurrency, "inflight_mean": _r(pm.inflight_mean, 2),
             "mean_bubble_fraction": _r(mean_bubble)},
            min(0.95, 0.5 + short), "the load generator keeps fewer requests in flight than asked: "
            "give it more workers/connections or remove its think time before reading the bubbles",
            f"client kept {pm.inflight_mean:.1f} of {pm.target_concurrency} requests in flight",
            impact=mean_bubble * short + 0.5))

    # Micro-batch cap: #running-req plateaus at K (per stage, or the engine's total) while
    # requests wait in the queue.
    queue_mean = float(np.nanmax(queue)) if not np.isnan(queue).all() else None
    engine_running = (load - queue_mean) if load is not None and queue_mean is not None else None
    kk = k or 0
    # offered - queued estimates the engine's running total; a queue sampled once a second (log
    # interval, Prometheus scrape) catches requests mid-turnover, hence the +-20 % band
    at_k = (np.abs(mb_max - kk) <= th.cap_tolerance) if kk else np.zeros(len(st), bool)
    plateau = kk > 0 and (at_k.sum() >= max(1, len(st) // 2) or (
        engine_running is not None and abs(engine_running - kk) <= max(1.5, 0.2 * kk)))
    waiting = queue_mean > 0.5 if queue_mean is not None else (
        load is not None and load > kk + 0.5 and mean_bubble > th.bubble_material)
    # K binds only while the request pool has free rows: at the pool's limit, raising K admits
    # nothing (SGLang's get_num_allocatable_reqs takes the smaller of the two).
    mrr = int(engine["max_running_requests"]) if engine.get("max_running_requests") else None
    pool_full = at_limit(engine_running, mrr, th)
    bound = admission_bound(pm, engine, load, queue_mean, engine_running, th)
    if bound is not None:
        out.append(bound)
    if engine_kind(engine) == "sglang" and kk and plateau and waiting and load is not None \
            and not pool_full:
        want = int(max(mrr or 0, pm.target_concurrency or 0, round(load)))
        out.append(Finding(
            "microbatch_cap", pm.label, [int(i) for i in np.flatnonzero(at_k)] or all_stages,
            {"K": k, "K_from": k_from, "max_running_requests": mrr, "pp_size": pp_size,
             "microbatch_size_max": _r(float(np.nanmax(mb_max)), 1),
             "microbatch_size_mean": _r(float(np.nanmean(mb_mean)), 2),
             "offered_load": _r(load, 1), "queue_req_mean": _r(queue_mean, 2),
             "engine_running_estimate": _r(engine_running, 1),
             "microbatches_in_flight": _r(pm.microbatches_in_flight, 2),
             "allowed_busy_fraction": _r(pm.allowed_busy_fraction),
             "mean_busy_fraction": _r(mean_busy), "mean_bubble_fraction": _r(mean_bubble)},
            0.9 if engine.get("max_running_requests") or engine.get("pp_max_micro_batch_size") else 0.6,
            f"--pp-max-micro-batch-size {want}",
            (f"#running-req plateaus at K = {k} ({k_from})" if at_k.sum() >= max(1, len(st) // 2)
             else f"the engine runs {engine_running or 0:.0f} requests, K = {k} ({k_from}), split over "
                  f"micro-batches of at most {float(np.nanmax(mb_max)):.0f}")
            + f" while {load:.0f} requests are offered and {queue_mean or 0:.0f} wait in the queue",
            impact=mean_bubble + 1.0))

    # Stage imbalance: one stage is the bottleneck, the others wait for it.
    if np.sum(~np.isnan(busy)) >= 2:
        med = float(np.nanmedian(busy))
        top = int(np.nanargmax(busy))
        if busy[top] - med > th.imbalance_gap and busy[top] > th.imbalance_ratio * med:
            slow = [int(i) for i in np.flatnonzero(busy - med > th.imbalance_gap)]
            out.append(Finding(
                "stage_imbalance", pm.label, slow,
                {"busy_fraction_by_stage": [_r(b) for b in busy], "median_busy_fraction": _r(med),
                 "busiest_stage": top, "busiest_busy_fraction": _r(float(busy[top]))},
                min(0.95, 0.5 + (busy[top] - med)),
                "rebalance the layer split (SGLANG_PP_LAYER_PARTITION) to move layers off stage "
                + ", ".join(map(str, slow)),
                f"stage {top} is busy {busy[top]:.0%} against a median of {med:.0%}",
                impact=float(busy[top] - med) + 0.3))

    # KV-cache bound: admission stalls on token usage (not a bubble of the pipeline).
    usage = _vals(st, "token_usage_max")
    q_max = _vals(st, "queue_req_max")
    if not np.isnan(usage).all() and np.nanmax(usage) >= th.kv_usage and np.nanmax(np.nan_to_num(q_max)) > 0:
        out.append(Finding(
            "kv_cache_bound", pm.label, all_stages,
            {"token_usage_max": _r(float(np.nanmax(usage))),
             "token_usage_mean": _r(float(np.nanmean(_vals(st, "token_usage_mean")))),
             "queue_req_mean": _r(queue_mean, 2), "queue_req_max": _r(float(np.nanmax(q_max)), 0)},
            0.8, "more KV cache (--mem-fraction-static, --max-total-tokens) or shorter contexts; "
                 "requests wait for cache, not for the pipeline",
            f"token usage reaches {np.nanmax(usage):.2f} while requests queue", impact=mean_bubble + 0.3))

    # PCIe-bound hand-offs: moving activations takes as long as a good share of the compute.
    hop = _vals(st, "pcie_transfer_per_busy")
    if not np.isnan(hop).all() and np.nanmax(hop) >= th.pcie_transfer_per_busy:
        hot = [int(i) for i in np.flatnonzero(hop >= th.pcie_transfer_per_busy)]
        out.append(Finding(
            "pcie_bound", pm.label, hot,
            {"pcie_transfer_per_busy_by_stage": [_r(p) for p in hop],
             "pcie_link_share_mean_by_stage": [_r(p) for p in _vals(st, "pcie_link_share_mean")],
             "pcie_link_share_p95_max": _r(float(np.nanmax(_vals(st, "pcie_link_share_p95"))))},
            0.75, "the stage hand-offs saturate PCIe: use NVLink-connected GPUs for adjacent stages, "
                  "fewer stages, or more TP within a node",
            f"hand-offs need {np.nanmax(hop):.0%} of the compute time at full PCIe link speed",
            impact=mean_bubble + 0.3))

    # Throttling: clock-event reasons say power or thermal slowdown.
    thr = _vals(st, "throttled_fraction")
    if not np.isnan(thr).all() and np.nanmax(thr) >= th.throttled_share:
        hot = [int(i) for i in np.flatnonzero(thr >= th.throttled_share)]
        out.append(Finding(
            "throttling", pm.label, hot,
            {"throttled_fraction_by_stage": [_r(t) for t in thr],
             "power_limit_share_p95_by_stage": [_r(p) for p in _vals(st, "power_limit_share_p95")],
             "sm_clock_mhz_by_stage": [_r(c / 1e6, 0) for c in _vals(st, "sm_clock_hz_mean")]},
            0.8, "the GPUs slow down for power or temperature: check cooling and power limits "
                 "(nvidia-smi -q -d PERFORMANCE)",
            f"clocks throttled {np.nanmax(thr):.0%} of the phase", impact=float(np.nanmax(thr)) * 0.5))

    # The cap is the cause only when the engine got the load and nothing else held admission
    # back: a short client or a full KV cache also leaves requests queued at a plateau.
    if any(f.cause in ("client_bound", "kv_cache_bound") for f in out):
        out = [f for f in out if f.cause not in ("microbatch_cap", "admission_bound")]

    # Too few micro-batches for the pipeline depth (stages in lockstep), when nothing above
    # explains the bubble. A pipeline whose slots are all filled keeps some bubble (hand-offs,
    # uneven steps): that is its cost, not a cause.
    allowed = pm.allowed_busy_fraction
    if not out and mean_bubble > th.bubble_material and allowed is not None and \
            allowed < th.underfilled_allowed_max:
        out.append(Finding(
            "pipeline_underfilled", pm.label, all_stages,
            {"microbatches_in_flight": _r(pm.microbatches_in_flight, 2), "pp_size": pp_size,
             "allowed_busy_fraction": _r(allowed), "mean_busy_fraction": _r(mean_busy),
             "mean_bubble_fraction": _r(mean_bubble), "offered_load": _r(load, 1)},
            0.7, f"keep at least {pp_size} micro-batches in flight: raise the offered concurrency, or "
                 "use fewer pipeline stages (more TP) for this load; --pp-async-batch-depth adds slots",
            f"{pm.microbatches_in_flight or 0:.1f} micro-batches in flight for {pp_size} stages: "
            f"the schedule allows {allowed:.0%} busy",
            impact=mean_bubble))
    return out


def diagnose_log_sampling(phases: Sequence[PhaseMetrics], engine: dict[str, Any], pp_size: int
                          ) -> Finding | None:
    """--decode-log-interval divisible by the micro-batch slot count: each stage keeps logging the
    same slot, so #running-req per stage misrepresents the micro-batches."""
    interval = engine.get("decode_log_interval")
    if pp_size < 2 or not interval or int(interval) <= 1:
        return None
    slots = pp_size + int(engine.get("pp_async_batch_depth") or 0)
    if int(interval) % slots:
        return None
    frozen = [p.label for p in phases if p.stages and all(
        s.log_lines >= 3 and s.distinct_microbatch_sizes <= 1 for s in p.stages)
        and (p.inflight_mean or p.target_concurrency or 0) > 1]
    return Finding(
        "log_sampling_aliased", "*", list(range(pp_size)),
        {"decode_log_interval": int(interval), "microbatch_slots": slots,
         "interval_mod_slots": int(interval) % slots, "phases_with_constant_running_req": frozen},
        0.9 if frozen else 0.6,
        "--decode-log-interval 1 (or a value coprime with "
        f"{slots}) for diagnosis runs",
        f"--decode-log-interval {interval} is a multiple of the {slots} micro-batch slots: each "
        "stage logs the same slot every time", impact=0.05)


def cannot_tell(phases: Sequence[PhaseMetrics], pp_size: int) -> list[Finding]:
    """What the run lacks for the causes it could not look at: never "healthy" for want of data."""
    out: list[Finding] = []
    stages = list(range(pp_size))
    if phases and all(s.busy_fraction is None for pm in phases for s in pm.stages):
        out.append(Finding(
            "cannot_tell", "*", stages, {"missing": "gpu_samples"}, 1.0,
            "run `gputrace agent` on each GPU host (or import nvidia-smi or DCGM data) with the capture",
            "cannot tell how busy the stages were or how much they idled: the run has no GPU samples "
            "(stage imbalance, PCIe and throttling need them too)", impact=0.0))
    for pm in phases:
        if all(s.log_lines == 0 for s in pm.stages):
            out.append(Finding(
                "cannot_tell", pm.label, stages, {"missing": "scheduler_lines"}, 1.0,
                "follow the engine's log during the run (SGLang with --decode-log-interval 1)",
                "cannot tell what the engine ran in this phase: no scheduler lines (admission, "
                "micro-batch, KV-cache and pipeline-fill causes need them)", impact=0.0))
    return out


def diagnose(phases: Sequence[PhaseMetrics], engine: dict[str, Any], pp_size: int,
             th: Thresholds = Thresholds()) -> list[Finding]:
    """All findings of a run, most important first (by confidence times stage-time lost); what the
    run lacks for a diagnosis comes last, as "cannot tell"."""
    found: list[Finding] = []
    for pm in phases:
        found.extend(diagnose_phase(pm, engine, pp_size, th))
    aliased = diagnose_log_sampling(phases, engine, pp_size)
    if aliased:
        found.append(aliased)
    found.sort(key=lambda f: -(f.confidence * f.impact))
    return found + cannot_tell(phases, pp_size)
