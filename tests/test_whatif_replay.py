"""The what-if's replay driver (gputrace.whatif.replay): a phase stops once its throughput has
settled and states the whole phase's figure; replays are shared within a session, also between
settings that differ only where neither bound."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gputrace.analyse import analyse_run
from gputrace.sim.outputs import write_store
from gputrace.sim.params import KIMI_K26_PCIE_COST, SimParams, make_params, scenario_params
from gputrace.sim.simulate import simulate
from gputrace.store import Store
from gputrace.whatif.fit import fit_model, replay_outcomes
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


# The demo's live C=32 burst as its client sent it (seconds after the first), after a level of one
LIVE_OFFSETS_S = (0.0, 0.0, 0.00036, 0.00086, 0.00097, 0.00106, 0.00116, 0.00124, 0.00132, 0.00139, 0.00146,
                  0.00153, 0.0016, *(0.0243 + 0.00006 * i for i in range(20)))


def _burst_params(**overrides: object) -> SimParams:
    return scenario_params("motivating", {
        **KIMI_K26_PCIE_COST, "client_mode": "burst", "concurrency": (1, 32), "max_tokens": 64,
        "phase_s": 600.0, "drain_s": 0.0, "burst_offsets_s": LIVE_OFFSETS_S, **overrides})


def test_a_burst_sent_over_a_few_ms_lands_as_sent() -> None:
    """A burst whose requests go out over 25 ms, after a level of one: the engine's first prefill
    turn takes the first request alone, the next turns the budget's 8 (the live engine's 1, 7, 8,
    8, 8), and K=64 lets the turn after the lone one fill its micro-batch to 9. (The next level
    used to go out at the previous one's end while the engine's clock had run up to 20 ms past
    it: the burst landed at once in the engine's past, 8 in its first turn.)"""
    for seed in (0, 1):
        tr = simulate(_burst_params(seed=seed), "burst", log=False).engine.trace
        assert list(tr.pf_n) == [1024, 1024, 7168, 8192, 8192, 8192], (seed, list(tr.pf_n))
    tr = simulate(_burst_params(pp_max_micro_batch_size=64), "burst", log=False).engine.trace
    assert list(tr.pf_n) == [1024, 1024, 8192, 8192, 8192, 7168]


def test_a_burst_load_is_replayed_as_its_client_sent_it(tmp_path: Path) -> None:
    """The what-if fitted to a captured burst load sends each level's requests when the client
    did (after the level's first), so its replay's prefill turns are the run's."""
    run = simulate(_burst_params(), "burst")
    store_dir = write_store(run, tmp_path / "run", "burst")
    with Store.open(store_dir, read_only=True) as store:
        model = fit_model(analyse_run(store, effects=False))
    offsets = model.params.burst_offsets_s
    assert len(offsets) == 33 and offsets[0] == 0.0
    assert offsets[1:] == pytest.approx(LIVE_OFFSETS_S[1:], abs=2e-6)
    replayed = run_replay(model.params).result.engine.trace
    assert list(replayed.pf_n) == list(run.engine.trace.pf_n) == [1024, 1024, 7168, 8192, 8192, 8192]
