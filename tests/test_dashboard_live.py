"""Every PromQL expression of the Grafana dashboard returns data from a real Prometheus scraping a
live chain: a simulated SGLang PP8 engine, its agent, and `gputrace run` driving the built-in load."""

from __future__ import annotations

import json
import signal
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from live_chain import HOST, free_port, gputrace_argv, http_ok, process, prometheus, sim_chain, wait_until

from gputrace.dashboard import dashboard_queries, variable_queries

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
            run.send_signal(signal.SIGINT)  # the sweep would run its minute; stop it cleanly
            deadline = time.monotonic() + 30
            while run.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert run.returncode == 0, (tmp_path / "run.out").read_text()[-2000:]
