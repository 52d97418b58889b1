"""vLLM's knobs: the settings a finding, the what-if and the advice change, in vLLM's flags."""

from __future__ import annotations

from gputrace.engines.knobs import Knob

KNOBS = (
    Knob("max_running_requests", "--max-num-seqs", int,
         "requests running at once, engine-wide (no per-micro-batch cap)",
         "by device (0.32.0: 256; 1024 on GPUs of 70 GB or more but the A100)", low=1, simulated=True,
         setting="max_num_seqs", causes=("admission_bound",)),
    # a step's token budget, shared by decode tokens and prefill chunks (chunked prefill is on by
    # default in V1): under gputrace's name for the prefill budget
    Knob("chunked_prefill_size", "--max-num-batched-tokens", int,
         "tokens a step schedules, decode tokens and prefill chunks together",
         "by device (0.32.0's server: 2048; 8192 on GPUs of 70 GB or more but the A100)",
         low=1, simulated=True, setting="max_num_batched_tokens", sets_too=("max_prefill_tokens",),
         causes=("prefill_budget", "prefill_stall")),
    # the KV pool keeps gputrace's name: vLLM sets it as a memory share, not in tokens
    Knob("max_total_num_tokens", "--gpu-memory-utilization", int,
         "KV-cache tokens (vLLM sizes the pool as a share of the GPU's memory)",
         "0.92 of the GPU's memory (0.32.0)",
         low=1, simulated=True, value_flag="KV cache tokens (--num-gpu-blocks-override x block size)",
         causes=("kv_cache_bound",)),
    Knob("layer_partition", "VLLM_PP_LAYER_PARTITION", str,
         "the layers each pipeline stage holds (its share of a step's compute)", "an even split",
         simulated=True, param="stage_cost_multipliers", causes=("stage_imbalance",), settable=False),
)
