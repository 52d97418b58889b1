"""The simulator against the measurements that motivated gputrace (PP8 on PCIe, max_tokens 2048)."""

from __future__ import annotations

import pytest

from gputrace.sim import run_scenario
from gputrace.sim.outputs import parse_log

TOLERANCE = 0.15


@pytest.fixture(scope="module")
def cap_run():
    return run_scenario("microbatch-cap", 0)


def _phase(result, label):
    return next(ph for ph in result.ground_truth["phases"] if ph["label"] == label)


def test_scenarios_use_the_measured_settings(cap_run):
    """The calibrated runs are the real sweep: PP8 TP1, max_running_requests 64, max_tokens 2048."""
    p = cap_run.params
    assert (p.pp_size, p.tp_size, p.max_running_requests, p.max_tokens) == (8, 1, 64, 2048)
    assert p.concurrency == (1, 8, 32, 64) and p.micro_batch_cap == 8


def test_single_request_decodes_at_about_37_tokens_per_second(cap_run):
    """C=1 under the default cap: about 37 tok/s for the one request."""
    c1 = _phase(cap_run, "C=1")
    assert c1["throughput_tok_s"] == pytest.approx(37.0, rel=TOLERANCE)


def test_cap_holds_c32_at_about_250_tokens_per_second_with_8_running(cap_run):
    """C=32 under the default cap: about 250 tok/s and #running-req: 8 on every stage's log."""
    c32 = _phase(cap_run, "C=32")
    assert c32["throughput_tok_s"] == pytest.approx(250.0, rel=TOLERANCE)
    events, _, _ = parse_log(cap_run)
    start, end = c32["start_ns"] + 10**9, c32["end_ns"]
    logged = [e for e in events if e.kind == "decode" and start < e.recv_ts_ns < end]
    assert {e.pp_rank for e in logged} == set(range(8))
    assert {e.running_req for e in logged} == {8}


def test_fix_scales_to_about_400_tokens_per_second_at_c64(cap_run):
    """With --pp-max-micro-batch-size 64 throughput grows with C to about 400 tok/s at C=64."""
    fixed = run_scenario("microbatch-fixed", 0)
    levels = [ph["throughput_tok_s"] for ph in fixed.ground_truth["phases"]]
    assert levels == sorted(levels)
    assert levels[-1] == pytest.approx(400.0, rel=TOLERANCE)
    assert levels[-1] > 1.4 * _phase(cap_run, "C=64")["throughput_tok_s"]
