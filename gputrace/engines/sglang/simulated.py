"""SGLang's scheduler log lines in their current form (see shared ENGINES.md), for the simulator:
the ``[YYYY-mm-dd HH:MM:SS PPp TPt]`` prefix, batch lines and the startup configuration lines.
"""

from __future__ import annotations

import datetime as dt

from gputrace.sim.params import SimParams


def parse_start_ns(text: str) -> int:
    """``2026-01-15T10:00:00Z`` -> ns since the epoch (UTC when no zone is given)."""
    stamp = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=dt.UTC)
    return int(stamp.timestamp()) * 1_000_000_000 + stamp.microsecond * 1000


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


def decode_message(f: dict[str, float | int | bool]) -> str:
    return (f"Decode batch, #running-req: {f['running_req']}, #token: {f['num_token']}, "
            f"token usage: {f['token_usage']:.2f}, cuda graph: {bool(f['cuda_graph'])}, "
            f"gen throughput (token/s): {f['gen_throughput']:.2f}, #queue-req: {f['queue_req']}"
            + _occupancy_tail(f))


def prefill_message(f: dict[str, float | int | bool]) -> str:
    return (f"Prefill batch, #new-seq: {f['new_seq']}, #new-token: {f['new_token']}, "
            f"#cached-token: {f['cached_token']}, token usage: {f['token_usage']:.2f}, "
            f"#running-req: {f['running_req']}, #queue-req: {f['queue_req']}, "
            f"#pending-token: {f['pending_token']}, cuda graph: False, "
            f"input throughput (token/s): {f['input_throughput']:.2f}" + _occupancy_tail(f))


def _occupancy_tail(f: dict[str, float | int | bool]) -> str:
    """SGLang 0.5.23's device-timer suffix (metrics_reporter's _ForwardOccupancyLogWindow)."""
    if "fwd_occupancy" not in f:
        return ""
    return (f", fwd occupancy: {f['fwd_occupancy'] * 100:.2f}%, "
            f"fwd+idle occupancy: {f['fwd_idle_occupancy'] * 100:.2f}%")


def server_args_message(p: SimParams) -> str:
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


def startup_message(p: SimParams) -> str:
    """The per-rank capacity line every scheduler logs at startup."""
    free_gb = (p.memory_total_bytes - p.weights_bytes_per_gpu) / 1e9 * 0.12
    return (f"max_total_num_tokens={p.max_total_num_tokens}, chunked_prefill_size={p.chunked_prefill_size}, "
            f"max_prefill_tokens={p.max_prefill_tokens}, max_running_requests={p.max_running_requests}, "
            f"context_len={p.context_len}, available_gpu_mem={free_gb:.2f} GB")


def startup_lines(p: SimParams, ts_ns: int, prefix: LinePrefix) -> list[str]:
    """The configuration lines logged before serving: server_args, then one per rank."""
    lines = [f"{prefix.rank(ts_ns, None)} {server_args_message(p)}"]
    for pp in range(p.pp_size):
        for tp in range(p.tp_size):
            lines.append(f"{prefix.rank(ts_ns, pp, tp)} {startup_message(p)}")
    return lines


# -- vLLM (V1): the stats line every VLLM_LOG_STATS_INTERVAL and the two configuration lines --------

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


def vllm_startup_lines(p: SimParams, ts_ns: int) -> list[str]:
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
