"""Every PromQL expression of the Grafana dashboard returns data from a real Prometheus scraping a
live chain: a simulated SGLang PP8 engine, its agent, and `gputrace run` driving the built-in load;
`gputrace panels` renders every panel from what that Prometheus returns."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from live_chain import HOST, free_port, gputrace_argv, http_ok, process, prometheus, sim_chain, wait_until

from gputrace.analysis.diagnose import CAUSES
from gputrace.dashboard import PanelResult, dashboard_queries, variable_queries
from gputrace.prometheus.client import PrometheusClient
from gputrace.prometheus.panels import query_panels, query_phase_marks
from gputrace.report.panels import heatmap_rows, panel_figure, stat_value

pytestmark = [pytest.mark.system, pytest.mark.slow]


def prom_get(base: str, path: str, params: dict[str, str]) -> Any:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]


def test_every_dashboard_query_returns_series(tmp_path: Path) -> None:
    """During a live sweep, each panel expression (variables at All) returns at least one series."""
    with sim_chain(tmp_path / "chain") as c:
        collector_port = free_port()
        began_s = time.time()
        run_argv = gputrace_argv("run", "--config", str(c.config), "--out", str(tmp_path / "run"),
                                 "--listen", f"127.0.0.1:{collector_port}", "--url", c.engine_url,
                                 "--model", "default", "--concurrency", "8", "--duration-per-level", "60",
                                 "--max-tokens", "64", "--warmup", "0", "--no-report")
        with process(run_argv, tmp_path / "run.out") as run, \
                prometheus(tmp_path, {"agent": c.agent_port, "collector": collector_port}) as prom:
            wait_until(lambda: http_ok(f"http://127.0.0.1:{collector_port}/healthz"), what="collector",
                       proc=run)
            missing: dict[str, str] = {}

            def all_answer(variables: dict[str, str] | None = None) -> bool:
                missing.clear()
                for q in dashboard_queries(variables=variables):
                    result = prom_get(prom, "/api/v1/query", {"query": q.expr})["result"]
                    if not result:
                        missing[f"{q.panel} / {q.ref_id}"] = q.expr
                return not missing
            try:
                wait_until(all_answer, timeout_s=45, what="every dashboard query answers", proc=run)
            except AssertionError as exc:
                raise AssertionError(f"{exc}; without series: {json.dumps(missing, indent=1)}") from None
            chosen: dict[str, str] = {}
            for var in variable_queries():
                values = prom_get(prom, f"/api/v1/label/{var.label}/values", {"match[]": var.match})
                assert values, f"variable ${var.name}: no values for {var.label} from {var.match}"
                chosen[var.name] = values[0]
            assert chosen == {"host": HOST, "run": "live"}
            # As when a user picks the host and the run in Grafana's drop-downs.
            assert all_answer(chosen), f"with {chosen}, without series: {json.dumps(missing, indent=1)}"
            stages = prom_get(prom, "/api/v1/query",
                              {"query": "count(count by (pp_rank) (gputrace_stage_bubble_ratio))"})["result"]
            assert float(stages[0]["value"][1]) == 8
            # the engine's figures as the panels show them: 8 stages; C=8 at K=2 runs in a few
            # micro-batches, the phase annotation sits at the phase's start (milliseconds)
            def value(expr: str) -> float:
                return float(prom_get(prom, "/api/v1/query", {"query": expr})["result"][0]["value"][1])
            assert value("max(gputrace_engine_pipeline_stages)") == 8
            assert 1 <= value("max(gputrace_engine_microbatches_in_flight)") <= 8
            assert value("max(gputrace_engine_max_running_requests)") == 64
            phase_ms = value("max by (phase) (gputrace_load_phase_start_seconds) * 1000")
            assert abs(phase_ms / 1000 - time.time()) < 120
            check_rendered_panels(prom, began_s, tmp_path / "panels")
            run.send_signal(signal.SIGINT)  # the sweep would run its minute; stop it cleanly
            deadline = time.monotonic() + 30
            while run.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert run.returncode == 0, (tmp_path / "run.out").read_text()[-2000:]


def check_rendered_panels(prom: str, began_s: float, out: Path) -> None:
    """`gputrace panels` writes a PNG per panel and index.html; the panels drawn hold what the
    queries returned: every panel has series, the stages line reads 8, the busy heatmap one row
    per stage with the busy figures Prometheus holds, the agents stat 1."""
    def scraped_s() -> float:  # seconds of the run Prometheus holds
        found = prom_get(prom, "/api/v1/query", {"query": "count_over_time(gputrace_load_ttft_seconds"
                                                          '{quantile="0.5"}[1m])'})["result"]
        return float(found[0]["value"][1]) if found else 0.0
    wait_until(lambda: scraped_s() >= 10, timeout_s=40, what="10 s of TTFT scraped")
    end_s = time.time()
    window = ["--start", f"{began_s:.3f}", "--end", f"{end_s:.3f}", "--step", "1s", "--run", "live"]
    done = subprocess.run(gputrace_argv("panels", "--prometheus", prom, *window, "--out", str(out)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no data:" not in done.stdout, done.stdout
    index = (out / "index.html").read_text()
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) == 20 and all(p.name in index and p.stat().st_size > 3_000 for p in pngs), done.stdout
    client = PrometheusClient(prom)
    start_ms, end_ms = int(began_s * 1000), int(end_s * 1000)
    results = {r.panel["title"]: r for r in query_panels(client, start_ms, end_ms, 1000, {"run": "live"})
               if r.panel["type"] != "row"}
    marks = query_phase_marks(client, start_ms, end_ms, 1000, {"run": "live"})
    assert [m.title for m in marks] == ["phase C=8"]
    assert all(r.series for r in results.values()), [t for t, r in results.items() if not r.series]

    def drawn(result: PanelResult) -> Any:
        return panel_figure(result, marks, began_s, end_s, 1.0)

    stages = results["Micro-batches in flight vs pipeline stages"]
    lines = {ln.get_label(): ln for ln in drawn(stages).axes[0].lines}
    stage_line = lines["pipeline stages (pp_size)"].get_ydata()
    assert len(stage_line) >= 5 and set(stage_line[~np.isnan(stage_line)]) == {8.0}
    assert np.nanmax(lines["micro-batches in flight"].get_ydata()) >= 1
    heat = results["Busy per stage (heatmap)"]
    names, rows = heatmap_rows(heat.series, began_s, 1.0, end_s)
    assert names == [f"stage {s}" for s in range(8)]
    image = np.ma.filled(drawn(heat).axes[0].images[0].get_array().astype(float), np.nan)
    np.testing.assert_array_equal(image, rows)
    assert all(np.isfinite(row).sum() >= 5 and 0 <= np.nanmin(row) <= np.nanmax(row) <= 1 for row in rows)
    finding = results["Finding now"]
    assert len(finding.series) == 1 and len(finding.series[0].ts_s) == 1  # the line at the range's end
    line = finding.series[0].legend
    assert line.split(":")[0] in (*CAUSES, "no finding now", "idle"), line  # the report's causes
    assert line in [t.get_text().replace("\n", " ") for t in drawn(finding).texts]
    agents = results["Agents up"]
    assert [stat_value(s) for s in agents.series] == [1.0]
    assert "1" in [t.get_text() for t in drawn(agents).texts]
