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
            f"gen throughput (token/s): {f['gen_throughput']:.2f}, #queue-req: {f['queue_req']}")


def prefill_message(f: dict[str, float | int | bool]) -> str:
    return (f"Prefill batch, #new-seq: {f['new_seq']}, #new-token: {f['new_token']}, "
            f"#cached-token: {f['cached_token']}, token usage: {f['token_usage']:.2f}, "
            f"#running-req: {f['running_req']}, #queue-req: {f['queue_req']}, "
            f"#pending-token: {f['pending_token']}, cuda graph: False, "
            f"input throughput (token/s): {f['input_throughput']:.2f}")


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
