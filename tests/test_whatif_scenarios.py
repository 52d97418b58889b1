"""The what-if model against the simulator, scenario by scenario: each scenario's fix and the other
changes predicted within 10 % of the simulator run at the changed setting (Must show 1 at seed 0;
bench/whatif.py runs 3 seeds). A test per scenario and per change (one test of them all took
133-257 s); a module apart from test_whatif.py, so make test's parallel pass (a module per worker)
runs them beside it."""

from __future__ import annotations

import pytest

from gputrace.sim.params import SCENARIOS
from gputrace.whatif.groundtruth import OTHER_CHANGES, format_table, score_change, score_fixes

WITHIN = 0.10  # predicted throughput within 10 % of the simulator's

MUST_FIX = ("microbatch-cap", "pool-bound", "bunched", "stage-imbalance", "client-bound", "kv-bound",
            "pcie-bound", "vllm-admission")


# Where the fitted model cannot yet predict a prefill change (issue 47, "the model learns the step
# from the run"): measured on seed 0, the fix's gain predicted far short of the simulator's. (The
# prompt token's cost is fitted apart from the decode token's now, by the requests' TTFT: 2.14e-4 s
# a stage in truth, 2.11e-4 fitted; what is left is the decode step's shape.)
PREFILL_FIT_GAPS = {
    "prefill-burst": "the fit's dense step does not hold the MoE cost (experts read per token) of "
                     "the motivating deployment: a decode step of 4 costs 0.6 of one of 8 there, the "
                     "same under the dense floor: --max-prefill-tokens 3584 predicted 297 tok/s, 390 run",
}


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=[pytest.mark.xfail(strict=True, reason=PREFILL_FIT_GAPS[name])]
                 if name in PREFILL_FIT_GAPS else [])
    for name, scenario in SCENARIOS.items() if scenario.causes])
def test_each_scenarios_fix_within_ten_percent(name: str) -> None:
    """Each scenario's fix (truth.fix_for), predicted within 10 % of the simulator at the fix."""
    scores = score_fixes(name, 0)
    print("\n".join(format_table(scores)))
    assert name not in MUST_FIX or any(s.change.startswith("fix") for s in scores), scores
    bad = [s for s in scores if abs(s.error_ratio) >= WITHIN]
    assert not bad, bad


def test_every_scenario_that_must_have_a_fix_is_scored() -> None:
    assert set(MUST_FIX) <= {name for name, scenario in SCENARIOS.items() if scenario.causes}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "change"), OTHER_CHANGES,
                         ids=[f"{name}-{next(iter(change))}" for name, change in OTHER_CHANGES])
def test_other_changes_within_ten_percent(name: str, change: dict[str, object]) -> None:
    """K, max_running_requests and concurrency changes beside the fixes, predicted within 10 %."""
    scores = score_change(name, 0, change)
    print("\n".join(format_table(scores)))
    bad = [s for s in scores if abs(s.error_ratio) >= WITHIN]
    assert not bad, bad


@pytest.mark.slow
def test_the_kv_bound_fix_within_ten_percent_over_seeds() -> None:
    """kv-bound's larger KV cache (its phases queue for KV, prefills run behind the requests the
    phase started) predicted within 10 % at seeds 1 and 2 too."""
    scores = score_fixes("kv-bound", 1) + score_fixes("kv-bound", 2)
    print("\n".join(format_table(scores)))
    assert {s.phase for s in scores} == {"C=32", "C=64"}
    assert all(abs(s.error_ratio) < WITHIN for s in scores), scores
