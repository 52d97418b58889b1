"""vLLM (V1) as the simulator writes it: the two configuration lines, the stats line every
VLLM_LOG_STATS_INTERVAL, and its engine-wide ``vllm:*`` /metrics series.
"""

from __future__ import annotations

import datetime as dt

import numpy as np

from gputrace.engines.simulated import (
    MetricSample,
    MetricSnapshot,
    SimDeployment,
    SimulatedEngine,
    SimulatedRun,
)

VLLM_VERSION = "0.32.0"
VLLM_STATS_INTERVAL_S = 10.0


def vllm_prefix(ts_ns: int, process: str) -> str:
    """``(APIServer pid=1000) INFO 01-15 10:00:13``: vLLM's stamp has no year and no sub-second."""
    when = dt.datetime.fromtimestamp(ts_ns // 1_000_000_000, dt.UTC)
    pid = 1000 if process == "APIServer" else 1014
    return f"({process} pid={pid}) INFO {when:%m-%d %H:%M:%S}"


def vllm_stats_message(prompt_tok_s: float, gen_tok_s: float, running: int, waiting: int,
                       kv_usage: float) -> str:
    return (f"[loggers.py:335] Engine 000: Avg prompt throughput: {prompt_tok_s:.1f} tokens/s, "
            f"Avg generation throughput: {gen_tok_s:.1f} tokens/s, Running: {running} reqs, "
            f"Waiting: {waiting} reqs, GPU KV cache usage: {kv_usage * 100:.1f}%, "
            f"Prefix cache hit rate: 0.0%")


def vllm_startup_lines(p: SimDeployment, ts_ns: int) -> list[str]:
    """``non-default args: {...}`` from the API server, then the engine core's configuration."""
    args = {"model": p.model_path, "pipeline_parallel_size": p.pp_size,
            "max_num_seqs": p.max_running_requests}
    if p.tp_size > 1:
        args["tensor_parallel_size"] = p.tp_size
    config = (f"model={p.model_path!r}, tokenizer={p.model_path!r}, dtype=torch.bfloat16, "
              f"max_seq_len={p.context_len}, tensor_parallel_size={p.tp_size}, "
              f"pipeline_parallel_size={p.pp_size}, data_parallel_size=1, seed={p.seed}")
    return [f"{vllm_prefix(ts_ns, 'APIServer')} [api_utils.py:286] non-default args: {args!r}",
            f"{vllm_prefix(ts_ns, 'EngineCore')} [core.py:133] Initializing a V1 LLM engine "
            f"(v{VLLM_VERSION}) with config: {config}"]


def write_log(run: SimulatedRun) -> list[tuple[int, str]]:
    """vLLM's lines: the configuration, then every stats interval the averages over that window
    and the scheduler's state at its last step (lines stop when a window and the one before it
    saw nothing, as vLLM's logger does)."""
    p = run.params
    tr = run.trace
    t0 = run.ns(-run.lead_s)
    out = [(t0, line) for line in vllm_startup_lines(p, t0)]
    tok_t, tok_n = np.asarray(tr.tok_t), np.asarray(tr.tok_n, dtype=np.float64)
    pf_t, pf_n = np.asarray(tr.pf_t), np.asarray(tr.pf_n, dtype=np.float64)
    st_t = np.asarray(tr.st_t)
    step = VLLM_STATS_INTERVAL_S
    quiet_before = True
    t = -run.lead_s + step
    while t <= run.end_s:
        gen = float(tok_n[(tok_t > t - step) & (tok_t <= t)].sum())
        prompt = float(pf_n[(pf_t > t - step) & (pf_t <= t)].sum())
        last = int(np.searchsorted(st_t, t, side="right")) - 1
        running, waiting, kv = (tr.st_running[last], tr.st_waiting[last], tr.st_kv_used[last]) \
            if last >= 0 else (0, 0, 0)
        quiet = gen == 0 and prompt == 0 and running == 0 and waiting == 0
        if not (quiet and quiet_before):
            ts_ns = run.ns(t)
            message = vllm_stats_message(prompt / step, gen / step, running, waiting,
                                         kv / p.max_total_num_tokens)
            out.append((ts_ns, f"{vllm_prefix(ts_ns, 'APIServer')} {message}"))
        quiet_before = quiet
        t += step
    return out


def metric_samples(p: SimDeployment, snap: MetricSnapshot) -> list[MetricSample]:
    """The samples a scrape of vLLM's /metrics would read: engine-wide, no rank series."""
    labels = {"model_name": p.model_path, "engine": "0"}
    return [MetricSample("vllm:num_requests_running", labels, float(snap.running), "gauge"),
            MetricSample("vllm:num_requests_waiting", labels, float(snap.waiting), "gauge"),
            MetricSample("vllm:kv_cache_usage_perc", labels, snap.kv_usage_ratio, "gauge"),
            MetricSample("vllm:generation_tokens_total", labels, snap.tokens_total, "counter")]


# not served in real time (``gputrace sim serve``): its model runs in virtual time only
SIMULATED = SimulatedEngine(write_log=write_log, metric_samples=metric_samples)
