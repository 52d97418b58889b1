"""Engine-log ingest throughput: a 1,000,000-line SGLang PP8 log (current format) ingested into a
run store, beside a bare compiled-regex scan of the same file measured in the same run.

    python bench/ingest.py [--lines N] [--repeats R] [--no-live]

The reference reads the file line by line and calls one compiled regex's ``.search`` on each
line, doing nothing else. Ingest does strictly more: every field of every scheduler line, every
byte of the line checked, timestamps converted, rows written to DuckDB. Target: ingest at least
as fast as the bare scan (ratio >= 1). Ingest is timed until its store is closed, so work the
database defers to its checkpoint is counted. Figures are medians of the repeats; the process CPU
time of each (all threads) is printed too, as the machine may be shared. The per-line grammar
(no fast path) is measured on a slice, for scale. Last, the collector's CPU time per 1,000 lines
followed live over SSH (bench/ingest_live.py, when present).
"""

from __future__ import annotations

import argparse
import random
import re
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gputrace.engines import fastpath
from gputrace.engines.common import LogClock
from gputrace.imports.engine_log import ingest_log, read_chunks
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


def bare_scan(path: Path) -> tuple[float, float]:
    """Wall and CPU seconds of the reference scan."""
    cpu_start, start = cpu_s(), time.perf_counter()
    with path.open() as log:
        for line in log:
            BARE_PATTERN.search(line)
    return time.perf_counter() - start, cpu_s() - cpu_start


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
    """The two halves of ingest timed on their own: the fast-path scan of every chunk in this
    thread, then one store append of all its rows (DuckDB uses its own threads). Says where the
    time goes: neither can overlap the other by more than the machine's spare cores allow."""
    clock = LogClock()
    start = time.perf_counter()
    with path.open("rb") as log:
        results = [fastpath.scan_chunk(chunk, 0, clock) for chunk in read_chunks(log)]
    scan_s = time.perf_counter() - start
    parts = [r.columns for r in results if r.n_fast]
    columns: dict[str, object] = {name: chunks.combine_chunks()
                                  for name, chunks in fastpath.join_chunks(parts).items()}
    n_rows = sum(r.n_fast for r in results)
    columns.update(host="node0", source=str(path), engine="sglang")
    with Store.create(root / f"run-{time.monotonic_ns()}") as store:
        start = time.perf_counter()
        store.append_columns("scheduler_events", columns)
        append_s = time.perf_counter() - start
    return scan_s, append_s, n_rows


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
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-live", action="store_true", help="skip the live-over-SSH figure")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gputrace-bench-ingest-") as tmp:
        root = Path(tmp)
        log = root / "sglang-pp8.log"
        write_pp8_log(log, args.lines)
        size_mb = log.stat().st_size / 1e6
        warmup = root / "warmup.log"  # first-use costs (imports, thread pool) stay out of the figures
        write_pp8_log(warmup, 20_000, seed=1)
        timed_ingest(warmup, root)
        bare_s, bare_cpu, ingest_s, ingest_cpu, rows = [], [], [], [], 0
        for _ in range(args.repeats):  # interleaved, so both see the same machine load
            elapsed, cpu = bare_scan(log)
            bare_s.append(elapsed)
            bare_cpu.append(cpu)
            elapsed, cpu, rows = timed_ingest(log, root)
            ingest_s.append(elapsed)
            ingest_cpu.append(cpu)
        scan_s, append_s, n_rows = parse_and_store_apart(log, root)
        slice_lines = min(args.lines, 50_000)
        sliced = root / "slice.log"
        with log.open() as src, sliced.open("w") as dst:
            for _, line in zip(range(slice_lines), src, strict=False):
                dst.write(line)
        per_line_s, _, _ = timed_ingest(sliced, root, fast=False)
    bare_rate = args.lines / statistics.median(bare_s)
    ingest_rate = args.lines / statistics.median(ingest_s)
    ratio = ingest_rate / bare_rate
    print(f"log: {args.lines:,} lines ({size_mb:.0f} MB), SGLang PP8 current format; {rows:,} events")
    per_m = 1e6 / args.lines
    print(f"bare regex scan (reference): {bare_rate:>12,.0f} lines/s   pattern: {BARE_PATTERN.pattern!r}")
    print(f"ingest into run store:       {ingest_rate:>12,.0f} lines/s   (median of {args.repeats}, "
          "until the store is closed)")
    print(f"  CPU per 1,000,000 lines (all threads): bare scan {statistics.median(bare_cpu) * per_m:.2f} s; "
          f"ingest {statistics.median(ingest_cpu) * per_m:.2f} s")
    print(f"  of which, timed apart: fast-path scan (one thread) {args.lines / scan_s:>12,.0f} lines/s; "
          f"store append (one call, DuckDB's threads) {n_rows / append_s:,.0f} rows/s "
          f"= {append_s / statistics.median(bare_s):.2f}x the bare scan's time")
    print(f"per-line grammar (no fast path, {slice_lines:,}-line slice): "
          f"{slice_lines / per_line_s:,.0f} lines/s")
    verdict = "target met: >= 1.00" if ratio >= 1.0 else "TARGET NOT MET: ingest is slower than the bare scan"
    print(f"ratio ingest / bare scan: {ratio:.2f}  ({verdict})")
    if args.no_live:
        return
    live = live_figures()
    if live is None:
        print("live over SSH: not measured (bench/ingest_live.py not found)")
    else:
        print(f"live over SSH: {live}")


if __name__ == "__main__":
    main()
