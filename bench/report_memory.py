"""Peak memory of `gputrace report` on a large imported SGLang log: a PP8 log of about 2 GiB
(13.8 M lines, the current format, as bench/ingest.py writes it) imported with `gputrace import`,
then reported on; the peak RSS of each command is printed beside the log's size and lines.

    python bench/report_memory.py [--lines 13800000] [--tmp DIR] [--quick]

Target: the report within 2 GB peak RSS. Printed: the import; the report without the what-if
(read, align, analyse, figures, HTML/Markdown/JSON in one process); the real `gputrace report`
(with the what-if: the simulator fitted to the run, at most 16 load levels replayed, and the advice
search), stopped after --command-timeout.
The files are written under --tmp (default: the system's
temporary directory; check its free space: the log and the store take about 3 GiB) and deleted
at the end.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for the sibling ingest module

from ingest import write_pp8_log


def timed(args: list[str], timeout_s: float | None = None) -> tuple[float, float, float, bool]:
    """Wall s, CPU s, peak RSS (MB) and whether it finished, of a gputrace command run in a child
    that runs nothing else (Linux keeps the largest waited-for child's peak RSS for
    RUSAGE_CHILDREN); killed after ``timeout_s``."""
    code = ("import resource, subprocess, sys, time\n"
            "t0 = time.perf_counter()\n"
            "limit = float(sys.argv[1]) or None\n"
            "try:\n"
            "    p = subprocess.run(sys.argv[2:], capture_output=True, text=True, timeout=limit)\n"
            "    rc, err = p.returncode, p.stderr\n"
            "except subprocess.TimeoutExpired:\n"
            "    rc, err = -1, ''\n"
            "u = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
            "print(rc, time.perf_counter() - t0, u.ru_utime + u.ru_stime, u.ru_maxrss / 1024)\n"
            "sys.stderr.write(err[-3000:] if rc > 0 else '')\n")
    gputrace = str(Path(sys.executable).with_name("gputrace"))
    proc = subprocess.run([sys.executable, "-c", code, str(timeout_s or 0), gputrace, *args],
                          capture_output=True, text=True)
    rc, wall, cpu, mb = proc.stdout.split()
    if int(rc) > 0:
        raise SystemExit(f"gputrace {args[0]} failed ({rc}): {proc.stderr.strip()}")
    return float(wall), float(cpu), float(mb), int(rc) == 0


def analysis_only(run: str, out: str) -> None:
    """The report without the what-if, in this process: read, align, analyse, write HTML,
    Markdown and JSON (what `gputrace report` runs, less add_predicted_effects)."""
    from gputrace.analyse import analyse_run
    from gputrace.report.render import write_report
    from gputrace.store import Store

    t0 = time.perf_counter()
    with Store.open(run, read_only=True) as store:
        write_report(analyse_run(store, effects=False), out, ["html", "md", "json"])
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(time.perf_counter() - t0, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--analysis-only":
        analysis_only(sys.argv[2], sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=13_800_000)
    ap.add_argument("--tmp", default=None, help="Where to write the log and the run (deleted after).")
    ap.add_argument("--quick", action="store_true",
                    help="small inputs, one repeat: the users' code path (tests/test_bench_quick.py)")
    ap.add_argument("--command-timeout", type=float, default=1800,
                    help="Seconds the full `gputrace report` (with its what-if) may take; 0: skip it.")
    args = ap.parse_args()
    if args.quick:
        args.lines = 20_000
    tmp = Path(tempfile.mkdtemp(prefix="gputrace-report-memory-", dir=args.tmp))
    try:
        log, run = tmp / "sglang.log", tmp / "run"
        t0 = time.perf_counter()
        write_pp8_log(log, args.lines)
        size_gib = log.stat().st_size / 2**30
        print(f"log: {args.lines:,} lines, {size_gib:.2f} GiB, written in {time.perf_counter() - t0:.0f} s",
              flush=True)
        wall, cpu, mb, _ = timed(["import", "--run", str(run), "--sglang-log", str(log), "--host", "node0"])
        print(f"{'gputrace import':<24} {wall:>7.1f} s wall {cpu:>7.1f} s CPU {mb:>8.0f} MB peak RSS",
              flush=True)
        log.unlink()
        proc = subprocess.run([sys.executable, __file__, "--analysis-only", str(run), str(tmp / "a")],
                              capture_output=True, text=True, check=True)
        wall, cpu, mb = map(float, proc.stdout.split()[-3:])
        print(f"{'report without what-if':<24} {wall:>7.1f} s wall {cpu:>7.1f} s CPU {mb:>8.0f} MB peak RSS "
              f"({mb * 2**20 / args.lines:.0f} bytes per log line; target: within 2 GB)", flush=True)
        if args.command_timeout:
            wall, cpu, mb, done = timed(["report", str(run), "--out", str(tmp / "report"), "--no-progress"],
                                        args.command_timeout)
            print(f"{'gputrace report':<24} {wall:>7.1f} s wall {cpu:>7.1f} s CPU {mb:>8.0f} MB peak RSS"
                  + ("" if done else f" (stopped after {args.command_timeout:g} s: not finished)"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
