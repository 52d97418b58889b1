"""`gputrace report --prometheus` against long-term stores: a real VictoriaMetrics (its
Prometheus-compatible query API) holding the same backfilled DCGM and SGLang series as a real
Prometheus gives the same findings ([scale] Must show 5); a query whose step is coarser than the
data's own interval (downsampled, as Thanos' 5 m and 1 h resolutions are) gets no bubble figures,
and the report says why."""

from __future__ import annotations

import contextlib
import json
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import require_binary
from live_chain import free_port, gputrace_argv, http_ok, wait_until
from test_report_prometheus_backfill import _dcgm_lines, _engine_lines, backfilled_prometheus

from gputrace.demo import child_process
from gputrace.imports.prometheus import coarse_step_reason
from gputrace.sim import run_scenario
from gputrace.sim.outputs import write_store
from gputrace.store import Store

FLAGS = ["--max-running-requests", "32"]


def _exposition_ms(lines: list[str]) -> str:
    """The OpenMetrics lines (timestamps in seconds) as Prometheus' text format with millisecond
    timestamps, which VictoriaMetrics' /api/v1/import/prometheus takes."""
    out = []
    for line in lines:
        if line.startswith("#"):
            continue
        head, ts = line.rsplit(" ", 1)
        out.append(f"{head} {int(ts) * 1000}")
    return "\n".join(out) + "\n"


@contextlib.contextmanager
def backfilled_victoria_metrics(work: Path, lines: list[str]) -> Iterator[str]:
    """A VictoriaMetrics single node holding ``lines``, imported through its HTTP API; its URL."""
    binary = require_binary("/usr/bin/victoria-metrics", "victoria-metrics")
    port = free_port()
    with child_process([binary, f"-storageDataPath={work / 'vm-data'}", f"-httpListenAddr=127.0.0.1:{port}",
                  "-retentionPeriod=100y", "-search.latencyOffset=0s"], work / "vm.out") as proc:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: http_ok(f"{base}/health"), what="VictoriaMetrics ready", proc=proc)
        body = _exposition_ms(lines).encode()
        with urllib.request.urlopen(urllib.request.Request(f"{base}/api/v1/import/prometheus", data=body),
                                    timeout=60) as resp:
            assert resp.status == 204
        with urllib.request.urlopen(f"{base}/internal/force_flush", timeout=60):
            pass  # what was imported is searchable from here on
        yield base


def _report(prom: str, start_s: int, end_s: int, out: Path, step: str = "1s") -> tuple[dict[str, Any], str]:
    done = subprocess.run(gputrace_argv(
        "report", "--prometheus", prom, "--start", str(start_s), "--end", str(end_s), "--step", step,
        *FLAGS, "--run-out", str(out / "run"), "--out", str(out / "report"), "--format", "json"),
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "report" / "findings.json").read_text()), done.stdout


def _findings(doc: dict[str, Any]) -> list[tuple[str, str, list[int]]]:
    return sorted((f["cause"], f["phase"], f["stages"]) for f in doc["findings"])


@pytest.fixture(scope="module")
def pool_bound(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], int, int]:
    """The pool-bound scenario's DCGM and SGLang series, and its span in unix seconds."""
    tmp = tmp_path_factory.mktemp("pool-bound")
    result = run_scenario("pool-bound", 0)
    write_store(result, tmp / "sim")
    with Store.open(tmp / "sim", read_only=True) as store:
        lines = _dcgm_lines(store) + _engine_lines(store)
    start_s = result.start_ns // 10**9
    return lines, start_s, start_s + int(result.end_s) + 1


@pytest.mark.system
@pytest.mark.slow
def test_victoria_metrics_gives_the_findings_prometheus_gives(pool_bound: tuple[list[str], int, int],
                                                             tmp_path: Path) -> None:
    """The same series backfilled into Prometheus (promtool) and VictoriaMetrics (its import API):
    the same phases, findings and per-stage busy and bubble fractions from both."""
    lines, start_s, end_s = pool_bound
    for d in ("p", "v"):
        (tmp_path / d).mkdir()
    with backfilled_prometheus(tmp_path / "p", lines) as prom:
        from_prom, _ = _report(prom, start_s, end_s, tmp_path / "p")
    with backfilled_victoria_metrics(tmp_path / "v", lines) as vm:
        from_vm, out = _report(vm, start_s, end_s, tmp_path / "v")
    assert "series found: DCGM_FI_DEV_CLOCKS_EVENT_REASONS, DCGM_FI_DEV_GPU_UTIL" in out
    assert from_prom["findings"] and _findings(from_vm) == _findings(from_prom)
    assert [p["label"] for p in from_vm["phases"]] == [p["label"] for p in from_prom["phases"]]
    for a, b in zip(from_vm["table"], from_prom["table"], strict=True):
        assert (a["phase"], a["pp_rank"]) == (b["phase"], b["pp_rank"])
        for key in ("busy_fraction", "bubble_fraction"):
            assert a[key] is not None and abs(a[key] - b[key]) < 0.01, (a["phase"], a["pp_rank"], key)


@pytest.mark.system
def test_a_step_coarser_than_the_data_gets_no_bubble_figures(pool_bound: tuple[list[str], int, int],
                                                             tmp_path: Path) -> None:
    """Series held every second, queried every 5 s (what a downsampled store answers): the
    report gives no busy or bubble fraction and says why, on the command line and in its notes;
    at 1 s the same store gives them (the test above)."""
    lines, start_s, end_s = pool_bound
    with backfilled_victoria_metrics(tmp_path, lines) as vm:
        doc, out = _report(vm, start_s, end_s, tmp_path, step="5s")
    why = "the query step (5 s) is coarser than the GPU series' own interval (1 s"
    assert why in out
    assert any(why in n for n in doc["notes"])
    assert doc["table"] and all(r["busy_fraction"] is None and r["bubble_fraction"] is None
                                for r in doc["table"])


def test_coarse_step_reason_names_the_step_and_the_interval() -> None:
    """Refused past 1.5 intervals (Thanos' 5 m over 1 s samples); a step at the data's interval,
    or an interval not known, is not refused."""
    assert coarse_step_reason(1000, 1000) is None and coarse_step_reason(300_000, None) is None
    reason = coarse_step_reason(300_000, 1000)
    assert reason is not None and "(300 s)" in reason and "(1 s;" in reason and "--step 1s" in reason
