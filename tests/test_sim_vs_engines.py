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
    real, sim = engine_schedule(name), sim_schedule(k, seed)
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
    sim = sim_schedule(None, 0, synchronous_forward=False)
    assert sim["C=4"]["p10"] >= 3 and engine_schedule("default")["C=4"]["p10"] == 1


def test_the_sglang_model_admits_per_micro_batch_only() -> None:
    """K bounds each micro-batch and the pool the engine: there is no engine-wide K to choose (the
    reading that queued 12 at C=16 where SGLang queues 8 is gone)."""
    assert "cap_scope" not in {f.name for f in fields(SimParams)}
    assert abs(sim_schedule(None, 0)["C=16"]["queue"] - 8) <= 1.0


VLLM_STATS = re.compile(r"INFO (\d\d-\d\d \d\d:\d\d:\d\d) .*Running: (\d+) reqs, Waiting: (\d+) reqs")


def _stats_by_level(lines: list[str], windows: dict[str, tuple[int, int]], year: int
                    ) -> dict[str, list[tuple[int, int]]]:
    """(running, waiting) of each vLLM stats line logged inside a level's settled window."""
    out: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    for line in lines:
        m = VLLM_STATS.search(line)
        if m is None:
            continue
        stamp = dt.datetime.strptime(f"{year}-{m.group(1)}", "%Y-%m-%d %H:%M:%S").replace(tzinfo=dt.UTC)
        t = stamp.timestamp() * 1e9
        for label, (lo, hi) in windows.items():
            if lo <= t < hi:
                out[label].append((int(m.group(2)), int(m.group(3))))
    return out


def vllm_engine_stats() -> dict[str, list[tuple[int, int]]]:
    where = fixture_dir("vllm", "default")
    rows = [json.loads(line) for line in (where / "requests.jsonl").read_text().splitlines()]
    marks = sorted((r["ts_ns"], r["label"]) for r in rows if r["type"] == "marker")
    windows = _settled([(lab, ts, marks[i + 1][0]) for i, (ts, lab) in enumerate(marks[:-1])])
    year = dt.datetime.fromtimestamp(marks[0][0] / 1e9, dt.UTC).year
    return _stats_by_level((where / "engine.log").read_text().splitlines(), windows, year)


def vllm_sim_stats(seed: int) -> dict[str, list[tuple[int, int]]]:
    overrides = {**CPU_ENGINE, "engine": "vllm", "phase_s": 30.0, "max_tokens": 64}
    result = run_scenario("healthy", seed, overrides)
    t0 = result.start_ns
    windows = _settled([(p.label, t0 + int(p.start_s * 1e9), t0 + int(p.end_s * 1e9)) for p in result.phases])
    year = dt.datetime.fromtimestamp(t0 / 1e9, dt.UTC).year
    return _stats_by_level(result.log_lines, windows, year)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sim_schedules_as_vllm_does(seed: int) -> None:
    """vLLM (engine-wide max_num_seqs 8, PP2): at C=16 its stats lines say 8 running and 8 waiting,
    the simulator's the same within one; below the limit nothing waits and the running count never
    passes the level. (vLLM's Running is the last step's snapshot: at C=1 and C=4 the real one
    reads 0 between requests, so only the bound is compared there.)"""
    real, sim = vllm_engine_stats(), vllm_sim_stats(seed)
    assert real["C=16"] and all(run == 8 and wait == 8 for run, wait in real["C=16"])
    assert sim["C=16"], sim
    for run, wait in sim["C=16"]:
        assert abs(run - 8) <= 1 and abs(wait - 8) <= 1, sim["C=16"]
    for label, level in (("C=1", 1), ("C=4", 4)):
        for source in (real, sim):
            assert source[label] and all(run <= level and wait == 0 for run, wait in source[label]), \
                (label, source[label])


# [prefill] Must show 5's KV case (tests/data/engines/sglang-0.5.23-pp2/kv320): a 320-token pool
# under C=8, 64 tokens a request, prompts of about 34 tokens (37 % found in the radix cache)
KV320 = {"concurrency": (8,), "max_tokens": 64, "max_total_num_tokens": 320, "input_tokens": 34,
         "prefix_cached_share": 0.37}
RETRACTED = re.compile(r"PP0\] KV cache pool is full\. Retract requests\.")


def _pp0_decode_sizes(lines: list[str]) -> np.ndarray:
    return np.array([int(m.group(1)) for line in lines if (m := DECODE_PP0.search(line)) is not None])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sim_admits_under_a_small_kv_pool_as_sglang_does(seed: int) -> None:
    """SGLang admits into the slot it fills holding room for the outputs of that slot's running
    requests only (PrefillAdder's offset sums the slot's running batch), at new_token_ratio, so
    under PP its two slots together take more than the pool holds and it retracts when the pool
    fills. The real engine ran micro-batches of 1 and 2 in both slots (mean 1.7, a few of 3) and
    retracted; the simulator's engine-wide reservation of every output ran one slot of 3 and 4
    (mean 3.1) and never retracted, and the what-if predicted the pool's x1.72 as x2.16."""
    log = (fixture_dir("sglang", "kv320") / "engine.log").read_text().splitlines()
    real = _pp0_decode_sizes(log)
    assert np.median(real) == 2 and real.mean() < 2.0 and any(RETRACTED.search(x) for x in log)
    result = run_scenario("healthy", seed, {**CPU_ENGINE, **KV320})
    sim = _pp0_decode_sizes(result.log_lines)
    assert np.median(sim) == np.median(real)
    assert abs(sim.mean() - real.mean()) < 0.5, (sim.mean(), real.mean())
    assert result.engine.trace.retractions > 0
