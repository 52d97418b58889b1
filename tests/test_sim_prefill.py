"""The simulator's prefill turns as SGLang 0.5.23 schedules them (scheduler.py
get_new_batch_prefill, schedule_policy.py PrefillAdder): one chunked request per scheduler, whose
next chunk whichever slot runs next takes first; after its last chunk the same turn admits waiting
requests while the token budget lasts; a request joins the slot that computes its last chunk."""

from __future__ import annotations

from typing import Any

import pytest

from gputrace.errors import ConfigError
from gputrace.sim.engine import PipelineEngine, SimRequest
from gputrace.sim.params import make_params
from gputrace.sim.virtual import run_params

PrefillLine = tuple[float, int, dict[str, Any]]


def _prefill_turns(values: dict[str, Any], prompts: list[int]
                   ) -> tuple[PipelineEngine, list[dict[str, Any]]]:
    """Stage 0's prefill lines of an engine given ``prompts`` at t = 0, its first half second (the
    prefills take a few tens of ms; the 4,096 tokens out each keep the requests in their slots)."""
    lines: list[PrefillLine] = []
    def on_log(t: float, rank: int, kind: str, f: dict[str, Any]) -> None:
        if kind == "prefill":
            lines.append((t, rank, f))

    engine = PipelineEngine(make_params({"pp_size": 2, "max_running_requests": 16, **values}), on_log=on_log)
    for i, n in enumerate(prompts):
        engine.add_arrival(SimRequest(i, 0.0, n, 4096))
    engine.run_until(0.5)
    return engine, [f for _, rank, f in lines if rank == 0]


def test_one_chunked_request_per_scheduler_its_chunks_in_consecutive_slots() -> None:
    """Two 1,000-token prompts with a 256-token chunk: SGLang cuts the first into chunks that
    the next slot takes in turn (256 each, one request per turn), and the second waits until the
    first's last chunk, which leaves 24 tokens of the budget for it (the old model chunked both at
    once, each in its own slot, 256 + 256 in two slots' turns, then only after a round trip each)."""
    engine, turns = _prefill_turns({"chunked_prefill_size": 256}, [1000, 1000])
    assert [(t["new_seq"], t["new_token"]) for t in turns] == [
        (1, 256), (1, 256), (1, 256), (2, 256),  # 232 ends the first, 24 start the second
        (1, 256), (1, 256), (1, 256), (1, 208)]
    assert engine.chunked is None and sorted(len(s) for s in engine.slots) in ([0, 2], [1, 1])


def test_the_last_chunk_joins_the_slot_that_computes_it_and_admits_with_what_is_left() -> None:
    """A 600-token prompt and three of 100 with a 512 chunk: turn 1 cuts the long one (512), turn 2
    (the other slot) ends it (88) and admits the three whole (300 of the 424 left): all four run
    in that slot."""
    engine, turns = _prefill_turns({"chunked_prefill_size": 512}, [600, 100, 100, 100])
    assert [(t["new_seq"], t["new_token"], t["running_req"]) for t in turns[:2]] == [(1, 512, 0), (4, 388, 0)]
    assert sorted(len(s) for s in engine.slots) == [0, 4]
    # K counts the request that ends its chunks in the turn (SGLang's len(can_run_list)): at K = 2
    # it takes one more there, the other two go to the next slot
    engine, turns = _prefill_turns({"chunked_prefill_size": 512, "pp_max_micro_batch_size": 2},
                                   [600, 100, 100, 100])
    assert [(t["new_seq"], t["new_token"]) for t in turns[:3]] == [(1, 512), (2, 188), (2, 200)]
    assert sorted(len(s) for s in engine.slots) == [2, 2]


def test_max_prefill_tokens_stops_admission_but_cuts_no_prompt() -> None:
    """SGLang's rem_input_tokens (max_prefill_tokens) only stops the loop once spent; the cut is
    rem_chunk_tokens' (chunked_prefill_size): 3 prompts of 700 under a 1,000 max_prefill_tokens and
    an 8,192 chunk run 2 whole per turn (1,400 tokens), never cut."""
    _, turns = _prefill_turns({"chunked_prefill_size": 8192, "max_prefill_tokens": 1000}, [700, 700, 700])
    assert [(t["new_seq"], t["new_token"]) for t in turns] == [(2, 1400), (1, 700)]


# The engine tier's SGLang on this machine's CPU (PP2, the tiny model): a forward costs about the
# same whatever it carries up to a few hundred tokens (measured here, 2 cores shared with other
# work: a 256-token chunk's turn ~0.33 s, a decode step of 4 ~0.3 s, a 4,096-token turn ~1.5 s), and
# its stages share the cores. In those units (seconds of that machine):
CPU_LONG_PROMPTS: dict[str, Any] = {
    "pp_size": 2, "max_running_requests": 16, "concurrency": (8,), "phase_s": 300.0, "drain_s": 5.0,
    "input_tokens": 1425, "input_tokens_jitter": 0.333, "max_tokens": 32, "context_len": 2048,
    "max_total_num_tokens": 16384, "decode_log_interval": 1, "synchronous_forward": True,
    "shared_cores": 1.0, "launch_s": 0.0, "weight_read_s": 0.25, "decode_token_s": 0.01,
    "prefill_token_s": 1e-4, "client_latency_s": 0.002}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_larger_chunk_gains_with_long_prompts_as_the_engine_measured(seed: int) -> None:
    """[prefill] The real SGLang 0.5.23 (PP2 on the CPU, prompts 950-1,900 tokens, closed loop C=8)
    gained x2.06 from --chunked-prefill-size 256 -> 4096 (issue 47's pairs x1.38, x2.39, x2.06; x1.98
    rerun here), with 1.85 requests waiting at 256. The simulator: a gain of x1.5-1.8 (x1.70 at
    seeds 0-2), and at 256 more than one request waiting (1.5): one chunked request at a time holds
    the others in the queue. Scheduling each slot's own chunk at once (the model before) kept the
    queue at 0.4."""
    small, large = (run_params(make_params({**CPU_LONG_PROMPTS, "chunked_prefill_size": chunk, "seed": seed}),
                               log=False) for chunk in (256, 4096))
    (ps,), (pl,) = small.ground_truth["phases"], large.ground_truth["phases"]
    gain = pl["throughput_tok_s"] / ps["throughput_tok_s"]
    assert 1.5 <= gain <= 2.3, gain
    assert ps["queue_mean"] > 1.0 and pl["queue_mean"] < 0.5, (ps["queue_mean"], pl["queue_mean"])


def test_a_mixed_load_sends_long_prompts_at_its_share_and_leaves_other_loads_drawn_as_before() -> None:
    """long_prompt_share: that share of the requests send long_input_tokens (jittered as the
    others), the rest input_tokens; a load without it draws exactly as before (no extra draw, so
    every scenario's seeds keep their requests)."""
    mixed = run_params(make_params({"pp_size": 2, "max_running_requests": 16, "concurrency": (8,),
                                    "phase_s": 30.0, "max_tokens": 16, "input_tokens": 256,
                                    "input_tokens_jitter": 0.1, "long_prompt_share": 0.2,
                                    "long_input_tokens": 4096}), log=False)
    prompts = [r.input_tokens for r in mixed.requests]
    long = [n for n in prompts if n > 1000]
    assert len(prompts) > 200 and 0.15 <= len(long) / len(prompts) <= 0.25
    assert all(3686 <= n <= 4506 for n in long) and all(230 <= n <= 282 for n in prompts if n <= 1000)
    plain = {"pp_size": 2, "concurrency": (4,), "phase_s": 5.0, "input_tokens_jitter": 0.3}
    before, after = (run_params(make_params({**plain, **extra}), log=False)
                     for extra in ({}, {"long_input_tokens": 4096}))
    assert [r.input_tokens for r in before.requests] == [r.input_tokens for r in after.requests]
    with pytest.raises(ConfigError, match="long_input_tokens"):
        make_params({"long_prompt_share": 0.1})
