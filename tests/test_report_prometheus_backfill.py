"""`gputrace report --prometheus` on what clusters already run: a real Prometheus backfilled with
promtool from a PP8 simulator run, holding dcgm-exporter's series under its exact names, units
and labels and SGLang's own ``sglang:*`` metrics per pp_rank, nothing of gputrace's. The report's
findings equal the scenario's ground truth ([metrics] Must show 2)."""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import require_binary
from live_chain import free_port, gputrace_argv, http_ok, process, wait_until

from gputrace.sim import run_scenario
from gputrace.sim.outputs import write_store
from gputrace.store import Store

SCRAPE_S = 1  # Prometheus' scrape interval and dcgm-exporter's collect interval (-c 1000)
# dcgm-exporter's name, its unit per gputrace's SI field, the field
DCGM_SERIES = (("DCGM_FI_DEV_GPU_UTIL", 100.0, "utilization_ratio"),
               ("DCGM_FI_PROF_SM_ACTIVE", 1.0, "sm_active_ratio"),
               ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", 1.0, "utilization_ratio"),
               ("DCGM_FI_DEV_POWER_USAGE", 1.0, "power_w"),
               ("DCGM_FI_PROF_PCIE_TX_BYTES", 1.0, "pcie_tx_bytes_per_s"),
               ("DCGM_FI_PROF_PCIE_RX_BYTES", 1.0, "pcie_rx_bytes_per_s"),
               ("DCGM_FI_DEV_SM_CLOCK", 1e-6, "sm_clock_hz"),
               ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", 1.0, "clock_event_reasons"))
# The same series under dcgm-exporter 4.10's names (4.9's DCGM 4.7 renames in SI units, PCIe
# *_PER_SECOND): utilization a ratio, clocks in Hz
DCGM_SERIES_4_10 = (("DCGM_FI_DEV_GPU_UTIL_RATIO", 1.0, "utilization_ratio"),
                    ("DCGM_FI_PROF_SM_UTIL_RATIO", 1.0, "sm_active_ratio"),
                    ("DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO", 1.0, "utilization_ratio"),
                    ("DCGM_FI_DEV_BOARD_POWER_WATTS", 1.0, "power_w"),
                    ("DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND", 1.0, "pcie_tx_bytes_per_s"),
                    ("DCGM_FI_PROF_PCIE_RX_BYTES_PER_SECOND", 1.0, "pcie_rx_bytes_per_s"),
                    ("DCGM_FI_DEV_SM_CLOCK_HERTZ", 1.0, "sm_clock_hz"),
                    ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", 1.0, "clock_event_reasons"))
ENGINE_SERIES = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput",
                 "sglang:token_usage")
E2E = "sglang:e2e_request_latency_seconds"  # SGLang's end-to-end latency histogram (_sum, _count)


def _labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def _dcgm_lines(store: Store, series: tuple[tuple[str, float, str], ...] = DCGM_SERIES) -> list[str]:
    """The GPU samples as dcgm-exporter exports them, one value a second: the mean of the second's
    samples (DCGM averages its profiling fields over the collect interval)."""
    devices = {d["gpu_index"]: d for d in store.arrow("devices").to_pylist()}
    g = store.columns("gpu_samples", order_by="gpu_index, ts_ns")
    out = []
    for name, scale, attr in series:
        out.append(f"# TYPE {name} gauge")
        for gpu, dev in sorted(devices.items()):
            mine = g["gpu_index"] == gpu
            # a sample at 1.0 s belongs to the first second
            second = (g["ts_ns"][mine] - 1) // (SCRAPE_S * 10**9) + 1
            values = np.asarray(g[attr][mine], dtype=np.float64)
            labels = _labels({"gpu": str(gpu), "UUID": dev["uuid"], "pci_bus_id": dev["pci_bus_id"],
                              "device": f"nvidia{gpu}", "modelName": dev["name"], "Hostname": dev["host"]})
            for s in np.unique(second):
                v = values[second == s]
                v = v[~np.isnan(v)]
                if len(v):
                    value = int(v[-1]) if attr == "clock_event_reasons" else float(np.mean(v)) * scale
                    out.append(f"{name}{labels} {value} {int(s) * SCRAPE_S}")
    return out


def _engine_lines(store: Store) -> list[str]:
    """SGLang's /metrics as the simulator's engine exposed it, scraped every second."""
    m = store.columns("engine_metrics", order_by="name, labels_json, ts_ns")

    def samples(name: str, as_name: str, extra: str = "") -> list[str]:
        rows = m["name"] == name
        # a scrape at t lands on the next whole second, where Prometheus' step evaluates it
        return [f"{as_name}{_labels({**json.loads(lj), **({'le': extra} if extra else {})})} {value} "
                f"{-(-int(ts_ns) // 10**9)}"
                for lj, ts_ns, value in zip(m["labels_json"][rows], m["ts_ns"][rows], m["value"][rows],
                                            strict=True)]

    out = []
    for name in ENGINE_SERIES:
        out.append(f"# TYPE {name} gauge")
        out += samples(name, name)
    # the histogram without its finite buckets: +Inf holds the count
    out.append(f"# TYPE {E2E} histogram")
    out += samples(E2E + "_count", E2E + "_bucket", "+Inf") + samples(E2E + "_count", E2E + "_count") + \
        samples(E2E + "_sum", E2E + "_sum")
    return out


@contextlib.contextmanager
def backfilled_prometheus(work: Path, lines: list[str]) -> Iterator[str]:
    """A Prometheus whose TSDB promtool built from ``lines`` (OpenMetrics); yields its URL."""
    promtool = require_binary("/usr/bin/promtool", "promtool")
    binary = require_binary("/usr/bin/prometheus", "prometheus")
    data = work / "prom-data"
    (work / "metrics.om").write_text("\n".join(lines) + "\n# EOF\n")
    subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", "-q", str(work / "metrics.om"),
                    str(data)], check=True, capture_output=True, timeout=120)
    config = work / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\nscrape_configs: []\n")
    port = free_port()
    with process([binary, f"--config.file={config}", f"--storage.tsdb.path={data}",
                  "--storage.tsdb.retention.time=100y", f"--web.listen-address=127.0.0.1:{port}"],
                 work / "prometheus.out") as proc:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: http_ok(f"{base}/-/ready"), what="Prometheus ready", proc=proc)
        yield base


def _overlap(a: dict[str, Any], start_ns: int, end_ns: int) -> float:
    lo = max(a["start_ns"], start_ns)
    hi = min(a["end_ns"], end_ns)
    return max(hi - lo, 0)


@pytest.mark.system
@pytest.mark.parametrize(("scenario", "flags"), [
    ("pool-bound", ["--max-running-requests", "32"]),
    ("microbatch-cap", ["--max-running-requests", "64", "--pp-max-micro-batch-size", "2"]),
])
def test_report_from_dcgm_and_sglang_series_finds_the_ground_truth(scenario: str, flags: list[str],
                                                                   tmp_path: Path) -> None:
    """From DCGM_FI_* and sglang:* series alone (the engine's settings given as flags), every
    phase of the ground truth gets its causes; the report says which series it found and lacked."""
    result = run_scenario(scenario, 0)
    write_store(result, tmp_path / "sim")
    with Store.open(tmp_path / "sim", read_only=True) as store:
        lines = _dcgm_lines(store) + _engine_lines(store)
        truth = store.meta.extra["ground_truth"]
    assert not [ln for ln in lines if ln.startswith("gputrace_")]
    start_s, end_s = result.start_ns // 10**9, result.start_ns // 10**9 + int(result.end_s) + 1
    with backfilled_prometheus(tmp_path, lines) as prom:
        done = subprocess.run(gputrace_argv(
            "report", "--prometheus", prom, "--start", str(start_s), "--end", str(end_s), "--step", "1s",
            *flags, "--run-out", str(tmp_path / "run"), "--out", str(tmp_path / "report"),
            "--format", "json"),
            capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "series found: DCGM_FI_DEV_CLOCKS_EVENT_REASONS, DCGM_FI_DEV_GPU_UTIL" in done.stdout
    assert "lacking (no series for): client load" in done.stdout
    doc = json.loads((tmp_path / "report" / "findings.json").read_text())
    assert any("Prometheus had no series for: client load" in n for n in doc["notes"])
    # the load is the engine's running + waiting, which never reads more than was offered ([busy] #27)
    assert "the engine's running + waiting" in doc["summary"]["phase_source"]
    assert all(f["evidence"]["limit_is_lower_bound"] and "at least" in f["recommendation"]
               for f in doc["findings"] if f["cause"] == "admission_bound")
    for phase in truth["phases"]:
        if not phase["causes"]:
            continue
        best = max(doc["phases"], key=lambda p: _overlap(p, phase["start_ns"], phase["end_ns"]))
        found = sorted({f["cause"] for f in doc["findings"] if f["phase"] == best["label"]})
        assert found == sorted(phase["causes"]), (phase["label"], best["label"], doc["findings"])


@pytest.mark.system
def test_both_dcgm_exporter_schemas_give_the_same_findings(tmp_path: Path) -> None:
    """[busy] Must show 5: the same run backfilled under dcgm-exporter's names before 4.9 (%, MHz)
    and under 4.10's (4.9's DCGM 4.7 renames in ratios and Hz, PCIe *_PER_SECOND): each import says
    which schema it found, converts each series by its own name, and the findings are the same."""
    result = run_scenario("microbatch-cap", 0)
    write_store(result, tmp_path / "sim")
    start_s, end_s = result.start_ns // 10**9, result.start_ns // 10**9 + int(result.end_s) + 1
    findings, busy = {}, {}
    for schema, series in (("4.8", DCGM_SERIES), ("4.10", DCGM_SERIES_4_10)):
        work = tmp_path / schema
        work.mkdir()
        with Store.open(tmp_path / "sim", read_only=True) as store:
            lines = _dcgm_lines(store, series) + _engine_lines(store)
        with backfilled_prometheus(work, lines) as prom:
            done = subprocess.run(gputrace_argv(
                "report", "--prometheus", prom, "--start", str(start_s), "--end", str(end_s), "--step", "1s",
                "--max-running-requests", "64", "--pp-max-micro-batch-size", "2", "--run-out",
                str(work / "run"), "--out", str(work / "report"), "--format", "json"),
                capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"dcgm-exporter schema: {schema} " in done.stdout, done.stdout
        doc = json.loads((work / "report" / "findings.json").read_text())
        findings[schema] = sorted((f["phase"], f["cause"]) for f in doc["findings"])
        busy[schema] = [(row["phase"], row["pp_rank"], round(row["busy_fraction"] or 0, 3))
                        for row in doc["table"]]
        with Store.open(work / "run", read_only=True) as store:
            g = store.columns("gpu_samples")
        assert np.nanmax(g["utilization_ratio"]) <= 1.0 and np.nanmin(g["sm_clock_hz"]) > 1e8  # SI units
    assert findings["4.8"] == findings["4.10"] and findings["4.8"]
    assert busy["4.8"] == busy["4.10"]


def _load_lines(start_s: int, phases: list[tuple[int, int]]) -> list[str]:
    """gputrace's client gauges as the collector exports them, one value a second: the target
    concurrency of each (seconds, level) phase in turn from ``start_s``, the requests in flight at it."""
    out = [f"# TYPE {name} gauge" for name in ("gputrace_load_target_concurrency",
                                                "gputrace_load_inflight_requests")]
    t = start_s
    for seconds, level in phases:
        for s in range(t, t + seconds):
            out += [f'gputrace_load_target_concurrency{{run="r"}} {level} {s}',
                    f'gputrace_load_inflight_requests{{run="r"}} {level} {s}']
        t += seconds
    return out


def _import_range(prom: str, run: Path, start_s: int, end_s: int) -> tuple[str, dict[str, Any]]:
    """`report --prometheus` over [start, end] into ``run``: its output, and what the run then holds
    (rows per table, the markers)."""
    done = subprocess.run(gputrace_argv(
        "report", "--prometheus", prom, "--start", str(start_s), "--end", str(end_s), "--step", "1s",
        "--max-running-requests", "32", "--run-out", str(run), "--out",
        str(run.parent / f"{run.name}-report"), "--format", "json"),
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with Store.open(run, read_only=True) as store:
        held: dict[str, Any] = {t: store.count(t) for t in (
            "gpu_samples", "scheduler_events", "load_samples", "devices", "engine_configs")}
        held["markers"] = store.sql("SELECT ts_ns, label, kind FROM markers ORDER BY ts_ns, kind")
        held["steps"] = store.sql("SELECT count(DISTINCT ts_ns) FROM gpu_samples")[0][0]
    return done.stdout, held


@pytest.mark.system
def test_a_range_imported_again_adds_nothing_and_an_overlap_only_its_new_steps(tmp_path: Path) -> None:
    """[robust] #45, Prometheus: the same range imported twice into one --run-out adds nothing (the
    second import says what it found there already); a range overlapping it adds only its new
    steps, and the run then holds what one import of both ranges holds, the phase markers derived
    anew over both (a C=16 phase imported from its middle first, its start later); a range at
    another step is refused in one line. Before: the second import into the run was refused ('a
    run already exists there; choose another --out', naming a flag `report` does not have)."""
    result = run_scenario("pool-bound", 0)
    write_store(result, tmp_path / "sim")
    start_s, end_s = result.start_ns // 10**9, result.start_ns // 10**9 + int(result.end_s)
    with Store.open(tmp_path / "sim", read_only=True) as store:
        lines = _dcgm_lines(store) + _engine_lines(store) + _load_lines(start_s, [(60, 16), (60, 64)])
    later = (start_s + 30, end_s)  # from the middle of the C=16 phase on
    earlier = (start_s, start_s + 90)  # overlaps it by 60 s
    with backfilled_prometheus(tmp_path, lines) as prom:
        _, once = _import_range(prom, tmp_path / "run", *later)
        again_out, again = _import_range(prom, tmp_path / "run", *later)
        _, grown = _import_range(prom, tmp_path / "run", *earlier)
        _, both = _import_range(prom, tmp_path / "both", start_s, end_s)
        other_step = subprocess.run(gputrace_argv(
            "report", "--prometheus", prom, "--start", str(start_s), "--end", str(end_s), "--step", "2s",
            "--run-out", str(tmp_path / "run"), "--out", str(tmp_path / "step-report")),
            capture_output=True, text=True, timeout=300)
    # another step's rows would be other rows of the same times: refused in one line, nothing added
    assert (other_step.returncode, other_step.stderr.splitlines()) == (2, [
        f"gputrace: error: {tmp_path / 'run'} holds an import from {prom} at a 1000 ms step: a Prometheus "
        "range is added only to an import of the same server, step and --match; choose another --run-out"])
    assert once["gpu_samples"] > 0 and once["load_samples"] > 0 and once["scheduler_events"] > 0
    assert again == once, again_out
    (held,) = [line for line in again_out.splitlines() if "(not added again)" in line]
    assert (f"8 devices, 1 engine_configs, {once['gpu_samples']} gpu_samples, {once['load_samples']} "
            f"load_samples, {once['scheduler_events']} scheduler_events") in held, held
    # the 30 s before the later range, less the range's first second (the exporter's first value
    # is stamped at its end)
    assert both["steps"] - once["steps"] == later[0] - start_s - 1
    with Store.open(tmp_path / "run", read_only=True) as store:
        assert store.count("gpu_samples") == grown["gpu_samples"]
    assert grown == both
    # (the C=64 phase runs on to the range's end: Prometheus holds a gauge's last value 5 minutes)
    assert [(label, kind) for _, label, kind in grown["markers"]] == [
        ("C=16", "phase"), ("end", "end"), ("C=64", "phase")]
    assert grown["markers"][0][0] == start_s * 10**9
