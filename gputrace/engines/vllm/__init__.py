"""vLLM: its stats and configuration lines, its knobs and its words. Registered in
gputrace/engines/__init__.py."""

from __future__ import annotations

from gputrace.engines.common import Engine, SchedulingPolicy
from gputrace.engines.vllm.grammar import ENGINE as KIND
from gputrace.engines.vllm.grammar import LOG_FIELDS, MAYBE_VLLM, parse_line
from gputrace.engines.vllm.knobs import KNOBS
from gputrace.engines.vllm.simulated import SIMULATED

__all__ = ["ENGINE", "KIND", "MAYBE_VLLM", "RANK_GAUGES", "parse_line"]

# Its /metrics gauges of one engine core (label ``engine``: its DP rank; no PP rank), by the stats
# line field each holds
RANK_GAUGES = {"vllm:num_requests_running": "running_req", "vllm:num_requests_waiting": "queue_req"}

ENGINE = Engine(
    kind=KIND, name="vLLM",
    knobs=KNOBS,
    log_fields=LOG_FIELDS,
    placement_rule="vLLM rank order",  # rank = pp_rank * tp_size + tp_rank, as SGLang's
    placement_source="vllm-rank-order",
    # admission is engine-wide (max_num_seqs), no per-micro-batch cap; prompts ride in the steps
    policy=SchedulingPolicy(microbatch_slots=False, mixed_prefill=True, cpu_forward_in_loop=False),
    parse_line=parse_line,
    simulated=SIMULATED,
    maybe_line=MAYBE_VLLM,
    stamps_have_year=False,  # MM-DD HH:MM:SS
    steps_logged=False,  # a stats line every VLLM_LOG_STATS_INTERVAL, averaged over it
    kv_advice="--gpu-memory-utilization (VLLM_CPU_KVCACHE_SPACE on the CPU build)",
    other_words=("VLLM_LOG_STATS_INTERVAL",),
    # counted as each step's outputs reach the API server: resolved to the scrape, not to the
    # stats line's 10 s window (a 25 s phase read 13 % high from the windows)
    generated_tokens_counter="vllm:generation_tokens_total",
)
WORDS = ENGINE
