"""[advisor] The advice: the search over the engine's settings, its objectives and its verdict;
on simulator ground truth (Must show 2: every scenario x 3 seeds, as bench/advisor.py prints it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import cli

from gputrace.analysis.diagnose import Finding
from gputrace.errors import UsageError
from gputrace.sim.outputs import write_store
from gputrace.sim.params import SCENARIOS, SimParams
from gputrace.sim.virtual import run_scenario
from gputrace.vocabulary import Cause, Change
from gputrace.whatif.advise import (
    MAX_CANDIDATES,
    AdvisedSetting,
    Option,
    PhaseAdvice,
    candidates,
    fewest_changes_within_band,
    parse_slo,
    score,
)
from gputrace.whatif.fit import FittedModel
from gputrace.whatif.groundtruth import format_advice_table, score_advice
from gputrace.whatif.outcome import PhaseOutcome


def _model(levels: tuple[int, ...] = (1, 8, 32, 64)) -> FittedModel:
    measured = [PhaseOutcome(f"C={c}", c, 30.0 * c, None, None, None, None, (), 8.0, 8.0) for c in levels]
    return FittedModel(SimParams(concurrency=levels), measured, measured, 0.03)


def _finding(cause: Cause, phase: str, change: Change) -> Finding:
    """A finding as the rules make it, with the change it recommends (the rest does not matter here)."""
    return Finding(cause, phase, [], {}, 1.0, "", "", change=change)


def test_parse_slo() -> None:
    assert parse_slo("ttft_p90=2s,itl_p90=80ms") == {"ttft_p90": 2.0, "itl_p90": pytest.approx(0.08)}
    assert parse_slo(None) == {}
    for bad in ("ttft=2s", "itl_p90=fast", "ttft_p90=0s"):
        with pytest.raises(UsageError):
            parse_slo(bad)


def test_candidates_are_configuration_changes_around_the_run_bounded() -> None:
    """A finding about the offered load is never a configuration candidate; K, the pool, the
    prefill chunk and the async depth are searched around the run's settings."""
    findings = [
        _finding(Cause.PIPELINE_UNDERFILLED, "C=1", Change.of_flag("concurrency", 8)),
        _finding(Cause.CLIENT_BOUND, "C=64", Change.of_flag("client", 64)),
        _finding(Cause.PIPELINE_UNDERFILLED, "C=32", Change.of_flag("--pp-max-micro-batch-size", 4)),
    ]
    pool = candidates(_model(), findings)
    changes = [c for c, _ in pool]
    assert changes[0] == {"pp_max_micro_batch_size": 4}
    assert pool[0][1] == "finding: pipeline_underfilled at C=32"
    assert not any("concurrency" in c or "client_max_inflight" in c for c in changes)
    knobs = {k for c in changes for k in c}
    assert {"pp_max_micro_batch_size", "max_running_requests", "chunked_prefill_size",
            "pp_async_batch_depth"} <= knobs
    assert len(pool) <= MAX_CANDIDATES


def _option(gains: dict[str, float], band: float = 0.05) -> Option:
    phases = tuple(PhaseAdvice(label, int(label[2:]), 10.0, 100.0, 100.0, 100.0 * (1 + g), band, None, None)
                   for label, g in gains.items())
    return Option((), phases, "test")


def test_objectives() -> None:
    """Default: no phase lost beyond its band and a gain beyond it somewhere; peak: the highest
    level; slo: every phase within it."""
    trade = _option({"C=8": 0.2, "C=64": -0.4})
    clean = _option({"C=8": 0.1, "C=64": 0.0})
    inside = _option({"C=8": 0.04, "C=64": 0.0})
    assert score(trade, "throughput", {}) is None
    assert score(clean, "throughput", {}) == pytest.approx(5.0)
    assert score(inside, "throughput", {}) is None  # inside the band: no clear gain
    assert score(_option({"C=8": -0.5, "C=64": 0.2}), "peak", {}) == pytest.approx(20.0)
    slow = Option((), tuple(p.__class__(p.phase, p.concurrency, p.duration_s, p.measured_tok_s,
                                        p.unchanged_tok_s, p.predicted_tok_s, p.band_ratio, 3.0, 0.05)
                            for p in clean.phases), "test")
    assert score(slow, "slo", {"ttft_p90": 2.0}) is None
    assert score(slow, "slo", {"ttft_p90": 4.0}) == pytest.approx(5.0)


def test_a_setting_is_advised_only_where_its_own_effect_is_beyond_the_band() -> None:
    """A pair predicted above one of its settings alone by less than the band on the objective's
    figure is not advised: the setting alone is (the model cannot tell what the second adds);
    beyond the band, the pair is. One phase beyond its band is not enough where the objective
    weighs the others (kv-bound seed 1: +5.4 % at C=32, nothing at C=64)."""
    kv = AdvisedSetting("max_total_num_tokens", "--max-total-tokens", 314421)
    chunk = AdvisedSetting("chunked_prefill_size", "--chunked-prefill-size", 4096)

    def option(changes: tuple[AdvisedSetting, ...], gains: dict[str, float]) -> Option:
        return Option(changes, _option(gains, band=0.03).phases, "test")

    alone = option((kv,), {"C=32": 0.417, "C=64": 1.106})
    within = option((kv, chunk), {"C=32": 0.441, "C=64": 1.123})  # +1.7 % and +0.8 % on alone
    one_phase = option((kv, chunk), {"C=32": 0.50, "C=64": 1.106})  # +5.8 % at C=32: +2.3 % weighted
    beyond = option((kv, chunk), {"C=32": 0.60, "C=64": 1.15})  # +12.9 % and +2.1 %: +6.3 % weighted
    other = option((chunk,), {"C=32": 0.3, "C=64": 0.2})
    assert fewest_changes_within_band([within, other, alone]) is alone
    assert fewest_changes_within_band([one_phase, other, alone]) is alone
    assert fewest_changes_within_band([beyond, other, alone]) is beyond
    assert fewest_changes_within_band([within, other]) is within  # no part of it was predicted
    # peak: the highest level's figure alone (+0 % at C=64 there)
    assert fewest_changes_within_band([one_phase, other, alone], "peak") is alone
    peak_beyond = option((kv, chunk), {"C=32": 0.417, "C=64": 1.20})  # +4.5 % at C=64
    assert fewest_changes_within_band([peak_beyond, other, alone], "peak") is peak_beyond


def test_kv_bound_is_advised_the_kv_size_alone_where_the_pair_is_inside_the_band() -> None:
    """kv-bound seed 2: the model put the KV size with --chunked-prefill-size 4096 2 % above the
    KV size alone (band 3 %); the simulator gave the pair 2 % less. The advice is the KV size
    alone, and in the simulator it gains as much as the best finding's change."""
    s = score_advice("kv-bound", 2)
    assert s.advice.startswith("--max-total-tokens") and "--chunked-prefill-size" not in s.advice, s
    assert s.ok and s.advice_gain_tok_s >= s.best_finding_gain_tok_s > 0, s


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_scenarios_advice_gains_at_least_the_best_findings_change(scenario: str) -> None:
    """[advisor] Must show 2: the advice, applied by running the simulator at the advised setting
    (not the fitted model), gains at least as much as the best single finding's change on the
    default objective and loses no phase beyond its band, for each seed; the table is printed."""
    scores = [score_advice(scenario, seed) for seed in (0, 1, 2)]
    print("\n" + "\n".join(format_advice_table(scores)))
    for s in scores:
        assert s.ok, s  # no phase lost beyond its band, and at least the best finding's gain


@pytest.mark.slow
def test_advice_on_ground_truth_and_whatif_search(tmp_path: Path) -> None:
    """pool-bound (a pool of 32 under 64 requests): the advice, run in the simulator, gains at
    least as much as the best finding's change and loses no phase beyond its band; `whatif
    --search` prints the same advice with the model's replay of the run within 5 %."""
    s = score_advice("pool-bound", 0)
    assert s.ok and s.advice_gain_tok_s > 0, s
    assert "--max-running-requests" in s.advice
    run = write_store(run_scenario("pool-bound", 0), tmp_path / "run")
    done = cli(["whatif", str(run), "--search", "--format", "json"])
    assert done.exit_code == 0, done.output
    doc = json.loads(done.output[done.output.index("{"):])
    assert doc["changes"] and doc["changes"][0]["flag"] == "--max-running-requests"
    for p in doc["phases"]:
        assert abs(p["unchanged_tok_s"] / p["measured_tok_s"] - 1) <= 0.05
        assert p["predicted_tok_s"] > p["measured_tok_s"] * (1 + p["band_ratio"])
    bad = cli(["whatif", str(run), "--objective", "peak"])
    assert bad.exit_code != 0 and "--search" in bad.output + str(bad.exception)


def test_the_prefill_budget_is_searched_up_to_the_context_length_and_beside_k_and_the_pool() -> None:
    """[prefill] The search tries the prefill budget from the run's up to the context length,
    log-spaced (SGLang's chunk with the turn budget raised to it; vLLM's max_num_batched_tokens
    in vLLM's words), a finding's --max-prefill-tokens in SGLang's words, and the best budget in
    pairs with the best K and the best pool (issue 47: the search never tried a chunk past 512,
    where 4096 measured x2.06)."""
    from gputrace.whatif.advise import changes_of, prefill_pairs
    sglang = FittedModel(SimParams(concurrency=(8,), chunked_prefill_size=256, max_prefill_tokens=4096,
                                   context_len=2048), _model((8,)).measured, _model((8,)).measured, 0.03)
    burst = _finding(Cause.PREFILL_BURST, "C=8", Change.of_flag("--max-prefill-tokens", 3584))
    pool = [c for c, _ in candidates(sglang, [burst])]
    assert pool[0] == {"max_prefill_tokens": 3584}
    assert [a.text() for a in changes_of(sglang, pool[0]) or ()] == ["--max-prefill-tokens 3584"]
    chunks = sorted(c["chunked_prefill_size"] for c in pool if "chunked_prefill_size" in c)
    assert chunks == [128, 512, 1024, 2048]
    assert [a.text() for a in changes_of(sglang, {"chunked_prefill_size": 8192, "max_prefill_tokens": 8192})
            or ()] == ["--chunked-prefill-size 8192", "--max-prefill-tokens 8192"]
    vllm = FittedModel(SimParams(engine="vllm", concurrency=(8,), chunked_prefill_size=256,
                                 max_prefill_tokens=256, context_len=2048),
                       _model((8,)).measured, _model((8,)).measured, 0.03)
    budgets = [c for c, _ in candidates(vllm, []) if "chunked_prefill_size" in c]
    assert sorted(c["chunked_prefill_size"] for c in budgets) == [128, 512, 1024, 2048]
    assert all(c["max_prefill_tokens"] == c["chunked_prefill_size"] for c in budgets)
    assert [a.text() for a in changes_of(vllm, budgets[-1]) or ()] == ["--max-num-batched-tokens 2048"]

    def single(change: dict[str, object], gain: float) -> tuple[dict[str, object], Option]:
        return change, _option({"C=8": gain})

    singles = [single({"chunked_prefill_size": 1024, "max_prefill_tokens": 4096}, 0.9),
               single({"chunked_prefill_size": 512, "max_prefill_tokens": 4096}, 0.5),
               single({"pp_max_micro_batch_size": 2}, -0.1), single({"pp_max_micro_batch_size": 8}, 0.05),
               single({"max_running_requests": 32}, 0.0), single({"pp_async_batch_depth": 1}, 0.2)]
    assert prefill_pairs(singles) == [
        {"chunked_prefill_size": 1024, "max_prefill_tokens": 4096, "pp_max_micro_batch_size": 8},
        {"chunked_prefill_size": 1024, "max_prefill_tokens": 4096, "max_running_requests": 32}]
