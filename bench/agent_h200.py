"""Prepared device check (H200): does the NVML agent track nvidia-smi, and what does it cost?

NOT a benchmark of this repository's CPU-only CI: it needs an NVIDIA GPU, its driver, PyTorch, and
the agent's dependencies. One run (about 45 s) on the device machine:

  t=0      nvidia-smi --query-gpu=timestamp,utilization.gpu,power.draw --format=csv -lms 100 starts,
           and `gputrace agent --backend nvml --interval 0.1` starts on a loopback port;
  t=5-20s  a PyTorch bf16 matmul loop keeps GPU 0 busy (5 s and 20 s after PyTorch is imported);
  t=20-25s one thread spins on the GPU (torch.cuda._sleep kernels back to back): what a stage
           waiting in an NCCL receive looks like to NVML, a kernel resident on one SM of 132;
  t=12s    a direct NVML probe: every metric's support (GPM included) and the native period of
           nvmlDeviceGetSamples (median spacing of the driver's utilization samples);
  +4.5 s   after the spin everything stops; the agent's samples (pulled from /v1/samples during
           the run), the nvidia-smi CSV, /metrics, /v1/info and a summary land in --out.

The summary gives, per phase (matmul, spin, idle after), the mean of the agent's utilization.gpu,
its GPM SM activity and nvidia-smi's utilization; it compares the two sources over 1 s bins and
at the load edges (first time >= 50 % after the loop starts, first time < 50 % after the spin
stops), the agent's power against nvidia-smi's, and the agent's CPU use (utime + stime of its
process over the run).

    python3 bench/agent_h200.py --out "$OUT"        # on the device machine

Dependencies: if aiohttp, prometheus_client, structlog, click or pynvml is not importable, the wheels
in bench/wheels/ are installed with --target into a folder put on PYTHONPATH (prepare them where the
registry is reachable: `pip download -d bench/wheels --no-deps --only-binary=:all: --python-version
3.12 structlog nvidia-ml-py`; the device machine has no network and its image lacks structlog).
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
SPIN_S = 5.0  # after the matmuls: one spinning thread for this long
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
    spins = 0
    while time.monotonic() - t0 < stop_after + SPIN_S:
        torch.cuda._sleep(100_000_000)  # one thread busy-waits ~50 ms at 1.98 GHz, as a stage in recv
        torch.cuda.synchronize()
        spins += 1
    spin_ended = time.time_ns()
    Path(out).write_text(json.dumps({"start_ns": began, "end_ns": ended, "matmuls": n,
                                     "spin_end_ns": spin_ended, "spins": spins,
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
        "getSamples_mem": (pynvml.nvmlDeviceGetSamples, pynvml.NVML_MEMORY_UTILIZATION_SAMPLES, 0),
        "getFieldValues_4": (pynvml.nvmlDeviceGetFieldValues, list(fields.values())),
        "getFieldValues_power_instant": (pynvml.nvmlDeviceGetFieldValues, [fields["POWER_INSTANT"]]),
        "getFieldValues_pcie_counts": (pynvml.nvmlDeviceGetFieldValues,
                                       [fields["PCIE_COUNT_TX_BYTES"], fields["PCIE_COUNT_RX_BYTES"]]),
        "getFieldValues_energy": (pynvml.nvmlDeviceGetFieldValues, [fields["TOTAL_ENERGY_CONSUMPTION"]]),
        "getPowerUsage": (pynvml.nvmlDeviceGetPowerUsage,),
        "getTotalEnergyConsumption": (pynvml.nvmlDeviceGetTotalEnergyConsumption,),
        "getClockInfo_sm": (pynvml.nvmlDeviceGetClockInfo, pynvml.NVML_CLOCK_SM),
        "getCurrentClocksEventReasons": (pynvml.nvmlDeviceGetCurrentClocksEventReasons,),
        "getMemoryInfo": (pynvml.nvmlDeviceGetMemoryInfo,),
        "getTemperature": (pynvml.nvmlDeviceGetTemperature, pynvml.NVML_TEMPERATURE_GPU),
        "getUtilizationRates": (pynvml.nvmlDeviceGetUtilizationRates,),
    }
    if res.get("gpm_supported") is True:
        calls["gpmSampleGet"] = (pynvml.nvmlGpmSampleGet, pynvml.nvmlGpmSampleAlloc())
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
    res["sampler"] = sampler_cost()
    Path(out).write_text(json.dumps(res, indent=1, default=str))


def sampler_cost(ticks: int = 50) -> dict[str, float]:
    """The agent's NVML sampler alone, ticked at 10 Hz in this process: its CPU per tick (the
    agent's process CPU adds the event loop, the HTTP pages and the ring to it)."""
    from gputrace.gpu.nvml import NvmlSampler

    sampler = NvmlSampler("probe")
    try:
        c0, rows = time.process_time(), 0
        for _ in range(ticks):
            rows += len(sampler.sample_rows(time.time_ns()))
            time.sleep(0.1)
        cpu_s = time.process_time() - c0
    finally:
        sampler.close()
    return {"ticks": ticks, "rows": rows, "cpu_ms_per_tick": round(cpu_s * 1000 / ticks, 3),
            "core_percent_at_10hz": round(cpu_s / ticks * 10 * 100, 3)}


def ensure_python_path() -> str:
    """PYTHONPATH entries beyond the repo that make the agent's dependencies importable.

    The device image's python3 is itself a virtual environment (PyTorch's): a venv made from it with
    --system-site-packages would see the base interpreter's packages, not PyTorch or aiohttp. So the
    wheelhouse is installed with --target into a folder put on PYTHONPATH, beside what is there.
    """
    missing = [m for m in DEPS if subprocess.run([sys.executable, "-c", f"import {m}"],
                                                 capture_output=True).returncode != 0]
    if not missing:
        return ""
    wheels = sorted((ROOT / "bench" / "wheels").glob("*.whl"))
    if not wheels:
        sys.exit(f"missing {missing} and no wheels in {ROOT / 'bench' / 'wheels'}; see the docstring")
    site = "/tmp/gputrace-h200-site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site,
                    *map(str, wheels)], check=True)
    still = [m for m in DEPS if subprocess.run([sys.executable, "-c", f"import {m}"], capture_output=True,
                                               env={**os.environ, "PYTHONPATH": site}).returncode != 0]
    if still:
        sys.exit(f"still missing {still} after installing {[w.name for w in wheels]}")
    return site


def load_done_for(path: Path, seconds: float) -> bool:
    """The load process wrote its file at least `seconds` ago (its start waits for PyTorch's import,
    so the phases are placed by what it wrote, not by this script's clock)."""
    return path.exists() and time.time() - path.stat().st_mtime >= seconds


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


def phase_means(g0: list[dict], smi: list[tuple[int, float, float]],
                load: dict) -> dict[str, dict[str, float | None]]:
    """Mean agent utilization.gpu, GPM SM activity and nvidia-smi utilization per phase (1 s margins)."""
    phases = {"matmul": (load["start_ns"] + 10**9, load["end_ns"] - 10**9),
              "spin": (load["end_ns"] + 10**9, load["spin_end_ns"] - 10**9),
              "idle_after": (load["spin_end_ns"] + 2 * 10**9, load["spin_end_ns"] + 4 * 10**9)}

    def mean(values: list[float]) -> float | None:
        return statistics.fmean(values) if values else None

    result = {}
    for name, (lo, hi) in phases.items():
        inside = [s for s in g0 if lo <= s["ts_ns"] <= hi]
        result[name] = {
            "agent_utilization": mean([s["utilization_ratio"] for s in inside
                                       if s.get("utilization_ratio") is not None]),
            "agent_sm_active": mean([s["sm_active_ratio"] for s in inside
                                     if s.get("sm_active_ratio") is not None]),
            "agent_tensor_active": mean([s["tensor_active_ratio"] for s in inside
                                         if s.get("tensor_active_ratio") is not None]),
            "smi_utilization": mean([v for ts, v, _ in smi if lo <= ts <= hi]),
        }
    return result


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
        "phase_means": phase_means(g0, smi, load),
        "agent_utilization_records": len(util),
        "agent_util_spacing_ms_median": statistics.median(gaps) / 1e6 if gaps else None,
        "util_1s_bins_mean_abs_diff": statistics.fmean(abs(a - b) for a, b in both) if both else None,
        "util_1s_bins": len(both),
        "rise_s_agent": first_cross(util, load["start_ns"], True),
        "rise_s_smi": first_cross(smi_util, load["start_ns"], True),
        "fall_s_agent": first_cross(util, load["spin_end_ns"], False),
        "fall_s_smi": first_cross(smi_util, load["spin_end_ns"], False),
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
    parser.add_argument("--quick", action="store_true",
                        help="small inputs, one repeat: the users' code path (tests/test_bench_quick.py)")
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
    py = sys.executable
    extra = ensure_python_path()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), extra])), "TZ": "UTC"}
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
            while not load_done_for(out / "matmul.json", 4.5) and time.monotonic() - t_start < 90:
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
