"""Simulator speed: a one-hour PP8 run sampled at 10 Hz, generated in virtual time into a run store.

    python bench/sim.py [--scenario motivating] [--hours 1] [--period 0.1] [--quick]
    python bench/sim.py --calibration [--fit]     (the motivating figures: see bench/calibration.py)

Prints the wall time of the engine model and of the run store write (GPU samples, the log
imported through gputrace's SGLang import path, every other table), and the ratio of simulated
time to wall time (target: the hour in under 30 s). Reference measured in the same run: a
per-sample Python loop computing the same utilization for one GPU over the first minute.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from gputrace.sim import run_scenario
from gputrace.sim.outputs import import_log, sample_columns, write_store
from gputrace.store import Store


def naive_utilization(starts: np.ndarray, ends: np.ndarray, times: np.ndarray, period: float) -> np.ndarray:
    """The obvious loop: for each sample, add up the overlap of every interval in its window."""
    out = np.zeros(times.size)
    first = 0
    for i, t in enumerate(times):
        lo = t - period
        while first < starts.size and ends[first] <= lo:
            first += 1
        busy = 0.0
        j = first
        while j < starts.size and starts[j] < t:
            busy += min(ends[j], t) - max(starts[j], lo)
            j += 1
        out[i] = busy / period
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="motivating")
    ap.add_argument("--calibration", action="store_true", help="the motivating figures, simulated")
    ap.add_argument("--fit", action="store_true", help="with --calibration: fit the costs again")
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--period", type=float, default=0.1, help="sample period in seconds (0.1 = 10 Hz)")
    ap.add_argument("--quick", action="store_true",
                    help="small inputs, one repeat: the users' code path (tests/test_bench_quick.py)")
    args = ap.parse_args()
    if args.quick:
        args.hours = 0.02
    if args.calibration:
        import calibration  # bench/calibration.py, beside this file

        calibration.main(["--fit"] if args.fit else [])
        return
    from gputrace.sim import SCENARIOS

    n_levels = len(SCENARIOS[args.scenario].overrides.get("concurrency", (1, 8, 32, 64)))
    overrides = {"phase_s": args.hours * 3600 / n_levels, "sample_period_s": args.period, "drain_s": 0.0}
    cpu0, wall0 = time.process_time(), time.perf_counter()
    result = run_scenario(args.scenario, 0, overrides)
    t_model = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        write_store(result, Path(tmp) / "run")  # samples, the log parsed, every table, meta
    t_store = time.perf_counter()
    wall, cpu = t_store - wall0, time.process_time() - cpu0
    # The parts of the store write, timed again on their own (not counted in the total).
    t0 = time.perf_counter()
    cols = sample_columns(result)
    t_samples = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp, Store.create(Path(tmp) / "log-only") as store:
        t0 = time.perf_counter()
        n_events = import_log(store, result)  # raises if a line is not recognised
        t_parse = time.perf_counter() - t0
    n_samples = len(cols["ts_ns"])
    sim_s = result.end_s
    print(f"scenario {args.scenario}: {sim_s:.0f} s simulated, {len(result.engine.trace.iv_start):,} busy "
          f"intervals, {n_samples:,} GPU samples, {len(result.log_lines):,} log lines "
          f"({n_events:,} scheduler events, none unrecognised), {len(result.requests):,} requests")
    print(f"  engine model         {t_model - wall0:7.2f} s")
    print(f"  run store write      {t_store - t_model:7.2f} s   of which GPU samples {t_samples:.2f} s, "
          f"log import {t_parse:.2f} s")
    print(f"  total wall           {wall:7.2f} s   (process CPU {cpu:.2f} s)")
    print(f"  simulated / wall     {sim_s / wall:7.1f} x   (target: 3600 s in < 30 s = 120 x)")

    # Reference: the per-sample loop for one GPU over the first minute, scaled per sample.
    iv = result.intervals
    sel = iv["stage"] == 0
    times = np.arange(1, int(min(60.0, sim_s) / args.period) + 1) * args.period
    t0 = time.perf_counter()
    naive = naive_utilization(iv["start_s"][sel], iv["end_s"][sel], times, args.period)
    per_naive = (time.perf_counter() - t0) / times.size
    per_vec = t_samples / n_samples
    vec = np.asarray(cols["utilization_ratio"])[np.asarray(cols["gpu_index"]) == 0][: times.size]
    print(f"  per sample: vectorised {per_vec * 1e6:.2f} us, per-sample loop {per_naive * 1e6:.2f} us "
          f"({per_naive / per_vec:.0f}x); max difference {np.abs(vec - np.round(naive, 4)).max():.4f}")


if __name__ == "__main__":
    main()
