"""Prepared device check (H200): does the NVML agent track nvidia-smi, and what does it cost?

NOT a benchmark of this repository's CPU-only CI: it needs an NVIDIA GPU, its driver, PyTorch, and
the agent's dependencies. One run (about 45 s) on the device machine:

  t=0      nvidia-smi --query-gpu=timestamp,utilization.gpu,power.draw --format=csv -lms 100 starts,
           and `gputrace agent --backend nvml --interval 0.1` starts on a loopback port;
  t=5-20s  a PyTorch bf16 matmul loop keeps GPU 0 busy (starts after 5 s, stops after 20 s);
  t=12s    a direct NVML probe: every metric's support (GPM included) and the native period of
           nvmlDeviceGetSamples (median spacing of the driver's utilization samples);
  t=30s    everything stops; the agent's samples (pulled from /v1/samples during the run), the
           nvidia-smi CSV, /metrics, /v1/info and a summary land in --out.

The summary compares the two sources over 1 s bins and at the load edges (first time >= 50 %
after the loop starts, first time < 50 % after it stops), the agent's power against
nvidia-smi's, and the agent's CPU use (utime + stime of its process over the run).

    python3 bench/agent_h200.py --out "$OUT"        # on the device machine

Dependencies: if aiohttp, prometheus_client, structlog, click and pynvml are not importable, a
wheelhouse at bench/wheels/ is installed into a temporary venv (prepare it where the registry is
reachable: `pip download -d bench/wheels --only-binary=:all: --python-version 3.X aiohttp
prometheus-client structlog click nvidia-ml-py`; the device machine has no network).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEPS = ("aiohttp", "prometheus_client", "structlog", "click", "pynvml")

def run_matmul(start_after: float, stop_after: float, out: str) -> None:
    """Keep GPU 0 busy with bf16 matmuls from start_after to stop_after seconds (PyTorch)."""
    import torch

    t0 = time.monotonic()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    time.sleep(max(0.0, start_after - (time.monotonic() - t0)))
    began, n = time.time_ns(), 0
    while time.monotonic() - t0 < stop_after:
        for _ in range(20):
            a @ b
        torch.cuda.synchronize()
        n += 20
    ended = time.time_ns()
    Path(out).write_text(json.dumps({"start_ns": began, "end_ns": ended, "matmuls": n,
                                     "tflops": 2 * 8192**3 * n / ((ended - began) / 1e9) / 1e12}))


def run_probe(out: str) -> None:
    """Ask NVML directly what GPU 0 supports, and the native period of nvmlDeviceGetSamples."""
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    res: dict[str, object] = {"driver": str(pynvml.nvmlSystemGetDriverVersion()),
                              "name": str(pynvml.nvmlDeviceGetName(h))}

    def tryit(name: str, fn: object, *a: object) -> None:
        try:
            value = fn(h, *a)  # type: ignore[operator]
            res[name] = value if isinstance(value, (int, float, str)) else str(value)
        except pynvml.NVMLError as e:
            res[name] = f"ERROR {e}"

    tryit("utilization_rates", pynvml.nvmlDeviceGetUtilizationRates)
    tryit("power_usage_mw", pynvml.nvmlDeviceGetPowerUsage)
    tryit("energy_mj", pynvml.nvmlDeviceGetTotalEnergyConsumption)
    tryit("pcie_tx_kb_s", pynvml.nvmlDeviceGetPcieThroughput, pynvml.NVML_PCIE_UTIL_TX_BYTES)
    tryit("sm_clock_mhz", pynvml.nvmlDeviceGetClockInfo, pynvml.NVML_CLOCK_SM)
    tryit("mem_clock_mhz", pynvml.nvmlDeviceGetClockInfo, pynvml.NVML_CLOCK_MEM)
    tryit("clock_event_reasons", pynvml.nvmlDeviceGetCurrentClocksEventReasons)
    tryit("temperature_c", pynvml.nvmlDeviceGetTemperature, pynvml.NVML_TEMPERATURE_GPU)
    fields = {"POWER_INSTANT": pynvml.NVML_FI_DEV_POWER_INSTANT,
              "PCIE_COUNT_TX_BYTES": pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
              "PCIE_COUNT_RX_BYTES": pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES,
              "TOTAL_ENERGY_CONSUMPTION": pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION}
    try:
        vals = pynvml.nvmlDeviceGetFieldValues(h, list(fields.values()))
        res["fields"] = {k: "ok" if v.nvmlReturn == 0 else f"ERROR {v.nvmlReturn}"
                         for k, v in zip(fields, vals, strict=True)}
    except pynvml.NVMLError as e:
        res["fields"] = f"ERROR {e}"
    for kind, label in ((pynvml.NVML_GPU_UTILIZATION_SAMPLES, "gpu"),
                        (pynvml.NVML_MEMORY_UTILIZATION_SAMPLES, "mem")):
        try:
            value_type, samples = pynvml.nvmlDeviceGetSamples(h, kind, 0)
            ts = [int(x.timeStamp) for x in samples]
            gaps = [b - a for a, b in itertools.pairwise(ts) if b > a]
            res[f"samples_{label}"] = {
                "value_type": value_type, "count": len(ts),
                "median_period_us": statistics.median(gaps) if gaps else None,
                "min_period_us": min(gaps) if gaps else None,
                "last_values": [int(x.sampleValue.uiVal) for x in samples][-12:],
                "span_s": (ts[-1] - ts[0]) / 1e6 if ts else None}
        except pynvml.NVMLError as e:
            res[f"samples_{label}"] = f"ERROR {e}"
    try:
        supported = bool(pynvml.nvmlGpmQueryDeviceSupport(h).isSupportedDevice)
        res["gpm_supported"] = supported
        if supported:
            s1, s2 = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
            pynvml.nvmlGpmSampleGet(h, s1)
            time.sleep(0.2)
            pynvml.nvmlGpmSampleGet(h, s2)
            names = ("SM_UTIL", "SM_OCCUPANCY", "ANY_TENSOR_UTIL", "DRAM_BW_UTIL", "PCIE_TX_PER_SEC",
                     "PCIE_RX_PER_SEC", "NVLINK_TOTAL_TX_PER_SEC", "NVLINK_TOTAL_RX_PER_SEC")
            req = pynvml.c_nvmlGpmMetricsGet_t()
            req.version = pynvml.NVML_GPM_METRICS_GET_VERSION
            req.numMetrics = len(names)
            req.sample1, req.sample2 = s1, s2
            for i, n in enumerate(names):
                req.metrics[i].metricId = getattr(pynvml, "NVML_GPM_METRIC_" + n)
            pynvml.nvmlGpmMetricsGet(req)
            res["gpm"] = {n: req.metrics[i].value if req.metrics[i].nvmlReturn == 0
                          else f"ERROR {req.metrics[i].nvmlReturn}" for i, n in enumerate(names)}
    except pynvml.NVMLError as e:
        res["gpm_supported"] = f"ERROR {e}"
    # what one call of each kind costs (median of 50, us): a tick's price is the sum of its calls
    calls = {
        "getSamples_gpu": (pynvml.nvmlDeviceGetSamples, pynvml.NVML_GPU_UTILIZATION_SAMPLES, 0),
        "getFieldValues_4": (pynvml.nvmlDeviceGetFieldValues, list(fields.values())),
        "getPowerUsage": (pynvml.nvmlDeviceGetPowerUsage,),
        "getTotalEnergyConsumption": (pynvml.nvmlDeviceGetTotalEnergyConsumption,),
        "getClockInfo_sm": (pynvml.nvmlDeviceGetClockInfo, pynvml.NVML_CLOCK_SM),
        "getCurrentClocksEventReasons": (pynvml.nvmlDeviceGetCurrentClocksEventReasons,),
        "getMemoryInfo": (pynvml.nvmlDeviceGetMemoryInfo,),
        "getTemperature": (pynvml.nvmlDeviceGetTemperature, pynvml.NVML_TEMPERATURE_GPU),
        "getUtilizationRates": (pynvml.nvmlDeviceGetUtilizationRates,),
    }
    cost_us: dict[str, object] = {}
    for name, (fn, *args) in calls.items():
        times = []
        try:
            for _ in range(50):
                t0 = time.perf_counter()
                fn(h, *args)
                times.append(time.perf_counter() - t0)
            cost_us[name] = round(statistics.median(times) * 1e6, 1)
        except pynvml.NVMLError as e:
            cost_us[name] = f"ERROR {e}"
    res["call_cost_us"] = cost_us
    Path(out).write_text(json.dumps(res, indent=1, default=str))


def ensure_python() -> str:
    """A Python that can import the agent's dependencies (the current one, or a wheelhouse venv)."""
    missing = [m for m in DEPS if subprocess.run([sys.executable, "-c", f"import {m}"],
                                                 capture_output=True).returncode != 0]
    if not missing:
        return sys.executable
    wheels = ROOT / "bench" / "wheels"
    if not wheels.is_dir():
        sys.exit(f"missing {missing} and no wheelhouse at {wheels}; see this script's docstring")
    venv = Path("/tmp/gputrace-h200-venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels),
                    "aiohttp", "prometheus-client", "structlog", "click", "nvidia-ml-py"], check=True)
    return py


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return bytes(resp.read())


def smi_rows(path: Path) -> list[tuple[int, float, float]]:
    rows = []
    for line in path.read_text().splitlines()[1:]:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or "%" not in parts[1]:
            continue
        ts = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=UTC)
        rows.append((int(ts.timestamp() * 1e9), float(parts[1].split()[0]) / 100, float(parts[2].split()[0])))
    return rows


def first_cross(points: list[tuple[int, float]], after_ns: int, above: bool) -> float | None:
    for ts, v in points:
        if ts >= after_ns and (v >= 0.5 if above else v < 0.5):
            return (ts - after_ns) / 1e9
    return None


def summarize(out: Path, agent_cpu_s: float, wall_s: float) -> dict[str, object]:
    load = json.loads((out / "matmul.json").read_text())
    smi = smi_rows(out / "nvidia_smi.csv")
    samples = [json.loads(ln) for ln in (out / "agent_samples.ndjson").read_text().splitlines() if ln]
    g0 = [s for s in samples if s["gpu_index"] == 0]
    util = sorted((s["ts_ns"], s["utilization_ratio"]) for s in g0 if s["utilization_ratio"] is not None)
    power = sorted((s["ts_ns"], s["power_w"]) for s in g0 if s["power_w"] is not None)
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(util)]
    t0 = min(t for t, _ in util)
    bins: dict[int, tuple[list[float], list[float]]] = {}
    for ts, v in util:
        bins.setdefault((ts - t0) // 10**9, ([], []))[0].append(v)
    for ts, v, _ in smi:
        if ts >= t0:
            bins.setdefault((ts - t0) // 10**9, ([], []))[1].append(v)
    both = [(statistics.fmean(a), statistics.fmean(b)) for a, b in bins.values() if a and b]
    smi_util = [(ts, v) for ts, v, _ in smi]
    during = [v for ts, v in power if load["start_ns"] + 2e9 <= ts <= load["end_ns"]]
    smi_during = [p for ts, _, p in smi if load["start_ns"] + 2e9 <= ts <= load["end_ns"]]
    return {
        "load": load,
        "agent_utilization_records": len(util),
        "agent_util_spacing_ms_median": statistics.median(gaps) / 1e6 if gaps else None,
        "util_1s_bins_mean_abs_diff": statistics.fmean(abs(a - b) for a, b in both) if both else None,
        "util_1s_bins": len(both),
        "rise_s_agent": first_cross(util, load["start_ns"], True),
        "rise_s_smi": first_cross(smi_util, load["start_ns"], True),
        "fall_s_agent": first_cross(util, load["end_ns"], False),
        "fall_s_smi": first_cross(smi_util, load["end_ns"], False),
        "power_w_under_load_agent_median": statistics.median(during) if during else None,
        "power_w_under_load_smi_median": statistics.median(smi_during) if smi_during else None,
        "agent_cpu_s": agent_cpu_s, "wall_s": wall_s,
        "agent_core_percent": agent_cpu_s / wall_s * 100,
        "agent_samples_total": len(samples),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--port", type=int, default=19402)
    parser.add_argument("--matmul", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.matmul:
        run_matmul(float(args.matmul[0]), float(args.matmul[1]), args.matmul[2])
        return
    if args.probe:
        run_probe(args.probe)
        return
    if args.out is None or shutil.which("nvidia-smi") is None:
        # `make bench` runs every bench script: without a GPU this one has nothing to measure
        print("agent_h200: skipped (needs an NVIDIA GPU with nvidia-smi, and --out DIR)")
        return
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    py = ensure_python()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TZ": "UTC"}
    base = f"http://127.0.0.1:{args.port}"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,utilization.gpu,power.draw",
                                "--format=csv", "-lms", "100", "-i", "0"],
                               stdout=(out / "nvidia_smi.csv").open("wb"), env=env)
        procs.append(smi)
        agent = subprocess.Popen([py, "-m", "gputrace", "--log-format", "json", "agent", "--backend", "nvml",
                                  "--interval", "0.1", "--listen", f"127.0.0.1:{args.port}"],
                                 stderr=(out / "agent.log").open("wb"), env=env)
        procs.append(agent)
        t_start = time.monotonic()
        for _ in range(100):
            try:
                get(base + "/healthz")
                break
            except OSError:
                time.sleep(0.1)
        cpu0, wall0 = proc_cpu_s(agent.pid), time.monotonic()
        load = subprocess.Popen([py, __file__, "--matmul", "5", "20", str(out / "matmul.json")], env=env)
        procs.append(load)
        since, probed = 0, False
        with (out / "agent_samples.ndjson").open("wb") as f:
            while time.monotonic() - t_start < 30:
                body = get(f"{base}/v1/samples?since={since}&limit=10000")
                f.write(body)
                for line in body.splitlines():
                    since = max(since, json.loads(line)["seq"])
                if not probed and time.monotonic() - t_start > 12:
                    probed = True
                    subprocess.run([py, __file__, "--probe", str(out / "nvml_probe.json")], env=env,
                                   timeout=60)
                time.sleep(0.5)
            f.write(get(f"{base}/v1/samples?since={since}&limit=10000"))
        agent_cpu, wall = proc_cpu_s(agent.pid) - cpu0, time.monotonic() - wall0
        (out / "metrics.txt").write_bytes(get(base + "/metrics"))
        (out / "info.json").write_bytes(get(base + "/v1/info"))
        load.wait(timeout=60)
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
    summary = summarize(out, agent_cpu, wall)
    summary["probe"] = json.loads((out / "nvml_probe.json").read_text())
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    main()
