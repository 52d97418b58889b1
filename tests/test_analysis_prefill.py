"""Prefill in the analysis, on simulated runs with ground truth: tokens counted as the engine
generated them (a prompt's chunks are input, not output) and the load read once per micro-batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gputrace.analyse import analyse_run
from gputrace.analysis.result import Analysis
from gputrace.imports.engine_log import ingest_log
from gputrace.imports.nvidia_smi import import_nvidia_smi_csv
from gputrace.sim.outputs import sample_columns, write_gpu_csv, write_log, write_store
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
        return analyse_run(store, effects=False)


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


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_log_only_pp2_at_c1_with_nccl_spin_counts_the_request_once(tmp_path: Path, seed: int) -> None:
    """[prefill] Must show 6: a PP2 run at C=1 with NCCL's spinning receive, imported as its log
    and an nvidia-smi CSV (utilization and power, no SM activity, no client records): the load
    from the log is the one request, not one per rank (utilization read ~100 % on both ranks and
    made the one micro-batch two: load 2, bubble 0.01 against 0.50), and each stage's bubble is
    within 0.05 of the simulator's truth."""
    result = run_params(make_params({"pp_size": 2, "max_running_requests": 16, "concurrency": (1,),
                                     "phase_s": 60.0, "nccl_spin": True, "max_tokens": 256,
                                     "decode_log_interval": 1, "seed": seed}), "pp2-c1")
    write_log(result, tmp_path / "server.log")
    write_gpu_csv(result, tmp_path / "gpu.csv", sample_columns(result))
    with Store.create(tmp_path / "imported") as store:
        ingest_log(store, tmp_path / "server.log", host="gpu-box", engine="sglang")
        import_nvidia_smi_csv(store, tmp_path / "gpu.csv", host="gpu-box")
        a = analyse_run(store, effects=False)
    assert a.summary()["work_source"] == "engine running + queued requests (log)"
    (pm,) = a.metrics
    (truth,) = result.ground_truth["phases"]
    assert pm.label == "load=1" and pm.microbatches_in_flight == pytest.approx(1.0, abs=0.05)
    for stage, gs in zip(pm.stages, truth["stages"], strict=True):
        assert stage.utilization_mean is not None and stage.utilization_mean > 0.95  # the spin
        assert stage.bubble_fraction is not None and gs["bubble_fraction"] > 0.4
        assert abs(stage.bubble_fraction - gs["bubble_fraction"]) <= 0.05, (stage, gs["bubble_fraction"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefill_budget_is_named_where_every_turn_fills_it_and_requests_wait(tmp_path: Path,
                                                                             seed: int) -> None:
    """[prefill] The prefill cause with its evidence and knob: at C=16 against a pool of 16, prompts
    of ~1,450 tokens in 256-token chunks fill 84 % of the prefill turns while ~5.6 requests wait
    with pool rows free: prefill_budget names --chunked-prefill-size (a power of two at least a
    prompt, twice the run's), and the phase's prefill figures say so. With a 2,048 chunk the
    prompts fit a turn: not named."""
    small = _analysed(tmp_path / "small", {**LONG_PROMPTS, "concurrency": (16,), "seed": seed})
    (found,) = [f for f in small.findings if f.cause == "prefill_budget"]
    assert found.change is not None and found.change.flag == "--chunked-prefill-size"
    assert found.change.value == 2048 and found.recommendation.startswith("--chunked-prefill-size 2048")
    assert found.evidence["prefill_budget_tokens"] == 256 and found.evidence["full_turn_share"] >= 0.5
    assert found.evidence["queue_req_mean"] > 0.5
    (pm,) = small.metrics
    assert pm.prefill is not None and pm.prefill.prompt_tokens_mean == pytest.approx(1400, rel=0.1)
    large = _analysed(tmp_path / "large", {**LONG_PROMPTS, "concurrency": (16,), "seed": seed,
                                            "chunked_prefill_size": 2048})
    assert not [f for f in large.findings if f.cause == "prefill_budget"]


def _motivating_burst(k: int | None, **overrides: Any) -> dict[str, Any]:
    """The motivating deployment in the regime its figures were measured in: bursts of 32 prompts of
    1,024 tokens, 512 out, its calibrated cost; K at its default (64 // 8 = 8) or as given."""
    from gputrace.sim.params import KIMI_K26_PCIE_COST, SCENARIOS
    return {**SCENARIOS["motivating"].overrides, **KIMI_K26_PCIE_COST, "client_mode": "burst",
            "concurrency": (32,), "max_tokens": 512, "pp_max_micro_batch_size": k, "phase_s": 600.0,
            "drain_s": 0.0, **overrides}


def test_a_burst_whose_first_request_lands_alone_is_read_by_the_turns_the_budget_ended(
        tmp_path: Path) -> None:
    """A burst sent one request after another: the first lands alone and takes a turn of its own
    (the demo's live C=32: turns of 1, 1, 7, 8, 8, 7), the rest wait for the budget. The finding
    reads what the turns the budget ended admitted, 8 prompts a turn, not the mean turn (6.4)."""
    late = (0.0, *([0.1] * 31))  # the first prompt's turn takes 0.22 s on stage 0
    a = _analysed(tmp_path, _motivating_burst(None, burst_offsets_s=late))
    (found,) = [f for f in a.findings if f.cause == "prefill_burst"]
    (pm,) = a.metrics
    assert pm.prefill is not None and pm.prefill.seqs_per_turn_mean == pytest.approx(6.4)
    # the turns of 8, and the 7 that took the rest
    assert pm.prefill.seqs_per_full_turn is not None and 7.5 <= pm.prefill.seqs_per_full_turn <= 8
    assert pm.prefill.seqs_in_full_turns >= 24
    assert found.evidence["prompts_per_turn"] == 8 and found.evidence["microbatches_packed"] == 4
    assert "admits 8 prompts per turn, so 32 requests run as 4 micro-batches for 8 stages" in found.summary
    assert found.change is not None and found.change.value == 3584


@pytest.mark.parametrize("k", [None, 64])
def test_a_burst_admitted_budget_at_a_time_is_named_in_the_engineers_words(tmp_path: Path,
                                                                           k: int | None) -> None:
    """[prefill] The motivating cause: SGLang's 8,192-token prefill budget admits 8 of the burst's
    1,024-token prompts per turn, each turn fills one slot, so 32 requests run as 4 micro-batches
    for 8 stages whether K is 8 or 64 (the engineer raised it to 64: 248 -> 251 tok/s measured).
    The finding says so with its evidence (tokens per turn against the budget, micro-batches in
    flight against the stages) and names the budget; it replaces the K-bunching reading of the
    underfilled pipeline. Its change, run in the simulator, fills the 8 stages and gains."""
    a = _analysed(tmp_path, _motivating_burst(k))
    (found,) = [f for f in a.findings if f.cause == "prefill_burst"]
    assert not [f for f in a.findings if f.cause in ("pipeline_underfilled", "microbatch_cap")]
    ev = found.evidence
    budget = (ev["prefill_budget_tokens"], ev["prefill_tokens_per_turn_mean"], ev["prompts_per_turn"])
    assert budget == (8192, 8192, 8)
    assert ev["microbatches_packed"] == 4 and ev["microbatches_in_flight"] == pytest.approx(4, abs=0.2)
    assert ev["K"] == (k or 8) and ev["pp_size"] == 8
    words = "K does not bind" if k else \
        "K = 8 (max_running_requests // pp_size = 64 // 8) caps each micro-batch"
    assert found.summary.startswith(f"`#running-req: 8` is one micro-batch; {words}"), found.summary
    assert "admits 8 prompts per turn, so 32 requests run as 4 micro-batches for 8 stages" in found.summary
    assert found.change is not None and found.change.flag == "--max-prefill-tokens"
    assert found.change.value == 3584
    assert "--pp-max-micro-batch-size 4" in found.recommendation
    (before,) = run_params(make_params(_motivating_burst(k)), log=False).ground_truth["phases"]
    (after,) = run_params(make_params(_motivating_burst(k, max_prefill_tokens=found.change.value)),
                          log=False).ground_truth["phases"]
    assert before["microbatches_in_flight"] == pytest.approx(4, abs=0.1)
    assert after["microbatches_in_flight"] == pytest.approx(8, abs=0.1)
    assert after["throughput_tok_s"] > 1.4 * before["throughput_tok_s"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_long_prefills_stalling_the_other_micro_batches_are_named_with_the_chunk(tmp_path: Path,
                                                                                 seed: int) -> None:
    """[prefill] Must show 4, the mixed load: 1 request in 10 sends a 16,384-token prompt among
    ~256-token ones, cut into 8,192-token chunks; all 8 micro-batches are in flight, yet the stages
    idle 43-47 % of the time, each long chunk holding a stage for ~50 decode steps while the
    other micro-batches' decodes wait behind it. prefill_stall names it with its evidence (the
    turns that fill the chunk, 171x the tokens of a decode round of 48) and --chunked-prefill-size
    8192 / 8 slots = 1024; that chunk, run in the simulator, gains over 30 % and leaves no stall
    (at seed 1 the queue it leaves, > 0.5 with every micro-batch at K, reads as K's there).
    Without the long prompts the same deployment has no finding."""
    from gputrace.sim.params import SCENARIOS
    mixed = dict(SCENARIOS["prefill-mixed"].overrides)
    a = _analysed(tmp_path / "mixed", {**mixed, "seed": seed})
    (found,) = a.findings
    assert found.cause == "prefill_stall" and found.phase == "C=48"
    ev = found.evidence
    assert ev["prefill_budget_tokens"] == 8192 and 0.05 <= ev["full_turn_share"] <= 0.3
    assert ev["chunk_tokens_per_decode_round"] >= 100 and ev["mean_bubble_fraction"] > 0.3
    assert ev["microbatches_in_flight"] == pytest.approx(8, abs=0.1) and ev["microbatch_slots"] == 8
    assert found.change is not None and found.change.flag == "--chunked-prefill-size"
    assert found.change.value == 1024 and found.recommendation.startswith("--chunked-prefill-size 1024")
    assert "8192-token chunk" in found.summary and "decode round" in found.summary
    (before,) = run_params(make_params({**mixed, "seed": seed}), log=False).ground_truth["phases"]
    (after,) = run_params(make_params({**mixed, "seed": seed, "chunked_prefill_size": 1024}),
                          log=False).ground_truth["phases"]
    assert before["causes"] == ["prefill_stall"] and "prefill_stall" not in after["causes"]
    assert after["throughput_tok_s"] > 1.3 * before["throughput_tok_s"]
    short_only = _analysed(tmp_path / "short", {**mixed, "seed": seed, "long_prompt_share": 0.0})
    assert not short_only.findings


def test_the_stall_is_said_in_each_engines_words() -> None:
    """The rule's line in the report's rule table names the chunk as the run's engine calls it:
    SGLang's --chunked-prefill-size, vLLM's --max-num-batched-tokens (a step's token budget,
    decode tokens and prefill chunks together)."""
    from gputrace.analysis.diagnose import rule_table
    sglang, vllm = (dict(rule_table(engine))["prefill_stall"] for engine in ("sglang", "vllm"))
    assert sglang.startswith("Long prefills stall the other micro-batches' decode")
    assert sglang.endswith("(--chunked-prefill-size)") and vllm.endswith("(--max-num-batched-tokens)")
