"""The simulator's scheduling against the real engines' ([sim] Must show 1): run with the recorded
fixtures' settings (PP2, admission limit 8, K default and 16, C = 1, 4, 16, 32-token requests),
its per-micro-batch `#running-req` and its `#queue-req` must look like SGLang 0.5.23's own lines
(tests/data/engines/). Speed is not compared (CPU against the cost model).

Measured on the fixtures (PP0's decode lines, last three quarters of each level):
SGLang K=4 (default): C=1 all 1; C=4 sizes 1, 3 and 4 (p10 1, p50 3, p90 4); C=16 all 4, queue
7.9. SGLang K=16: C=16 alternates micro-batches of 7 and 1, queue 7.9.

What makes the simulator schedule so: SGLang's per-micro-batch admission (cap_scope="microbatch")
and, on the CPU, a forward that runs inside rank 0's loop (synchronous_forward): requests that
arrive while rank 0 computes one slot go to the next slot it visits, which spreads C=4 over both
slots; with K=16 the 8 freed rows return to the slot they left, keeping 7 and 1. Without the
synchronous forward (a GPU's asynchronous launch) C=4 stays in one slot. The CPU costs below make
the simulator's C=1 speed about the engine's (35 against 38.7 tok/s); nothing else is fitted."""

from __future__ import annotations

import collections
import datetime as dt
import json
import re
from dataclasses import fields

import numpy as np
import pytest
from engine_fixtures import fixture_dir

from gputrace.sim import run_scenario
from gputrace.sim.params import SimParams

DECODE_PP0 = re.compile(r"PP0\] Decode batch, #running-req: (\d+),.*#queue-req: (\d+)")
LEVELS = ("C=1", "C=4", "C=16")


def _settled(spans: list[tuple[str, int, int]]) -> dict[str, tuple[int, int]]:
    """Each level's last three quarters (the first quarter fills the engine)."""
    return {label: (lo + (hi - lo) // 4, hi) for label, lo, hi in spans}


def _shape(sizes: list[int], queues: list[int]) -> dict[str, float]:
    return {"p10": float(np.percentile(sizes, 10)), "p50": float(np.percentile(sizes, 50)),
            "p90": float(np.percentile(sizes, 90)), "queue": float(np.mean(queues))}


def engine_schedule(name: str) -> dict[str, dict[str, float]]:
    """Per level: micro-batch size percentiles and mean queue from the real engine's PP0 lines."""
    where = fixture_dir("sglang", name)
    rows = [json.loads(line) for line in (where / "requests.jsonl").read_text().splitlines()]
    marks = sorted((r["ts_ns"], r["label"]) for r in rows if r["type"] == "marker")
    windows = _settled([(lab, ts, marks[i + 1][0]) for i, (ts, lab) in enumerate(marks[:-1])])
    seen: dict[str, tuple[list[int], list[int]]] = collections.defaultdict(lambda: ([], []))
    for line in (where / "engine.log").read_text().splitlines():
        m = DECODE_PP0.search(line)
        if m is None:
            continue
        t = dt.datetime.strptime(line[1:20], "%Y-%m-%d %H:%M:%S").replace(tzinfo=dt.UTC).timestamp() * 1e9
        for label, (lo, hi) in windows.items():
            if lo <= t < hi:
                seen[label][0].append(int(m.group(1)))
                seen[label][1].append(int(m.group(2)))
    return {label: _shape(*seen[label]) for label in LEVELS}


# The fixtures' engines: the settings they ran with, and this CPU's step costs for the tiny model
# (a stage step about 14 ms plus 4 ms a request: C=1 35 tok/s in the simulator, 38.7 measured).
CPU_ENGINE: dict[str, object] = {
    "pp_size": 2, "max_running_requests": 8, "concurrency": (1, 4, 16), "phase_s": 20.0,
    "drain_s": 5.0, "max_tokens": 32, "input_tokens": 12, "decode_log_interval": 1,
    "synchronous_forward": True, "weight_read_s": 0.012, "decode_token_s": 0.004, "launch_s": 0.002,
    "client_latency_s": 0.002,
}


def sim_schedule(k: int | None, seed: int = 0, **overrides: object) -> dict[str, dict[str, float]]:
    """The same from the simulator run with the fixture's settings."""
    result = run_scenario("healthy", seed, {**CPU_ENGINE, "pp_max_micro_batch_size": k, **overrides})
    t0 = result.start_ns
    windows = _settled([(p.label, t0 + int(p.start_s * 1e9), t0 + int(p.end_s * 1e9)) for p in result.phases])
    seen: dict[str, tuple[list[int], list[int]]] = collections.defaultdict(lambda: ([], []))
    for line, t in zip(result.log_lines, result.log_ts_ns, strict=True):
        m = DECODE_PP0.search(line)
        if m is None:
            continue
        for label, (lo, hi) in windows.items():
            if lo <= t < hi:
                seen[label][0].append(int(m.group(1)))
                seen[label][1].append(int(m.group(2)))
    return {label: _shape(*seen[label]) for label in LEVELS}


def test_the_fixtures_show_the_schedule_described_above() -> None:
    """The real engine's figures this module holds the simulator to (a guard on the recording)."""
    default, k16 = engine_schedule("default"), engine_schedule("k16")
    assert default["C=16"]["p10"] == default["C=16"]["p90"] == 4 and abs(default["C=16"]["queue"] - 8) < 0.5
    assert (k16["C=16"]["p10"], k16["C=16"]["p90"]) == (1, 7) and abs(k16["C=16"]["queue"] - 8) < 0.5
    assert default["C=1"]["p90"] == 1


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("name", "k"), [("default", None), ("k16", 16)])
def test_sim_schedules_as_sglang_does(name: str, k: int | None, seed: int) -> None:
    """Per level: the micro-batch size percentiles (p10, p50, p90) within one request of the real
    engine's, and the queue within one request, with SGLang's per-micro-batch admission."""
    real, sim = engine_schedule(name), sim_schedule(k, seed, cap_scope="microbatch")
    for label in LEVELS:
        keys = ("p10", "p50", "p90", "queue")
        if k == 16 and label == "C=16":
            # the 8 running bunch into one micro-batch of 7 or 8, the rest (1 or none) in the
            # other: both seen on the real engine (7 + 1 in this recording, 8 in [engines]' first
            # run), by when the 12 new requests of the level arrive
            keys = ("p90", "queue")
        for key in keys:
            assert abs(sim[label][key] - real[label][key]) <= 1.0, (label, key, sim[label], real[label])


def test_without_the_synchronous_forward_c4_stays_in_one_slot() -> None:
    """The mechanism, not the costs: with the forward launched asynchronously (a GPU) the same run
    keeps C=4 in one micro-batch (p10 3), which the CPU engine does not do (p10 1)."""
    sim = sim_schedule(None, 0, cap_scope="microbatch", synchronous_forward=False)
    assert sim["C=4"]["p10"] >= 3 and engine_schedule("default")["C=4"]["p10"] == 1


def test_the_engine_scope_cap_queues_what_sglang_does_not() -> None:
    """SGLang bounds each micro-batch by K and the engine by its pool; the simulator's
    cap_scope="engine" (its default, which microbatch-cap and the demo rest on) runs only K at
    C=16 and queues 12, where the engine queues 8."""
    assert sim_schedule(None, 0, cap_scope="engine")["C=16"]["queue"] == 12
    assert abs(engine_schedule("default")["C=16"]["queue"] - 8) < 0.5


@pytest.mark.xfail(strict=True, reason="[sim]: remove cap_scope; the SGLang model admits per micro-batch")
def test_the_sglang_model_has_no_engine_scope_cap() -> None:
    """[sim] removes cap_scope from the SGLang model (the engine-wide reading belongs to vLLM)."""
    assert "cap_scope" not in {f.name for f in fields(SimParams)}


@pytest.mark.xfail(strict=True, reason="[sim]: a vLLM model (engine-wide max_num_seqs, pp_size batches)")
def test_the_simulator_has_a_vllm_model() -> None:
    """[sim] asks for `engine = "vllm"` beside SGLang's model."""
    assert "engine" in {f.name for f in fields(SimParams)}
