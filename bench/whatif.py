"""What-if accuracy on simulator ground truth (Must show 1): fit the simulator to a virtual run's
store, predict each scenario's fix (truth.scenario_fixes) and other changes (K, the request pool,
the load), run the simulator with the change, and print predicted against the simulator.

    python bench/whatif.py [--seeds 0,1,2] [--scenarios motivating,bunched] [--quick]

Prints the table, the largest error, and the fit's median wall time beside a reference measured
in the same run: one plain simulator run of the same scenario (the fit replays the run once).
"""

from __future__ import annotations

import argparse
import statistics
import time

from gputrace.sim.params import SCENARIOS
from gputrace.sim.virtual import run_scenario
from gputrace.whatif.groundtruth import OTHER_CHANGES, Score, fitted, format_table, score_change, score_fixes

WITHIN = 0.10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--scenarios", default=",".join(n for n, s in SCENARIOS.items() if s.causes))
    ap.add_argument("--quick", action="store_true",
                    help="small inputs, one repeat: the users' code path (tests/test_bench_quick.py)")
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.scenarios = "0", "motivating"
    seeds = [int(s) for s in args.seeds.split(",")]
    names = [n for n in args.scenarios.split(",") if n]
    scores: list[Score] = []
    for seed in seeds:
        for name in names:
            scores += score_fixes(name, seed)
        for name, change in OTHER_CHANGES:
            scores += score_change(name, seed, change)
    print("\n".join(format_table(scores)))
    worst = max(scores, key=lambda s: abs(s.error_ratio))
    inside = sum(abs(s.error_ratio) < WITHIN for s in scores)
    print(f"\n{inside}/{len(scores)} predictions within {WITHIN:.0%}; largest error {worst.error_ratio:+.1%} "
          f"({worst.scenario} seed {worst.seed}, {worst.change}, {worst.phase})")
    fit_s, sim_s = [], []
    for seed in seeds:
        t0 = time.perf_counter()
        result = run_scenario("motivating", seed)
        sim_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fitted(result)  # store write, analysis, fit and its replay
        fit_s.append(time.perf_counter() - t0)
    print("fit (store, analysis, fit, replay) of the motivating run: "
          f"median {statistics.median(fit_s):.2f} s; "
          f"reference, one simulator run of it: median {statistics.median(sim_s):.2f} s")


if __name__ == "__main__":
    main()
