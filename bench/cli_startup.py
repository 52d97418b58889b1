"""`gputrace --help` wall time, median of N runs, beside `python -c pass` in the same sitting
(the interpreter's own start; [ux] target: --help under 0.5 s)."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def median_s(argv: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--quick", action="store_true",
                        help="small inputs, one repeat: the users' code path (tests/test_bench_quick.py)")
    args = parser.parse_args()
    if args.quick:
        args.runs = 2
    bare = median_s([sys.executable, "-c", "pass"], args.runs)
    help_s = median_s([sys.executable, "-m", "gputrace", "--help"], args.runs)
    version_s = median_s([sys.executable, "-m", "gputrace", "--version"], args.runs)
    print(f"python -c pass     {bare * 1e3:7.1f} ms (median of {args.runs})")
    print(f"gputrace --help    {help_s * 1e3:7.1f} ms  ({help_s / bare:.1f}x the bare interpreter)")
    print(f"gputrace --version {version_s * 1e3:7.1f} ms")
    print(f"target: --help under 500 ms: {'met' if help_s < 0.5 else 'NOT met'}")


if __name__ == "__main__":
    main()
