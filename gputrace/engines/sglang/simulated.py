"""SGLang as the simulator writes it (see shared ENGINES.md): its scheduler log lines in their
current form (the ``[YYYY-mm-dd HH:MM:SS PPp TPt]`` prefix, batch lines and the startup
configuration lines) and its ``sglang:*`` /metrics series per ``pp_rank``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable

from gputrace.engines.simulated import (
    MetricSample,
    MetricSnapshot,
    SimDeployment,
    SimulatedEngine,
    SimulatedRun,
    StepFields,
)


class LinePrefix:
    """Formats the time part of the prefix, caching the text of the current second."""

    def __init__(self, pp_size: int, tp_size: int):
        self.pp_size = pp_size
        self.tp_size = tp_size
        self._sec = -1
        self._text = ""

    def stamp(self, ts_ns: int) -> str:
        sec = ts_ns // 1_000_000_000
        if sec != self._sec:
            self._sec = sec
            self._text = dt.datetime.fromtimestamp(sec, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        return self._text

    def rank(self, ts_ns: int, pp_rank: int | None, tp_rank: int = 0) -> str:
        """``[2026-01-15 10:00:01 PP3]``; ``PPp TPt`` when TP > 1 (SGLang's DP PP TP order)."""
        ranks = ""
        if pp_rank is not None and self.pp_size > 1:
            ranks += f" PP{pp_rank}"
        if pp_rank is not None and self.tp_size > 1:
            ranks += f" TP{tp_rank}"
        return f"[{self.stamp(ts_ns)}{ranks}]"


def decode_message(f: StepFields) -> str:
    return (f"Decode batch, #running-req: {f['running_req']}, #token: {f['num_token']}, "
            f"token usage: {f['token_usage']:.2f}, cuda graph: {bool(f['cuda_graph'])}, "
            f"gen throughput (token/s): {f['gen_throughput']:.2f}, #queue-req: {f['queue_req']}"
            + _occupancy_tail(f))


def prefill_message(f: StepFields) -> str:
    return (f"Prefill batch, #new-seq: {f['new_seq']}, #new-token: {f['new_token']}, "
            f"#cached-token: {f['cached_token']}, token usage: {f['token_usage']:.2f}, "
            f"#running-req: {f['running_req']}, #queue-req: {f['queue_req']}, "
            f"#pending-token: {f['pending_token']}, cuda graph: False, "
            f"input throughput (token/s): {f['input_throughput']:.2f}" + _occupancy_tail(f))


def _occupancy_tail(f: StepFields) -> str:
    """SGLang 0.5.23's device-timer suffix (metrics_reporter's _ForwardOccupancyLogWindow)."""
    if "fwd_occupancy" not in f:
        return ""
    return (f", fwd occupancy: {f['fwd_occupancy'] * 100:.2f}%, "
            f"fwd+idle occupancy: {f['fwd_idle_occupancy'] * 100:.2f}%")


def server_args_message(p: SimDeployment) -> str:
    """The ``server_args=ServerArgs(...)`` line (a subset of the fields, in SGLang's order)."""
    fields: list[tuple[str, object]] = [
        ("model_path", p.model_path), ("tokenizer_path", p.model_path), ("tokenizer_mode", "auto"),
        ("skip_tokenizer_init", False), ("load_format", "auto"), ("trust_remote_code", False),
        ("context_length", None), ("dtype", "auto"), ("kv_cache_dtype", "auto"),
        ("host", "127.0.0.1"), ("port", 30000), ("mem_fraction_static", 0.88),
        ("max_running_requests", p.max_running_requests), ("max_total_tokens", None),
        ("chunked_prefill_size", p.chunked_prefill_size), ("max_prefill_tokens", p.max_prefill_tokens),
        ("schedule_policy", "fcfs"), ("schedule_conservativeness", 1.0), ("page_size", 1),
        ("tp_size", p.tp_size), ("pp_size", p.pp_size),
        ("pp_max_micro_batch_size", p.pp_max_micro_batch_size),
        ("pp_async_batch_depth", p.pp_async_batch_depth), ("stream_interval", 1),
        ("random_seed", p.seed), ("log_level", "info"), ("log_requests", False),
        ("decode_log_interval", p.decode_log_interval), ("enable_metrics", False),
        ("dp_size", 1), ("load_balance_method", "round_robin"), ("nnodes", 1), ("node_rank", 0),
        ("disable_cuda_graph", False), ("cuda_graph_max_bs", p.cuda_graph_max_bs),
        ("enable_dynamic_chunking", False),
    ]
    body = ", ".join(f"{k}={v!r}" for k, v in fields)
    return f"server_args=ServerArgs({body})"


def startup_message(p: SimDeployment) -> str:
    """The per-rank capacity line every scheduler logs at startup."""
    free_gb = (p.memory_total_bytes - p.weights_bytes_per_gpu) / 1e9 * 0.12
    return (f"max_total_num_tokens={p.max_total_num_tokens}, chunked_prefill_size={p.chunked_prefill_size}, "
            f"max_prefill_tokens={p.max_prefill_tokens}, max_running_requests={p.max_running_requests}, "
            f"context_len={p.context_len}, available_gpu_mem={free_gb:.2f} GB")


class SGLangLines:
    """SGLang's log lines for one deployment, as its ranks write them (a StepLineWriter)."""

    def __init__(self, p: SimDeployment):
        self.p = p
        self.prefix = LinePrefix(p.pp_size, p.tp_size)

    def startup(self, ts_ns: int, ranks: Iterable[tuple[int, int]]) -> list[str]:
        """The configuration lines logged before serving: server_args, then one per rank."""
        lines = [f"{self.prefix.rank(ts_ns, None)} {server_args_message(self.p)}"]
        lines += [f"{self.prefix.rank(ts_ns, pp, tp)} {startup_message(self.p)}" for pp, tp in ranks]
        return lines

    def step(self, ts_ns: int, stage: int, kind: str, fields: StepFields) -> str:
        message = decode_message(fields) if kind == "decode" else prefill_message(fields)
        return f"{self.prefix.rank(ts_ns, stage)} {message}"


def write_log(run: SimulatedRun) -> list[tuple[int, str]]:
    """A virtual run's log: the configuration lines of every rank, then each logged step in time
    order, up to the run's end."""
    p = run.params
    lines = SGLangLines(p)
    t0 = run.ns(-run.lead_s)
    out = [(t0, line) for line in lines.startup(t0, ((pp, tp) for pp in range(p.pp_size)
                                                      for tp in range(p.tp_size)))]
    end_ns = run.ns(run.end_s)
    for t_s, _, stage, kind, fields in sorted(run.records):
        ts_ns = run.ns(t_s)
        if ts_ns > end_ns:
            break
        out.append((ts_ns, lines.step(ts_ns, stage, kind, fields)))
    return out


# -- its /metrics: gauges per pp_rank (set when a rank logs a batch, as SGLang's metrics collector
# is), its token and forward-time counters and its end-to-end latency histogram -----------------

# The step fields whose newest value each rank's gauge holds.
RANK_GAUGES = {"running_req": "sglang:num_running_reqs", "queue_req": "sglang:num_queue_reqs",
               "token_usage": "sglang:token_usage", "gen_throughput": "sglang:gen_throughput"}
E2E = "sglang:e2e_request_latency_seconds"  # its histogram (its _sum and _count; no buckets here)


def metric_samples(p: SimDeployment, snap: MetricSnapshot) -> list[MetricSample]:
    """The samples a scrape of SGLang's /metrics would read."""
    model = {"model_name": p.model_path}
    out = [MetricSample(E2E + "_sum", model, snap.e2e_latency_sum_s, "histogram"),
           MetricSample(E2E + "_count", model, float(snap.e2e_count), "histogram")]
    for s, fields in enumerate(snap.stage_fields):
        labels = {"model_name": p.model_path, "engine_type": "unified", "tp_rank": "0", "pp_rank": str(s)}
        out += [MetricSample(name, labels, float(fields[f]), "gauge")
                for f, name in RANK_GAUGES.items() if f in fields]
        out.append(MetricSample("sglang:realtime_tokens_total", labels, snap.tokens_total, "counter"))
        if p.device_timer and s < len(snap.forward_s):  # SGLANG_ENABLE_METRICS_DEVICE_TIMER=1 only
            out.append(MetricSample("sglang:forward_execution_seconds_total", labels, snap.forward_s[s],
                                    "counter"))
    return out


SIMULATED = SimulatedEngine(write_log=write_log, metric_samples=metric_samples,
                            rank_gauges=frozenset(RANK_GAUGES), step_lines=SGLangLines)
