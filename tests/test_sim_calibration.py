"""The simulator against the measurements that motivated gputrace (PP8 on PCIe, max_running_requests
64, max_tokens 2048), under SGLang's real semantics: K bounds each micro-batch, the pool the engine.

Which figures the present (dense) cost model reproduces and which resist is said here, test by
test; the calibrated cost model of [sim] Must show 2 is not built yet.
"""

from __future__ import annotations

import pytest

from gputrace.sim import run_scenario
from gputrace.sim.outputs import parse_log

TOLERANCE = 0.15


@pytest.fixture(scope="module")
def default_run():
    return run_scenario("motivating", 0)


@pytest.fixture(scope="module")
def k64_run():
    return run_scenario("motivating", 0, {"pp_max_micro_batch_size": 64})


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


def test_k64_scales_to_about_400_tokens_per_second_at_c64(k64_run):
    """With --pp-max-micro-batch-size 64 throughput grows with C to about 400 tok/s at C=64 (396.0
    measured with max_tokens 2048)."""
    levels = [ph["throughput_tok_s"] for ph in k64_run.ground_truth["phases"]]
    assert levels == sorted(levels)
    assert levels[-1] == pytest.approx(396.0, rel=TOLERANCE)


@pytest.mark.xfail(strict=True, reason="[sim] MS2 open: the dense cost model resists C=32 at 248 tok/s "
                   "(4 micro-batches of 8 in 8 stages need a step of about 16 ms at batch 8 against "
                   "3.4 ms at batch 1); a calibrated MoE cost model is not built yet")
def test_c32_with_the_default_k_gives_about_248_tokens_per_second(default_run):
    assert _phase(default_run, "C=32")["throughput_tok_s"] == pytest.approx(248.0, rel=TOLERANCE)


@pytest.mark.xfail(strict=True, reason="[sim] MS2 open: K 8 and K 64 measured the same at C=32 (248 "
                   "and 250.9 tok/s): one micro-batch of 32 must cost what one of 8 does, which a "
                   "step cost linear past a knee (the present model) does not give")
def test_k8_and_k64_give_the_same_throughput_at_c32(default_run, k64_run):
    k8, k64 = _phase(default_run, "C=32")["throughput_tok_s"], _phase(k64_run, "C=32")["throughput_tok_s"]
    assert k64 == pytest.approx(k8, rel=TOLERANCE)
