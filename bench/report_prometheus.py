"""Time and peak memory of `gputrace report --prometheus` over a long range, beside a plain
reference in the same run: the same range queries fetched and decoded (urllib + json) and nothing
else, the least any Prometheus reader pays.

    python bench/report_prometheus.py [--gpus 64] [--minutes 60] [--step 1s] [--quick]

The data are backfilled into a fresh Prometheus with promtool (OpenMetrics, 1 s samples): GPUs on
hosts of 8 (host i = stage i, TP across its 8 GPUs, as the agents label them), the collector's
engine gauges for attention-TP rank 0 of each stage, and four load levels. Each measurement runs
in its own child process (peak RSS = its ru_maxrss); `report RUN` on the imported store is timed
too, so the import's own share shows. A --step below 1s makes ranges longer than 11,000 steps and
shows the chunking at scale.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from gputrace.imports.prometheus import parse_step_ms

GPU_METRICS = {  # name: (mean at the capped level, jitter)
    "gputrace_gpu_utilization_ratio": (0.25, 0.03),
    "gputrace_gpu_power_watts": (260.0, 15.0),
    "gputrace_gpu_pcie_tx_bytes_per_second": (2e8, 2e7),
    "gputrace_gpu_pcie_rx_bytes_per_second": (2e8, 2e7),
    "gputrace_gpu_sm_clock_hertz": (1.98e9, 0.0),
    "gputrace_gpu_memory_used_bytes": (7.0e10, 0.0),
    "gputrace_gpu_temperature_celsius": (55.0, 2.0),
}
LEVELS = (8, 16, 32, 64)

FETCH_ONLY = r"""
import json, sys, time, urllib.parse, urllib.request
from gputrace.prometheus.client import chunk_windows
from gputrace.imports.prometheus import ENGINE_FIELDS, GPU_FIELDS, TARGET_METRIC
base, start_ms, end_ms, step_ms = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
points = 0
for name in [*GPU_FIELDS, "gputrace_gpu_lost", *ENGINE_FIELDS, TARGET_METRIC]:
    for lo, hi in chunk_windows(start_ms, end_ms, step_ms):
        body = urllib.parse.urlencode({"query": name, "start": lo / 1000, "end": hi / 1000,
                                       "step": step_ms / 1000}).encode()
        with urllib.request.urlopen(urllib.request.Request(base + "/api/v1/query_range", data=body)) as r:
            doc = json.loads(r.read())
        points += sum(len(s["values"]) for s in doc["data"]["result"])
print(points)
"""


def write_openmetrics(path: Path, n_gpus: int, start_s: int, seconds: int, seed: int = 0) -> None:
    """1 s samples of every series, each series contiguous and in time order (promtool's input)."""
    rng = np.random.default_rng(seed)
    t = np.arange(start_s, start_s + seconds)
    level = np.array(LEVELS)[np.minimum((np.arange(seconds) * len(LEVELS)) // seconds, len(LEVELS) - 1)]
    ts = [str(x) for x in t]
    pp = max(n_gpus // 8, 1)
    with path.open("w") as f:
        for name, (mean, jitter) in GPU_METRICS.items():
            f.write(f"# TYPE {name} gauge\n")
            for g in range(n_gpus):
                host, gpu = f"node{g // 8}", g % 8
                lab = (f'host="{host}",gpu="{gpu}",uuid="GPU-{g:04d}",model="NVIDIA H200",'
                       f'pp_rank="{g // 8}",tp_rank="{gpu}"')
                v = mean * np.minimum(level / 32, 1.0) + jitter * rng.standard_normal(seconds)
                f.writelines(f"{name}{{{lab}}} {x:.6g} {s}\n" for x, s in zip(v, ts, strict=True))
        engine = {"gputrace_engine_running_requests": np.minimum(level, 8),
                  "gputrace_engine_queue_requests": np.maximum(level - 8, 0),
                  "gputrace_engine_generation_tokens_per_second": np.full(seconds, 300.0),
                  "gputrace_engine_token_usage_ratio": np.full(seconds, 0.2)}
        for name, values in engine.items():
            f.write(f"# TYPE {name} gauge\n")
            for stage in range(pp):
                lab = f'host="node{stage}",pp_rank="{stage}",tp_rank="0",dp_rank="0",run="bench"'
                f.writelines(f"{name}{{{lab}}} {x:g} {s}\n" for x, s in zip(values, ts, strict=True))
        f.write("# TYPE gputrace_load_target_concurrency gauge\n")
        f.writelines(f'gputrace_load_target_concurrency{{run="bench"}} {x} {s}\n'
                     for x, s in zip(level, ts, strict=True))
        f.write("# EOF\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(argv: list[str], work: Path) -> tuple[float, float, str]:
    """Wall seconds, peak RSS (MiB) and stdout of one child process."""
    out_path, err_path = work / "child.out", work / "child.err"
    with out_path.open("wb") as out, err_path.open("wb") as err:
        started = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)  # reaped here, so its own rusage comes back
        wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        sys.exit(f"{argv[:4]} failed: {err_path.read_text()[-2000:]}")
    return wall, usage.ru_maxrss / 1024, out_path.read_text()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--step", default="1s")
    ap.add_argument("--quick", action="store_true",
                    help="small inputs, one repeat: the users' code path (tests/test_bench_quick.py)")
    args = ap.parse_args()
    if args.quick:
        args.gpus, args.minutes = 8, 3.0
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if not prometheus or not promtool:
        sys.exit("needs prometheus and promtool on PATH")
    seconds = int(args.minutes * 60)
    start_s = int(time.time()) // 7200 * 7200 - 7200 - seconds  # recent: inside the retention
    with tempfile.TemporaryDirectory(prefix="bench-prom-") as tmp:
        work = Path(tmp)
        t = time.perf_counter()
        write_openmetrics(work / "data.om", args.gpus, start_s, seconds)
        subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", str(work / "data.om"),
                        str(work / "tsdb")], check=True, capture_output=True)
        (work / "data.om").unlink()
        (work / "prometheus.yml").write_text("global:\n  scrape_interval: 1s\nscrape_configs: []\n")
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        prom = subprocess.Popen([prometheus, f"--config.file={work / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={work / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    with urllib.request.urlopen(f"{base}/-/ready", timeout=1):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        sys.exit("Prometheus did not become ready")
                    time.sleep(0.2)
            print(f"backfilled {args.gpus} GPUs x {args.minutes:g} min at 1 s "
                  f"in {time.perf_counter() - t:.1f} s")
            start, end = str(start_s), str(start_s + seconds - 1)
            step_ms = parse_step_ms(args.step)
            ref_s, ref_mb, points = measure([sys.executable, "-c", FETCH_ONLY, base, str(start_s * 1000),
                                             str((start_s + seconds - 1) * 1000), str(step_ms)], work)
            run_dir = work / "run"
            rep_s, rep_mb, out = measure([sys.executable, "-m", "gputrace", "report", "--prometheus", base,
                                          "--start", start, "--end", end, "--step", args.step,
                                          "--max-running-requests", "64", "--run-out", str(run_dir),
                                          "--format", "json", "--no-progress"], work)
            ana_s, ana_mb, _ = measure([sys.executable, "-m", "gputrace", "report", str(run_dir), "--format",
                                        "json", "--out", str(work / "again"), "--no-progress"], work)
        finally:
            prom.terminate()
            prom.wait()
        doc = json.loads((run_dir / "report" / "findings.json").read_text())
        print(out.splitlines()[0])
        steps = (seconds - 1) * 1000 // step_ms + 1
        print(f"points fetched: {int(points):,} ({args.gpus} GPUs x {steps:,} steps x metrics)")
        print(f"{'':34s}{'time s':>10s}{'peak MiB':>10s}")
        print(f"{'reference: fetch + json only':34s}{ref_s:10.2f}{ref_mb:10.0f}")
        print(f"{'report --prometheus (all of it)':34s}{rep_s:10.2f}{rep_mb:10.0f}")
        print(f"{'  of which report RUN (analysis)':34s}{ana_s:10.2f}{ana_mb:10.0f}")
        print(f"ratio report --prometheus / reference: {rep_s / ref_s:.2f}x time, "
              f"import alone ~{(rep_s - ana_s) / ref_s:.2f}x")
        print(f"phases: {[p['label'] for p in doc['phases']]}; findings: "
              f"{sorted({(f['cause'], f['phase']) for f in doc['findings']})}")


if __name__ == "__main__":
    main()
