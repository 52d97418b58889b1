"""Can the load generator keep C=256 requests in flight on this machine's cores?

Runs an OpenAI-compatible streaming server in its own process: the simulator's real-time server
(``gputrace sim serve``, PP8, max_running_requests raised to 256 so that it serves them all; the
default) or, with ``--server fixture``, tests/openai_server.py (one SSE chunk per token at a fixed
pace). Then drives it with gputrace's load generator: first at C=16 as the reference, then at
C=256. Prints the in-flight count each
level achieved (time-weighted mean and the lowest count held for >= 1 ms), the client's CPU use
(process CPU seconds / wall, per request and per 1000 tokens) and the event-loop lag, with the
C=256 figures as ratios to the C=16 reference measured in this same run.

    python bench/load.py [--server sim|fixture] [--speed 1] [--seconds 10] [--max-tokens 64] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from gputrace.load import LoadResult, LoadSpec, run_load

ROOT = Path(__file__).resolve().parent.parent


def start_sim(workdir: str, concurrency: int, speed: float) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gputrace", "sim", "serve", "--port", "0", "--log", f"{workdir}/sglang.log",
         "--set", f"max_running_requests={concurrency}", "--speed", str(speed)],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        if "gputrace sim serve:" in line and " on http" in line:
            return proc, line.rsplit(" on ", 1)[1].strip()
    proc.kill()
    raise SystemExit("the simulator's server did not start")


def start_fixture(token_interval: float, ttft: float) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "openai_server.py"), "--token-interval", str(token_interval),
         "--ttft", str(ttft)],
        stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    if not url.startswith("http"):
        proc.kill()
        raise SystemExit(f"server did not start: {url!r}")
    return proc, url


async def level(url: str, c: int, seconds: float, warmup_s: float, max_tokens: int) -> LoadResult:
    spec = LoadSpec(url=url, model="bench", concurrency=(c,), max_tokens=max_tokens,
                    duration_per_level_s=seconds, warmup_s=warmup_s)
    return await run_load(spec)


def describe(result: LoadResult) -> dict[str, float]:
    lv = next(lv for lv in result.levels if lv.label != "warmup")
    n = len(result.requests)
    tokens = sum(r.completion_tokens or 0 for r in result.requests)
    return {
        "target": float(lv.target_concurrency or 0),
        "mean": lv.inflight_mean or 0.0,
        "min": float(lv.inflight_min or 0),
        "ok": float(lv.ok),
        "failed": float(lv.failed),
        "tok_s": lv.aggregate_tok_s or 0.0,
        "cpu_frac": result.cpu_s / result.wall_s,
        "cpu_ms_per_req": result.cpu_s / max(n, 1) * 1e3,
        "cpu_ms_per_ktok": result.cpu_s / max(tokens, 1) * 1e6,
        "lag_p99_ms": lv.loop_lag_p99_ms or 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--server", choices=("sim", "fixture"), default="sim")
    parser.add_argument("--seconds", type=float, default=10.0, help="steady seconds per level")
    parser.add_argument("--speed", type=float, default=1.0, help="sim: simulated seconds per wall second")
    parser.add_argument("--token-interval", type=float, default=0.05, help="fixture: seconds per token")
    parser.add_argument("--ttft", type=float, default=0.2, help="fixture: seconds to the first token")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--quick", action="store_true",
                        help="small inputs, one repeat: the users' code path (tests/test_bench_quick.py)")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.concurrency, args.max_tokens = 1.0, 32, 16
    cores = len(os.sched_getaffinity(0))
    workdir = tempfile.mkdtemp(prefix="gputrace-bench-load-")
    if args.server == "sim":
        proc, url = start_sim(workdir, args.concurrency, args.speed)
        what = f"the simulator's real-time server (PP8, speed {args.speed:g})"
    else:
        proc, url = start_fixture(args.token_interval, args.ttft)
        what = f"the fixture OpenAI server ({args.token_interval * 1e3:.0f} ms per token)"
    try:
        ref = describe(asyncio.run(level(url, 16, args.seconds / 2, 1.0, args.max_tokens)))
        big = describe(asyncio.run(level(url, args.concurrency, args.seconds, 2.0, args.max_tokens)))
    finally:
        proc.terminate()
        proc.wait(10)
    print(f"load generator vs {what} in its own process, on {cores} cores; "
          f"{args.max_tokens} tokens per request")
    print(f"{'':26}{'C=16 (reference)':>18}{f'C={args.concurrency}':>14}{'ratio':>10}")
    rows = [
        ("in flight, mean", "mean", "{:.2f}"),
        ("in flight, min (>=1 ms)", "min", "{:.0f}"),
        ("requests ok / failed", "ok", "{:.0f}"),
        ("aggregate tok/s", "tok_s", "{:.0f}"),
        ("client CPU / wall", "cpu_frac", "{:.1%}"),
        ("client CPU ms / request", "cpu_ms_per_req", "{:.2f}"),
        ("client CPU ms / 1k tokens", "cpu_ms_per_ktok", "{:.1f}"),
        ("event-loop lag p99 ms", "lag_p99_ms", "{:.1f}"),
    ]
    for name, key, fmt in rows:
        ratio = big[key] / ref[key] if ref[key] else float("nan")
        extra = f" / {big['failed']:.0f}" if key == "ok" else ""
        print(f"{name:26}{fmt.format(ref[key]):>18}{fmt.format(big[key]) + extra:>14}{ratio:>10.2f}")
    need = args.concurrency * 250 // 256  # 250 of 256: the target's share
    verdict = "PASS" if big["min"] >= need and big["mean"] >= need else "FAIL"
    print(f"{verdict}: C={args.concurrency} kept mean {big['mean']:.2f}, min {big['min']:.0f} in flight "
          f"(need >= {need})")


if __name__ == "__main__":
    main()
