"""SGLang: its log grammar (every known version) and the fast path for its current batch lines,
its knobs with K's default and the slot count, and its words. Registered in
gputrace/engines/__init__.py."""

from __future__ import annotations

from gputrace.engines.common import Engine, OutputReservation, SchedulingPolicy
from gputrace.engines.sglang.fastpath import MAYBE_SGLANG, scan_chunk
from gputrace.engines.sglang.grammar import ENGINE as KIND
from gputrace.engines.sglang.grammar import LOG_FIELDS, RANK_FIELDS, RANK_TAG, batch_fields, parse_line
from gputrace.engines.sglang.knobs import KNOBS, default_microbatch_cap, slot_count
from gputrace.engines.sglang.simulated import SIMULATED

__all__ = ["ENGINE", "KIND", "RANK_FIELDS", "RANK_TAG", "batch_fields", "default_microbatch_cap",
           "parse_line", "slot_count"]

ENGINE = Engine(
    kind=KIND, name="SGLang",
    knobs=KNOBS,  # gputrace's setting names are SGLang's
    log_fields=LOG_FIELDS,
    placement_rule="SGLang formula",
    placement_source="sglang-formula",
    # the PP loop's slots, each a micro-batch capped at K; a prefill turn runs alone; KV held for
    # the filled slot's running requests only, at new_token_ratio (SGLANG_INIT_NEW_TOKEN_RATIO 0.7,
    # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR 0.14, SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS 600,
    # SGLANG_RETRACT_DECODE_STEPS 20: sglang/srt/environ.py, 0.5.23)
    policy=SchedulingPolicy(microbatch_slots=True, mixed_prefill=False, cpu_forward_in_loop=True,
                            output_reservation=OutputReservation(init_ratio=0.7, min_ratio_factor=0.14,
                                                                 decay_steps=600, retract_decode_steps=20)),
    parse_line=parse_line,
    simulated=SIMULATED,
    slot_count=slot_count,  # its PP loop's slots: pp_size + pp_async_batch_depth
    maybe_line=MAYBE_SGLANG,
    fast_path=scan_chunk,
    # K's flag before 2025-10; the KV pool's other flag; the metrics and the device timer
    kv_advice="--mem-fraction-static or --max-total-tokens",
    log_advice="--decode-log-interval 1",
    stage_timers=("scrape the engine's per-stage timers: start SGLang with --enable-metrics and add "
                  "`[hosts.engine_metrics] url = \"http://HOST:PORT/metrics\"` to gputrace.toml (SGLang "
                  "0.5.23+'s run_batch timers give each stage's busy and bubble)"),
    other_words=("--max-micro-batch-size", "--mem-fraction-static", "--enable-metrics",
                 "SGLANG_ENABLE_METRICS_DEVICE_TIMER"),
)
# the words the engine had before it held its grammar (tests and outputs still say WORDS)
WORDS = ENGINE
