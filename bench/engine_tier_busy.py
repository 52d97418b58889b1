"""The real-engine tier's vLLM tests, run again and again while other processes keep cores busy
(issue #27 [busy], Must show 4: 5 runs of 5 with one core busy).

Each run is the engine tier as CI runs it (`pytest tests/test_engines_real.py -k vllm`, a fresh
vLLM PP=2 server, `gputrace run` against it, Prometheus beside it), with `stress-ng --cpu N` (or,
where stress-ng is missing, N Python spin loops) started before and stopped after. Printed per run:
passed / failed tests and wall time, and at the end the count of runs that passed whole, against
the same tier's wall time on the idle machine when `--reference` is given (the first run, no load).

    python bench/engine_tier_busy.py [--runs 5] [--busy-cores 1] [--reference] [--quick]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"(\d+) passed|(\d+) failed")


def busy(cores: int) -> subprocess.Popen[bytes]:
    """Processes that keep ``cores`` cores busy until stopped."""
    if shutil.which("stress-ng"):
        argv = ["stress-ng", "--cpu", str(cores), "--timeout", "3600"]
    else:
        argv = [sys.executable, "-c",
                "import multiprocessing as m\n"
                "def spin():\n    while True: pass\n"
                f"ps=[m.Process(target=spin) for _ in range({cores})]\n"
                "[p.start() for p in ps]\n[p.join() for p in ps]\n"]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def run_tier(selection: str, log: Path) -> tuple[int, int, float, str]:
    """One run of the tier: (passed, failed, wall s, the failures' lines); its whole output to ``log``."""
    env = dict(os.environ, GPUTRACE_REQUIRE_SYSTEM_TESTS="1", GPUTRACE_REQUIRE_ENGINE_TESTS="1")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_engines_real.py", "-k", selection],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - t0
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(done.stdout + done.stderr)
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:]
    passed = failed = 0
    for p, f in SUMMARY.findall(tail):
        passed += int(p or 0)
        failed += int(f or 0)
    failures = "\n".join(ln for ln in done.stdout.splitlines() if ln.startswith("FAILED"))
    return passed, failed, wall, failures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true",
                    help="small inputs, one repeat: the users' code path (tests/test_bench_quick.py)")
    ap.add_argument("--busy-cores", type=int, default=1)
    ap.add_argument("--select", default="vllm", help="pytest -k expression (default: vllm)")
    ap.add_argument("--reference", action="store_true", help="first one run on the idle machine")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/engine_tier_busy"),
                    help="each run's whole pytest output, run-N.txt (default: %(default)s)")
    args = ap.parse_args()
    if args.quick:  # one loaded run of one engine-tier test
        args.runs, args.select = 1, "vllm_every_stats_line"
    print(f"cores here: {os.cpu_count()}; busy cores during the runs: {args.busy_cores}", flush=True)
    if args.reference:
        p, f, wall, failures = run_tier(args.select, args.log_dir / "reference.txt")
        print(f"reference (idle): {p} passed, {f} failed, {wall:.0f} s", flush=True)
        if failures:
            print(failures, flush=True)
    walls, whole = [], 0
    for i in range(args.runs):
        load = busy(args.busy_cores)
        try:
            p, f, wall, failures = run_tier(args.select, args.log_dir / f"run-{i + 1}.txt")
        finally:
            os.killpg(load.pid, 9)
            load.wait()
        walls.append(wall)
        whole += f == 0 and p > 0
        print(f"run {i + 1}/{args.runs} with {args.busy_cores} core(s) busy: {p} passed, {f} failed, "
              f"{wall:.0f} s", flush=True)
        if failures:
            print(failures, f"(the whole output: {args.log_dir / f'run-{i + 1}.txt'})", flush=True)
    print(f"runs passed whole: {whole} of {args.runs}; wall median {statistics.median(walls):.0f} s "
          f"[{min(walls):.0f}, {max(walls):.0f}]", flush=True)


if __name__ == "__main__":
    main()
