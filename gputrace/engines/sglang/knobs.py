"""SGLang's knobs (the settings a finding, the what-if and the advice change), its micro-batch cap
K's default and its slot count: the one place each rule is written (``managers/scheduler.py``,
``scheduler_pp_mixin.py``)."""

from __future__ import annotations

from gputrace.engines.knobs import Knob, Settings


def default_microbatch_cap(max_running_requests: int, pp_size: int) -> int:
    """SGLang's K where --pp-max-micro-batch-size is not set (``managers/scheduler.py``):
    max(max_running_requests // pp_size, 1). The one place the rule is written."""
    return max(int(max_running_requests) // int(pp_size), 1)


def slot_count(pp_size: int, pp_async_batch_depth: int | None) -> int:
    """SGLang's micro-batch slots under PP (``pp_loop_size``): pp_size + pp_async_batch_depth
    (0 where not logged). The one place the rule is written."""
    return int(pp_size) + int(pp_async_batch_depth or 0)


def _default_k(s: Settings) -> int | None:
    pool, pp = s.get("max_running_requests"), s.get("pp_size")
    known = isinstance(pool, int) and isinstance(pp, int) and pool > 0 and pp > 0
    return default_microbatch_cap(pool, pp) if known else None  # type: ignore[arg-type]


KNOBS = (
    Knob("pp_max_micro_batch_size", "--pp-max-micro-batch-size", int,
         "requests per micro-batch slot (K); K x slots caps the engine beside the pool",
         "max(max_running_requests // pp_size, 1)", default=_default_k, low=1, simulated=True,
         causes=("microbatch_cap", "pipeline_underfilled")),
    Knob("max_running_requests", "--max-running-requests", int,
         "requests running at once, engine-wide (the request pool's rows)",
         "sized from the KV pool (max_total_num_tokens) when not set", low=1, simulated=True,
         causes=("admission_bound",)),
    Knob("pp_async_batch_depth", "--pp-async-batch-depth", int,
         "micro-batch slots beyond pp_size (slots = pp_size + depth)", "0",
         default=lambda s: 0, low=0, simulated=True),
    Knob("chunked_prefill_size", "--chunked-prefill-size", int,
         "prompt tokens per chunk: a longer prompt is prefilled over several turns",
         "chosen from the GPU's memory when not set", low=1, simulated=True,
         causes=("prefill_budget", "prefill_stall")),
    Knob("max_prefill_tokens", "--max-prefill-tokens", int,
         "prompt tokens a prefill turn admits (the turn's budget)", "16384",
         default=lambda s: 16384, low=1, simulated=True, causes=("prefill_burst",)),
    Knob("max_total_num_tokens", "--max-total-tokens", int,
         "KV-cache tokens (the pool every running request's context shares)",
         "from --mem-fraction-static and the GPU's memory", low=1, simulated=True,
         causes=("kv_cache_bound",)),
    Knob("decode_log_interval", "--decode-log-interval", int,
         "decode steps between two logged decode lines per rank (what the log shows, not the serving)",
         "40", default=lambda s: 40, low=1, simulated=True, serving=False,
         causes=("log_sampling_aliased",)),
    Knob("layer_partition", "SGLANG_PP_LAYER_PARTITION", str,
         "the layers each pipeline stage holds (its share of a step's compute)", "an even split",
         simulated=True, param="stage_cost_multipliers", causes=("stage_imbalance",), settable=False),
)
