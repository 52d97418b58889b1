"""vLLM: its stats and configuration lines, its knobs and its words. Registered in
gputrace/engines/__init__.py."""

from __future__ import annotations

from gputrace.engines.common import Engine
from gputrace.engines.vllm.grammar import ENGINE as KIND
from gputrace.engines.vllm.grammar import LOG_FIELDS, MAYBE_VLLM, parse_line
from gputrace.engines.vllm.knobs import KNOBS

__all__ = ["ENGINE", "KIND", "MAYBE_VLLM", "parse_line"]

ENGINE = Engine(
    kind=KIND, name="vLLM",
    knobs=KNOBS,
    log_fields=LOG_FIELDS,
    placement_rule="vLLM rank order",  # rank = pp_rank * tp_size + tp_rank, as SGLang's
    placement_source="vllm-rank-order",
    microbatch_slots=False,  # admission is engine-wide (max_num_seqs), no per-micro-batch cap
    parse_line=parse_line,
    maybe_line=MAYBE_VLLM,
    other_words=("VLLM_LOG_STATS_INTERVAL",),
)
WORDS = ENGINE
