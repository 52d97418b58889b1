"""Engine-log ingest: `gputrace import` and `gputrace parse` of a 1,000,000-line SGLang PP8 log
(the current format) as users run them, beside a bare compiled-regex scan of the same file.

    python bench/ingest.py [--lines N] [--repeats R] [--no-live] [--quick]

The reference is a Python process that reads the file line by line and calls one compiled
regex's ``.search`` on each line, doing nothing else. `gputrace import` does strictly more: every
field of every scheduler line, every byte of the line checked, timestamps converted, rows written
to DuckDB (timed until the process ends, so the database's checkpoint counts); `gputrace parse`
writes each recognised line as a JSON object. Each runs in its own process and is measured in CPU
seconds (user + system, all threads: the machine may be shared), the reference run just before
it each time (alternating pairs); printed: the median of the pairs' speed ratios (reference CPU /
command CPU: 1.0 = as fast as the scan) and their range. Targets ([speed] #48): import >= 1.0,
parse >= 0.5. Then, in this process, where import's time goes (the fast-path scan and one store
append, timed apart), the per-line grammar on a slice for scale, and the collector's CPU per 1,000
lines followed live over SSH (bench/ingest_live.py).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gputrace.engines.common import LogClock, join_chunks
from gputrace.engines.sglang import fastpath
from gputrace.imports.engine_log import ingest_log
from gputrace.imports.log_files import read_chunks
from gputrace.store import Store

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for the sibling ingest_live module

# The reference: what a minimal scanner of decode lines would run per line.
BARE_PATTERN = re.compile(r"Decode batch, #running-req: (\d+), #token: (\d+), token usage: ([\d.]+)")


def write_pp8_log(path: Path, n_lines: int, seed: int = 0) -> None:
    """A PP8 SGLang log in the current default format: startup lines, then per-stage decode lines
    (each stage logs its own), prefill lines on arrivals, HTTP access lines and a few warnings."""
    rnd = random.Random(seed)
    t0 = 1_782_259_200  # 2026-06-24 00:00:00 UTC
    startup = [
        "[2026-06-24 00:00:00] server_args=ServerArgs(model_path='meta-llama/Llama-3.1-70B-Instruct', "
        "tp_size=1, pp_size=8, dp_size=1, max_running_requests=64, pp_max_micro_batch_size=None, "
        "pp_async_batch_depth=0, chunked_prefill_size=8192, decode_log_interval=1)",
        *(f"[2026-06-24 00:00:00 PP{p}] max_total_num_tokens=1048576, chunked_prefill_size=8192, "
          "max_prefill_tokens=16384, max_running_requests=64, context_len=131072" for p in range(8)),
    ]
    lines_per_s = 240  # 8 stages x ~30 micro-batch steps/s with --decode-log-interval 1
    running = [8] * 8
    queue = 24
    with path.open("w") as out:
        for line in startup:
            out.write(line + "\n")
        for i in range(n_lines - len(startup)):
            second = t0 + i // lines_per_s
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(second))
            stage = i % 8
            r = rnd.random()
            if r < 0.86:
                running[stage] = max(1, min(64, running[stage] + rnd.choice((-1, 0, 0, 1))))
                tokens = running[stage] * rnd.randint(400, 3000)
                out.write(
                    f"[{stamp} PP{stage}] Decode batch, #running-req: {running[stage]}, #token: {tokens}, "
                    f"token usage: {tokens / 1_048_576:.2f}, cuda graph: True, "
                    f"gen throughput (token/s): {rnd.uniform(150, 420):.2f}, #queue-req: {queue}\n")
            elif r < 0.94:
                queue = max(0, queue + rnd.choice((-1, 1)))
                new_tokens = rnd.randint(16, 8192)
                out.write(
                    f"[{stamp} PP{stage}] Prefill batch, #new-seq: {rnd.randint(1, 4)}, "
                    f"#new-token: {new_tokens}, #cached-token: {rnd.randint(0, 4096)}, "
                    f"token usage: {rnd.random():.2f}, #running-req: {running[stage]}, #queue-req: {queue}, "
                    f"#pending-token: {rnd.randint(0, 200_000)}, cuda graph: False, "
                    f"input throughput (token/s): {rnd.uniform(500, 20000):.2f}\n")
            elif r < 0.995:
                out.write(f"[{stamp}] INFO:     10.0.0.{rnd.randint(2, 250)}:{rnd.randint(30000, 60000)} - "
                          '"POST /v1/chat/completions HTTP/1.1" 200 OK\n')
            else:
                out.write(f"[{stamp} PP{stage}] KV cache pool is full. Retract requests. "
                          f"#retracted_reqs: 1, #new_token_ratio: {rnd.random():.4f} -> 0.7000\n")


def cpu_s() -> float:
    """This process's CPU time so far, all threads, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


SCAN_PROGRAM = (  # the reference as its own process, as the commands run
    "import re, sys\n"
    f"pattern = re.compile({BARE_PATTERN.pattern!r})\n"
    "with open(sys.argv[1]) as log:\n"
    "    for line in log:\n"
    "        pattern.search(line)\n"
)


def children_cpu_s() -> float:
    """CPU seconds of this process's finished children so far (user and system, all threads)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def process_cpu_s(argv: list[str], stdout: Path | None = None) -> float:
    """CPU seconds of one process run to its end (its output to ``stdout``, or discarded)."""
    before = children_cpu_s()
    with (stdout.open("wb") if stdout else open(os.devnull, "wb")) as out:
        subprocess.run(argv, stdout=out, stderr=subprocess.PIPE, check=True)
    return children_cpu_s() - before


def paired_ratios(log: Path, root: Path, repeats: int) -> dict[str, list[float]]:
    """Per pair, reference CPU / command CPU for `gputrace import` and `gputrace parse` (each run
    just after its own reference run, so both see the same machine load)."""
    gputrace = [sys.executable, "-m", "gputrace"]
    ratios: dict[str, list[float]] = {"import": [], "parse": [], "scan_cpu_s": [], "import_cpu_s": [],
                                      "parse_cpu_s": []}
    for i in range(repeats):
        for name, argv in (("import", [*gputrace, "import", "--run", str(root / f"cli-run-{i}"),
                                       "--sglang-log", str(log), "--host", "node0"]),
                           ("parse", [*gputrace, "parse", str(log)])):
            scan = process_cpu_s([sys.executable, "-c", SCAN_PROGRAM, str(log)])
            command = process_cpu_s(argv)
            ratios[name].append(scan / command)
            ratios["scan_cpu_s"].append(scan)
            ratios[f"{name}_cpu_s"].append(command)
    return ratios


def start_up_cpu_s(log: Path, root: Path, repeats: int) -> dict[str, float]:
    """Median CPU seconds of `gputrace import` and `gputrace parse` on the log's first 100 lines:
    what each costs before its work scales with the file (interpreter, imports, the store)."""
    head = root / "head.log"
    with log.open() as src, head.open("w") as dst:
        dst.writelines(line for _, line in zip(range(100), src, strict=False))
    gputrace = [sys.executable, "-m", "gputrace"]
    runs: dict[str, list[float]] = {"import": [], "parse": []}
    for i in range(repeats):
        runs["import"].append(process_cpu_s([*gputrace, "import", "--run", str(root / f"head-run-{i}"),
                                             "--sglang-log", str(head), "--host", "node0"]))
        runs["parse"].append(process_cpu_s([*gputrace, "parse", str(head)]))
    return {name: statistics.median(values) for name, values in runs.items()}


def timed_ingest(path: Path, root: Path, fast: bool = True) -> tuple[float, float, int]:
    """Wall and CPU seconds of one ingest into a new store, until the store is closed."""
    store = Store.create(root / f"run-{time.monotonic_ns()}")
    try:
        cpu_start, start = cpu_s(), time.perf_counter()
        stats = ingest_log(store, path, host="node0", fast=fast)
    finally:
        store.close()
    elapsed, cpu = time.perf_counter() - start, cpu_s() - cpu_start
    with Store.open(store.path, read_only=True) as check:
        assert check.count("scheduler_events") == stats.events_written
    return elapsed, cpu, stats.events_written


def parse_and_store_apart(path: Path, root: Path) -> tuple[float, float, int]:
    """CPU seconds (all threads) of the two halves of ingest on their own: reading and the
    fast-path scan of every chunk in this thread, then one store append of all its rows and the
    store's close (DuckDB's threads). Says where import's time goes."""
    clock = LogClock()
    start = cpu_s()
    with path.open("rb") as log:
        results = [fastpath.scan_chunk(chunk, 0, clock) for chunk in read_chunks(log)]
    scan_cpu = cpu_s() - start
    parts = [r.columns for r in results if r.n_fast]
    columns: dict[str, object] = {name: chunks.combine_chunks()
                                  for name, chunks in join_chunks(parts).items()}
    n_rows = sum(r.n_fast for r in results)
    columns.update(host="node0", source=str(path), engine="sglang")
    store = Store.create(root / f"run-{time.monotonic_ns()}")
    start = cpu_s()
    try:
        store.append_columns("scheduler_events", columns)
    finally:
        store.close()
    return scan_cpu, cpu_s() - start, n_rows


def live_figures() -> dict[str, object] | None:
    """-- LIVE HOOK -- collector CPU per 1,000 lines followed over SSH (bench/ingest_live.py)."""
    try:
        from ingest_live import measure_live_cpu_per_1000_lines
    except ImportError:
        return None
    result: dict[str, object] = measure_live_cpu_per_1000_lines()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3, help="pairs per command")
    parser.add_argument("--no-live", action="store_true", help="skip the live-over-SSH figure")
    parser.add_argument("--quick", action="store_true",
                        help="small inputs, one repeat: the users' code path (tests/test_bench_quick.py)")
    args = parser.parse_args()
    if args.quick:
        args.lines, args.repeats, args.no_live = 20_000, 1, True
    with tempfile.TemporaryDirectory(prefix="gputrace-bench-ingest-") as tmp:
        root = Path(tmp)
        log = root / "sglang-pp8.log"
        write_pp8_log(log, args.lines)
        size_mb = log.stat().st_size / 1e6
        ratios = paired_ratios(log, root, args.repeats)
        with Store.open(root / "cli-run-0", read_only=True) as check:
            rows = check.count("scheduler_events")
        start_up = start_up_cpu_s(log, root, args.repeats)
        scan_s, append_s, n_rows = parse_and_store_apart(log, root)
        slice_lines = min(args.lines, 50_000)
        sliced = root / "slice.log"
        with log.open() as src, sliced.open("w") as dst:
            for _, line in zip(range(slice_lines), src, strict=False):
                dst.write(line)
        per_line_s, _, _ = timed_ingest(sliced, root, fast=False)
    per_m = 1e6 / args.lines
    scan_cpu = statistics.median(ratios["scan_cpu_s"])
    print(f"log: {args.lines:,} lines ({size_mb:.0f} MB), SGLang PP8 current format; {rows:,} events")
    print(f"bare regex scan (reference, its own process): {scan_cpu * per_m:.2f} CPU s per 1,000,000 lines "
          f"({args.lines / scan_cpu:,.0f} lines/s); pattern: {BARE_PATTERN.pattern!r}")
    targets = {"import": 1.0, "parse": 0.5}
    for name, target in targets.items():
        pairs = ratios[name]
        cpu = statistics.median(ratios[f"{name}_cpu_s"])
        verdict = "met" if statistics.median(pairs) >= target else "NOT MET"
        print(f"gputrace {name:<6}: {cpu * per_m:6.2f} CPU s per 1,000,000 lines ({args.lines / cpu:>10,.0f} "
              f"lines/s); speed ratio to the scan {statistics.median(pairs):.2f} "
              f"(range {min(pairs):.2f}-{max(pairs):.2f}, {len(pairs)} pairs); "
              f"target >= {target:.1f}: {verdict}")
    print(f"  where import's CPU goes, timed apart in this process, per 1,000,000 lines: reading and the "
          f"fast-path scan (one thread) {scan_s * per_m:.2f} s; one store append of its {n_rows:,} rows "
          f"and the close (DuckDB's threads) {append_s * per_m:.2f} s = {append_s / scan_cpu:.1f}x the "
          "whole reference scan; the rest is start-up (imports) and the import ledger's hash")
    print(f"  fixed start-up (each command on the log's first 100 lines, its own process): import "
          f"{start_up['import']:.2f} s = {start_up['import'] / scan_cpu:.2f}x and parse "
          f"{start_up['parse']:.2f} s = {start_up['parse'] / scan_cpu:.2f}x the whole reference scan; "
          f"with a scan that cost nothing, import's ratio would be at most "
          f"{scan_cpu / (start_up['import'] + append_s):.2f} (start-up and the store's append)")
    print(f"per-line grammar (no fast path, {slice_lines:,}-line slice, in process): "
          f"{slice_lines / per_line_s:,.0f} lines/s")
    if args.no_live:
        return
    live = live_figures()
    if live is None:
        print("live over SSH: not measured (bench/ingest_live.py not found)")
    else:
        print(f"live over SSH: {live}")


if __name__ == "__main__":
    main()
