"""Peak memory of `gputrace report` on a large imported SGLang log: a PP8 log of about 2 GiB
(13.8 M lines, the current format, as bench/ingest.py writes it) imported with `gputrace import`,
then reported on; the peak RSS of each command is printed beside the log's size and lines.

    python bench/report_memory.py [--lines 13800000] [--tmp DIR]

Target: the report within 2 GB peak RSS. The files are written under --tmp (default: the
system's temporary directory; check its free space: the log and the store take about 3 GiB) and
deleted at the end.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for the sibling ingest module

from ingest import write_pp8_log


def timed(args: list[str]) -> tuple[float, float, float]:
    """Wall s, CPU s and peak RSS (MB) of a gputrace command, run in a child that runs nothing
    else (Linux keeps the largest child's peak RSS for RUSAGE_CHILDREN)."""
    code = ("import resource, subprocess, sys, time\n"
            "t0 = time.perf_counter()\n"
            "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
            "u = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
            "print(p.returncode, time.perf_counter() - t0, u.ru_utime + u.ru_stime, u.ru_maxrss / 1024)\n"
            "sys.stderr.write(p.stderr[-3000:] if p.returncode else '')\n")
    gputrace = str(Path(sys.executable).with_name("gputrace"))
    proc = subprocess.run([sys.executable, "-c", code, gputrace, *args], capture_output=True, text=True)
    rc, wall, cpu, mb = proc.stdout.split()
    if int(rc):
        raise SystemExit(f"gputrace {args[0]} failed ({rc}): {proc.stderr.strip()}")
    return float(wall), float(cpu), float(mb)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=13_800_000)
    ap.add_argument("--tmp", default=None, help="Where to write the log and the run (deleted after).")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gputrace-report-memory-", dir=args.tmp))
    try:
        log, run = tmp / "sglang.log", tmp / "run"
        t0 = time.perf_counter()
        write_pp8_log(log, args.lines)
        size_gib = log.stat().st_size / 2**30
        print(f"log: {args.lines:,} lines, {size_gib:.2f} GiB, written in {time.perf_counter() - t0:.0f} s",
              flush=True)
        wall, cpu, mb = timed(["import", "--run", str(run), "--sglang-log", str(log), "--host", "node0"])
        print(f"{'gputrace import':<16} {wall:>7.1f} s wall {cpu:>7.1f} s CPU {mb:>8.0f} MB peak RSS",
              flush=True)
        log.unlink()
        wall, cpu, mb = timed(["report", str(run), "--out", str(tmp / "report"), "--no-progress"])
        print(f"{'gputrace report':<16} {wall:>7.1f} s wall {cpu:>7.1f} s CPU {mb:>8.0f} MB peak RSS "
              f"({mb * 2**20 / args.lines:.0f} bytes per log line; target: within 2 GB)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
