"""The what-if's replay driver (gputrace.whatif.replay): a phase stops once its throughput has
settled and states the whole phase's figure; replays are shared within a session, also between
settings that differ only where neither bound."""

from __future__ import annotations

import dataclasses

from gputrace.sim.params import make_params
from gputrace.sim.simulate import simulate
from gputrace.whatif.fit import replay_outcomes
from gputrace.whatif.outcome import PhaseOutcome, trace_outcomes
from gputrace.whatif.replay import SETTLE_TOLERANCE, replay_session, run_replay


def test_a_settled_phase_stops_early_and_states_the_whole_phase() -> None:
    """Short requests under a steady closed loop: every phase stops well before its 60 s, and its
    throughput is the full replay's within the settling tolerance (and a bit of the last span)."""
    p = make_params({"concurrency": (4, 16), "phase_s": 60.0, "max_tokens": 64, "input_tokens": 128})
    ran = run_replay(p)
    assert all(ph.rest_tok_s is not None and ph.stop_s - ph.start_s < 30.0 for ph in ran.phases)
    short = trace_outcomes(ran.result, None, [(ph.rest_s, ph.rest_tok_s) for ph in ran.phases])
    full = trace_outcomes(simulate(dataclasses.replace(p, seed=0), "whatif", log=False))
    for s, f in zip(short, full, strict=True):
        assert s.throughput_tok_s is not None and f.throughput_tok_s is not None
        assert abs(s.throughput_tok_s / f.throughput_tok_s - 1) <= 2 * SETTLE_TOLERANCE, (s, f)
    assert sum(len(r.result.engine.trace.step_reqs) for r in [ran]) < \
        len(simulate(p, "whatif", log=False).engine.trace.step_reqs) / 2


def test_a_phase_that_never_settles_runs_whole() -> None:
    """A phase shorter than two settling spans runs its whole length, with nothing extrapolated."""
    p = make_params({"concurrency": (8,), "phase_s": 6.0, "max_tokens": 512})
    ran = run_replay(p)
    assert [(ph.stop_s, ph.rest_tok_s) for ph in ran.phases] == [(6.0, None)]


def test_replays_are_shared_in_a_session_where_the_change_cannot_bind() -> None:
    """The same parameters replay once per session; a pool raised above what the replay ran, or
    a prefill budget above the largest step's prompt, replays exactly as the run (checked against
    a replay outside the session) and is shared; a pool that binds is replayed."""
    p = make_params({"concurrency": (4, 16), "phase_s": 20.0, "max_tokens": 64,
                     "pp_max_micro_batch_size": 2, "max_running_requests": 64})
    raised = dataclasses.replace(p, max_running_requests=128, chunked_prefill_size=4096)
    bound = dataclasses.replace(p, max_running_requests=8)
    with replay_session() as stats:
        as_run = replay_outcomes(p, None)
        assert replay_outcomes(p, None) == as_run
        shared = replay_outcomes(raised, None)
        assert (stats.replays, stats.cached) == (1, 2)
        replay_outcomes(bound, None)
        assert (stats.replays, stats.cached) == (2, 2)
        assert stats.steps > 0 and "2 replays (2 shared)" in stats.text()
    assert shared == replay_outcomes(raised, None)  # outside the session: its own replay
    assert replay_outcomes(bound, None) != as_run


def _without_latencies(outcomes: list[PhaseOutcome]) -> list[PhaseOutcome]:
    return [dataclasses.replace(o, ttft_s_p50=None, ttft_s_p90=None, itl_s_p50=None, itl_s_p90=None)
            for o in outcomes]


def test_an_undrained_replay_states_the_drained_replays_throughput_bubbles_and_batches() -> None:
    """A screening replay that states no latency ends with its last phase (drain_s 0): each phase's
    throughput, bubble per stage and micro-batch sizes are the drained replay's exactly, for far
    fewer steps (a small KV cache and a bound pool both hold requests waiting when the last
    phase ends, which only the drain would serve)."""
    for overrides in ({"max_total_num_tokens": 6000, "max_tokens": 900, "input_tokens_jitter": 0.3},
                      {"max_running_requests": 12, "max_tokens": 600}):
        p = make_params({"concurrency": (4, 16), "phase_s": 20.0, "drain_s": 30.0, **overrides})
        drained, undrained = run_replay(p, 1), run_replay(dataclasses.replace(p, drain_s=0.0), 1)
        assert undrained.result.engine.waiting or undrained.result.engine.running
        outcomes = [_without_latencies(trace_outcomes(r.result, None, [(ph.rest_s, ph.rest_tok_s)
                                                                       for ph in r.phases]))
                    for r in (drained, undrained)]
        assert outcomes[0] == outcomes[1]
        assert len(undrained.result.engine.trace.step_reqs) < 0.8 * len(drained.result.engine.trace.step_reqs)
