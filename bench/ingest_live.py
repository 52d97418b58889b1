"""Collector CPU per 1,000 log lines followed live over SSH (a real sshd on loopback, a log being
appended to by another process), beside a local-transport follow of the same kind of file.

    python bench/ingest_live.py [--lines N] [--rate LINES_PER_S] [--repeats R] [--json] [--quick]

Both sides run the same follower on the "host" and the same decoding in this process; the ratio is
the price of SSH (encryption, channel flow control) in collector CPU (time.process_time). Figures
are medians over the repeats; receive latency (append to receipt) is shown as p50/p99.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gputrace.config import LogSource
from gputrace.remote.follow import follow_log_batches
from gputrace.remote.local import LocalTransport
from gputrace.remote.ssh import connect_ssh
from gputrace.remote.transport import Transport

# The writer stamps each line with its append time so that receive latency can be measured.
_WRITER = r"""
import os, sys, time
path, n, rate = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
line = ("[2026-06-24 12:00:%02d DP0 PP%d TP0] Decode batch, #running-req: %d, #token: %d, "
        "token usage: 0.31, cuda graph: True, gen throughput (token/s): 251.07, #queue-req: 24, "
        "bench-ts-ns: %d\n")
burst = max(1, int(rate * 0.01))
i, t0 = 0, time.monotonic()
while i < n:
    now = time.time_ns()
    k = min(burst, n - i)
    os.write(fd, "".join(line % (j % 60, j % 8, j % 64, 4096 + j, now) for j in range(i, i + k)).encode())
    i += k
    time.sleep(max(0.0, t0 + i / rate - time.monotonic()))
os.close(fd)
"""


async def _follow_once(transport: Transport, path: Path, n_lines: int, rate: float) -> dict[str, float]:
    path.touch()
    count = 0
    latencies_ns: list[int] = []
    started = asyncio.Event()
    done = asyncio.Event()
    cpu = {"start": 0.0, "end": 0.0}

    async def consume() -> None:
        nonlocal count
        async for batch in follow_log_batches(transport, LogSource("file", str(path))):
            if not started.is_set():
                continue
            for line in batch:
                count += 1
                if count % 97 == 0:
                    latencies_ns.append(line.recv_ts_ns - int(line.text.rsplit(" ", 1)[1]))
            if count >= n_lines:
                cpu["end"] = time.process_time()
                done.set()

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.5)  # let the follower start on the host before the first line is written
    cpu["start"] = time.process_time()
    started.set()
    wall0 = time.perf_counter()
    writer = await asyncio.create_subprocess_exec(sys.executable, "-c", _WRITER, str(path), str(n_lines),
                                                  str(rate))
    await writer.wait()
    await asyncio.wait_for(done.wait(), timeout=60 + n_lines / rate)
    wall_s = time.perf_counter() - wall0
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    latencies_ns.sort()
    return {
        "cpu_ms_per_1000_lines": (cpu["end"] - cpu["start"]) * 1e3 / (count / 1000),
        "latency_p50_ms": latencies_ns[len(latencies_ns) // 2] / 1e6,
        "latency_p99_ms": latencies_ns[int(len(latencies_ns) * 0.99)] / 1e6,
        "wall_s": wall_s,
    }


async def _measure(n_lines: int, rate: float, repeats: int, root: Path) -> dict[str, object]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    running_sshd = importlib.import_module("sshd").running_sshd  # the real-sshd fixture of the tests

    runs: dict[str, list[dict[str, float]]] = {"ssh": [], "local": []}
    with running_sshd(root / "sshd", shutil.which("sshd") or "/usr/sbin/sshd") as server:
        ssh = await connect_ssh(server.options(), name="loopback")
        local = LocalTransport("loopback")
        try:
            for r in range(repeats):
                for name, transport in (("local", local), ("ssh", ssh)):
                    path = root / f"{name}-{r}.log"
                    runs[name].append(await _follow_once(transport, path, n_lines, rate))
                    path.unlink()
        finally:
            await ssh.close()

    def median(name: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[name])

    ssh_cpu, local_cpu = median("ssh", "cpu_ms_per_1000_lines"), median("local", "cpu_ms_per_1000_lines")
    return {
        "lines": n_lines,
        "rate_lines_per_s": rate,
        "repeats": repeats,
        "ssh_cpu_ms_per_1000_lines": round(ssh_cpu, 3),
        "local_cpu_ms_per_1000_lines": round(local_cpu, 3),
        "ssh_over_local": round(ssh_cpu / local_cpu, 2) if local_cpu > 0 else None,
        "ssh_latency_p50_ms": round(median("ssh", "latency_p50_ms"), 2),
        "ssh_latency_p99_ms": round(median("ssh", "latency_p99_ms"), 2),
        "local_latency_p50_ms": round(median("local", "latency_p50_ms"), 2),
        "local_latency_p99_ms": round(median("local", "latency_p99_ms"), 2),
    }


def measure_live_cpu_per_1000_lines(n_lines: int = 20_000, rate_lines_per_s: float = 10_000.0,
                                    repeats: int = 3) -> dict[str, object]:
    """Collector CPU ms per 1,000 lines followed live over SSH on loopback, and the local reference.

    Needs OpenSSH's sshd (run as root, as the tests do); without it the SSH figures are None and
    ``skipped`` says why.
    """
    sshd = shutil.which("sshd") or ("/usr/sbin/sshd" if os.access("/usr/sbin/sshd", os.X_OK) else None)
    if sshd is None or os.geteuid() != 0:
        return {"lines": n_lines, "ssh_cpu_ms_per_1000_lines": None, "local_cpu_ms_per_1000_lines": None,
                "skipped": "needs OpenSSH sshd and root (to start a private sshd on loopback)"}
    with tempfile.TemporaryDirectory(prefix="gputrace-bench-live-") as tmp:
        return asyncio.run(_measure(n_lines, rate_lines_per_s, repeats, Path(tmp)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=10_000.0, help="lines appended per second")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    parser.add_argument("--quick", action="store_true",
                        help="small inputs, one repeat: the users' code path (tests/test_bench_quick.py)")
    args = parser.parse_args()
    if args.quick:
        args.lines, args.rate, args.repeats = 1_000, 5_000.0, 1
    result = measure_live_cpu_per_1000_lines(args.lines, args.rate, args.repeats)
    if args.json:
        print(json.dumps(result))
        return
    if result.get("skipped"):
        print(f"live follow over SSH: skipped ({result['skipped']})")
        return
    print(f"live follow of {result['lines']:,} lines appended at {result['rate_lines_per_s']:,.0f} lines/s "
          f"(median of {result['repeats']}), collector CPU per 1,000 lines:")
    print(f"  over SSH (real sshd, loopback): {result['ssh_cpu_ms_per_1000_lines']:8.2f} ms   "
          f"latency p50 {result['ssh_latency_p50_ms']:.1f} ms, p99 {result['ssh_latency_p99_ms']:.1f} ms")
    print(f"  local transport (reference):    {result['local_cpu_ms_per_1000_lines']:8.2f} ms   "
          f"latency p50 {result['local_latency_p50_ms']:.1f} ms, p99 {result['local_latency_p99_ms']:.1f} ms")
    print(f"  SSH / local: {result['ssh_over_local']}x")


if __name__ == "__main__":
    main()
