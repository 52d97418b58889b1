"""Prefill in the analysis, on simulated runs with ground truth: tokens counted as the engine
generated them (a prompt's chunks are input, not output) and the load read once per micro-batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gputrace.analysis.result import Analysis, analyse_store
from gputrace.sim.outputs import write_store
from gputrace.sim.params import make_params
from gputrace.sim.virtual import run_params
from gputrace.store import Store

# Long prompts (1,400 +- 30 %) cut into 256-token chunks, few tokens out: a prompt's 4-8 prefill
# lines each name it in #new-seq (SGLang's len(can_run_list)), against 16 generated tokens.
LONG_PROMPTS: dict[str, Any] = {
    "pp_size": 2, "max_running_requests": 16, "chunked_prefill_size": 256, "max_prefill_tokens": 4096,
    "input_tokens": 1400, "input_tokens_jitter": 0.3, "max_tokens": 16, "concurrency": (1, 4, 8),
    "phase_s": 40.0, "prefill_token_s": 2e-4}


def _analysed(tmp_path: Path, values: dict[str, Any]) -> Analysis:
    result = run_params(make_params(values), "prefill")
    with Store.open(write_store(result, tmp_path / "run"), read_only=True) as store:
        return analyse_store(store)


@pytest.mark.parametrize("interval", [1, 40])
def test_phase_throughput_counts_generated_tokens_only(tmp_path: Path, interval: int) -> None:
    """[prefill] Must show 3: with long prompts in small chunks, each phase's tok/s from the
    engine's log is within 2 % of the client's completion tokens (counting every chunk's line as a
    token read 31-32 % high at interval 1; the sampled log's decode throughput without the
    prefills' first tokens 6-7 % low at 40), says it came from the engine's log, and the prompt
    tokens are their own figure (input tok/s), within 2 % of the client's prompts."""
    a = _analysed(tmp_path, {**LONG_PROMPTS, "decode_log_interval": interval})
    phases = [pm for pm in a.metrics if pm.label.startswith("C=")]
    assert [pm.label for pm in phases] == ["C=1", "C=4", "C=8"]
    for pm in phases:
        assert pm.engine_gen_throughput_tok_s is not None and pm.client_throughput_tok_s
        assert pm.engine_gen_throughput_tok_s == pytest.approx(pm.client_throughput_tok_s, rel=0.02), pm.label
        assert pm.throughput_tok_s == pm.engine_gen_throughput_tok_s
        assert pm.throughput_source == "engine log"
        assert pm.engine_input_tok_s is not None and pm.client_input_tok_s
        assert pm.engine_input_tok_s == pytest.approx(pm.client_input_tok_s, rel=0.02), pm.label
        assert pm.input_tok_s == pm.engine_input_tok_s
        # input is ~90 x output here: had a chunk counted as output, tok/s would read far above
        assert pm.input_tok_s > 50 * pm.throughput_tok_s
