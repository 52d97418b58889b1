"""The simulator against the measurements that motivated gputrace (PP8 on PCIe, max_running_requests
64, max_tokens 2048), under SGLang's real semantics: K bounds each micro-batch, the pool the engine.

The closed-loop scenario runs on the simulator's default (dense) cost model; the measured bursts are
held to the calibrated cost model (gputrace.sim.params.KIMI_K26_PCIE_COST), as
`python bench/calibration.py` prints them.
"""

from __future__ import annotations

import pytest

from gputrace.sim import calibration, run_scenario
from gputrace.sim.outputs import parse_log
from gputrace.sim.params import KIMI_K26_PCIE_COST

TOLERANCE = 0.15


@pytest.fixture(scope="module")
def default_run():
    return run_scenario("motivating", 0)


@pytest.fixture(scope="module")
def k64_run():
    return run_scenario("motivating", 0, {"pp_max_micro_batch_size": 64}, log=False)  # its truth alone


def _phase(result, label):
    return next(ph for ph in result.ground_truth["phases"] if ph["label"] == label)


def test_scenarios_use_the_measured_settings(default_run):
    """The motivating runs are the real sweep: PP8 TP1, max_running_requests 64, max_tokens 2048."""
    p = default_run.params
    assert (p.pp_size, p.tp_size, p.max_running_requests, p.max_tokens) == (8, 1, 64, 2048)
    assert p.concurrency == (1, 8, 32, 64) and p.micro_batch_cap == 8


def test_single_request_decodes_at_about_37_tokens_per_second(default_run):
    """C=1 with the default K: about 37 tok/s for the one request (34.3 measured with K 8, 37.0
    with K 64)."""
    c1 = _phase(default_run, "C=1")
    assert c1["throughput_tok_s"] == pytest.approx(37.0, rel=TOLERANCE)


def test_c32_runs_every_request_in_micro_batches_of_eight(default_run):
    """C=32 with the default K of 8: all 32 run (the pool holds 64), in about 4 micro-batches of 8;
    each stage's #running-req 8 is one micro-batch, and nothing waits."""
    c32 = _phase(default_run, "C=32")
    assert c32["running_max"] == 32 and c32["queue_mean"] < 0.5
    assert 3.5 <= c32["microbatches_in_flight"] <= 5.0
    events, _, _ = parse_log(default_run)
    start, end = c32["start_ns"] + 10**9, c32["end_ns"]
    logged = [e for e in events if e.kind == "decode" and start < e.recv_ts_ns < end]
    assert {e.pp_rank for e in logged} == set(range(8))
    assert max(e.running_req for e in logged) == 8


def test_k64_scales_to_about_400_tokens_per_second_at_c64(k64_run, calibrated_rows):
    """With --pp-max-micro-batch-size 64 throughput grows with C, to about 400 tok/s at C=64 (396.0
    measured with max_tokens 2048) in the calibrated model. (The dense default gave 403 there
    only while a level's new requests missed the micro-batch stage 0 was waiting on and spread
    over the next slots; they join it, as SGLang takes requests in, and the dense model bunches:
    it is not the figures' model, test_the_dense_default_is_what_resists.)"""
    levels = [ph["throughput_tok_s"] for ph in k64_run.ground_truth["phases"]]
    assert levels == sorted(levels)
    assert calibrated_rows["C=64 K=64 2048 tok"].simulated_tok_s == pytest.approx(396.0, rel=TOLERANCE)


# The calibrated cost model ([sim] Must show 2): bench/calibration.py prints the same table.

@pytest.fixture(scope="module")
def calibrated_rows():
    return {row.figure.label: row for row in calibration.table(dict(KIMI_K26_PCIE_COST))}


def test_the_calibrated_model_gives_every_motivating_figure_within_15_percent(calibrated_rows):
    """Each measured burst, simulated with the calibrated cost model, within 15 %; of the two
    C=32 K=64 figures that contradict each other, the better one."""
    off = {label: round(row.ratio, 2) for label, row in calibrated_rows.items()
           if label not in calibration.CONFLICTING and abs(row.ratio - 1) > TOLERANCE}
    assert not off, off
    pair = [calibrated_rows[label].ratio for label in calibration.CONFLICTING]
    assert min(abs(r - 1) for r in pair) <= TOLERANCE, pair


def test_the_conflicting_pair_cannot_both_fit(calibrated_rows):
    """The stated reason, checked: the model makes the shorter burst at least as fast per token as
    the longer one (the longer holds more context and KV), where the measurement says 187.7
    against 250.9; so the 2048-token figure is the one that resists."""
    long_, short = (calibrated_rows[label] for label in calibration.CONFLICTING)
    assert short.simulated_tok_s >= long_.simulated_tok_s
    assert short.figure.measured_tok_s < long_.figure.measured_tok_s


def test_c32_lands_in_four_micro_batches_whatever_k_allows(calibrated_rows):
    """K 8 and K 64 measured the same at C=32 (248 and 250.9 tok/s): the prefill budget (8,192
    tokens) takes 8 prompts of 1,024 per turn, so the burst spreads over 4 micro-batches of 8 under
    K 64 as under K 8 (the same burst of 512 tokens simulated under both)."""
    k8 = calibrated_rows["C=32 K=8 512 tok"]
    k64 = calibration.simulate(calibration.Figure("C=32 K=64 512 tok", 32, 64, 512, 248.0),
                               dict(KIMI_K26_PCIE_COST))
    assert k8.microbatches == pytest.approx(4, abs=0.1)
    assert k64.microbatches == pytest.approx(4, abs=0.1)
    assert k64.simulated_tok_s == pytest.approx(k8.simulated_tok_s, rel=0.02)


def test_the_dense_default_is_what_resists():
    """The simulator's default (dense, 128-token prompts) cost model does not give the figures:
    the calibration is the fitted model's, not the default's."""
    rows = calibration.table({})
    assert not calibration.within(rows)
