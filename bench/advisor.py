"""The advice on simulator ground truth ([advisor] Must show 2): every scenario x seeds, fit a
virtual run's store as a capture, take its advice (gputrace.whatif.advise), run the simulator at
the advised setting and at each finding's configuration change (same seed), and print the
duration-weighted gain of both on the default objective, and each phase's truth gain beside its
band.

    python bench/advisor.py [--seeds 0,1,2] [--scenarios motivating,bunched] [--quick]

The advice passes where it gains at least as much as the best single finding's change and loses
no phase beyond its band (in the simulator, not the fitted model). Also prints the median time of
one advice (store, analysis, fit, search) beside one plain simulator run of the same scenario.
"""

from __future__ import annotations

import argparse
import statistics
import time

from gputrace.sim.params import SCENARIOS
from gputrace.sim.virtual import run_scenario
from gputrace.whatif.groundtruth import AdviceScore, format_advice_table, score_advice


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--quick", action="store_true",
                    help="small inputs, one repeat: the users' code path (tests/test_bench_quick.py)")
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.scenarios = "0", "motivating"
    seeds = [int(s) for s in args.seeds.split(",")]
    names = [n for n in args.scenarios.split(",") if n]
    scores: list[AdviceScore] = []
    advise_s, sim_s = [], []
    for name in names:
        for seed in seeds:
            t0 = time.perf_counter()
            run_scenario(name, seed)
            t1 = time.perf_counter()
            scores.append(score_advice(name, seed))
            sim_s.append(t1 - t0)
            advise_s.append(time.perf_counter() - t1)  # includes the truth runs of the changes
            print(format_advice_table([scores[-1]])[-1], flush=True)
    print()
    print("\n".join(format_advice_table(scores)))
    passed = sum(s.ok for s in scores)
    print(f"\n{passed}/{len(scores)} runs: the advice gains at least the best finding's change and loses "
          "no phase beyond its band (simulator truth)")
    print(f"advice and its truth runs per run: median {statistics.median(advise_s):.1f} s; reference, one "
          f"simulator run of the scenario: median {statistics.median(sim_s):.1f} s")


if __name__ == "__main__":
    main()
