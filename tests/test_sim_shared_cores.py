"""The simulator's stages sharing one host's cores (``shared_cores``: a CPU engine whose ranks,
server and client run on the same cores). On this machine SGLang at PP=2 measured C=16 (two
micro-batches of 4 in flight) at 60 tok/s against C=4's 90 (tests/data/engines/), and K=2 at C=4
below the defaults back to back (bench/whatif_engines.py): micro-batches in flight at once take
turns on the cores instead of overlapping as on separate GPUs."""

from __future__ import annotations

import pytest
from test_sim_vs_engines import CPU_ENGINE

from gputrace.errors import ConfigError
from gputrace.sim.engine import PipelineEngine
from gputrace.sim.params import make_params
from gputrace.whatif.fit import replay_outcomes, shared_core_candidates


def _engine(cores: float) -> PipelineEngine:
    return PipelineEngine(make_params({"pp_size": 2, "shared_cores": cores}))


@pytest.mark.parametrize(("cores", "end_s"), [(1.0, 2.0), (1.5, 1.75), (2.0, 1.5)])
def test_a_forward_runs_on_the_cores_the_forwards_placed_before_it_leave(cores: float, end_s: float) -> None:
    """Stage 1 computes over [0, 1] s; stage 0's forward of 1 s begun at 0.5 s: on one core it
    waits for the core (ends at 2), on 1.5 it runs at half speed until 1 s (ends at 1.75), on
    two it overlaps (ends at 1.5)."""
    engine = _engine(cores)
    assert engine._shared_end(1, 0.0, 0.0, 1.0) == 1.0
    assert engine._shared_end(0, 0.5, 0.5, 1.0) == pytest.approx(end_s)


def test_forwards_that_ended_are_forgotten() -> None:
    engine = _engine(1.0)
    engine._shared_end(1, 0.0, 0.0, 1.0)
    assert engine._shared_end(0, 1.0, 1.0, 1.0) == 1.0 + 1.0  # no wait: stage 1's ended at 1
    assert len(engine.placed[1]) == 0


def _tok_s(cores: float, k: int | None) -> list[float]:
    p = make_params({**CPU_ENGINE, "pp_max_micro_batch_size": k, "shared_cores": cores})
    return [o.throughput_tok_s or 0.0 for o in replay_outcomes(p, None)]


def test_on_shared_cores_more_micro_batches_in_flight_gain_nothing() -> None:
    """Separate devices: K=2 at C=4 (two micro-batches of 2 overlapping) gains on the default K=4,
    and C=16 (two of 4) about doubles C=4. One shared core: K=2 gains nothing at C=4 and costs
    C=16 (smaller batches, the same turns), and C=16 gains far less on C=4."""
    own_k4, own_k2 = _tok_s(0.0, None), _tok_s(0.0, 2)
    one_k4, one_k2 = _tok_s(1.0, None), _tok_s(1.0, 2)
    assert own_k2[1] > 1.08 * own_k4[1] and own_k4[2] > 1.7 * own_k4[1]
    assert one_k2[1] < 1.02 * one_k4[1] and one_k2[2] < 0.8 * one_k4[2]
    assert one_k4[2] < 1.6 * one_k4[1]
    assert one_k4[0] == pytest.approx(own_k4[0], rel=0.01)  # one request: nothing overlaps anyway


def test_shared_cores_below_one_are_refused() -> None:
    with pytest.raises(ConfigError, match="shared_cores"):
        make_params({"shared_cores": 0.5})


def test_the_fit_tries_one_core_up_to_one_a_stage() -> None:
    assert shared_core_candidates(1) == (0.0,)
    assert shared_core_candidates(2) == (1.0, 1.5, 0.0)
    assert shared_core_candidates(8)[0] == 1.0 and len(shared_core_candidates(8)) == 5


def test_a_queued_request_costs_rank_0_each_step() -> None:
    """``queued_request_s``: rank 0 works that long a step per request waiting in its queue. C=16
    over an admission limit of 8 queues 8: its throughput drops; C=1 and C=4 (no queue) keep
    theirs; a limit of 16 (no queue) is not charged."""
    plain = _tok_s(1.0, None)
    p = make_params({**CPU_ENGINE, "shared_cores": 1.0, "queued_request_s": 0.002})
    queued = [o.throughput_tok_s or 0.0 for o in replay_outcomes(p, None)]
    assert queued[0] == pytest.approx(plain[0], rel=0.01) and queued[1] == pytest.approx(plain[1], rel=0.03)
    assert queued[2] < 0.85 * plain[2]
    wide = make_params({**CPU_ENGINE, "shared_cores": 1.0, "queued_request_s": 0.002,
                        "max_running_requests": 16})
    unqueued = make_params({**CPU_ENGINE, "shared_cores": 1.0, "max_running_requests": 16})
    a, b = (replay_outcomes(x, None)[2].throughput_tok_s or 0.0 for x in (wide, unqueued))
    assert a == pytest.approx(b, rel=0.03)
