"""A real Prometheus (the system package) scrapes a loopback agent; the query API returns its series."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import require_binary
from helpers import free_port

from gputrace.agent.server import Agent, AgentSettings
from gputrace.gpu.simulated import SimulatedSampler
from gputrace.topology import single_node_placements

pytestmark = pytest.mark.system

TOKEN = "prom-scrape-token"



@pytest.fixture
async def agent() -> AsyncIterator[Agent]:
    """A token-protected sim agent (4 GPUs, PP=4) with DCGM names on a random loopback port."""
    sampler = SimulatedSampler("prom-node", 4, pattern="constant:0.5")
    a = Agent(sampler, AgentSettings(port=0, token=TOKEN, dcgm_compat=True,
                                     placements=single_node_placements("prom-node", 4)), host="prom-node")
    await a.start()
    yield a
    await a.stop()


@pytest.fixture
async def prometheus(agent: Agent, tmp_path: Path) -> AsyncIterator[str]:
    """Prometheus scraping the agent every second with the bearer token; yields its base URL."""
    binary = require_binary("/usr/bin/prometheus", "prometheus")
    (tmp_path / "token").write_text(TOKEN)
    config = tmp_path / "prometheus.yml"
    config.write_text(f"""
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: gputrace
    authorization:
      credentials_file: {tmp_path / "token"}
    static_configs:
      - targets: ["127.0.0.1:{agent.port}"]
""")
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=log)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


async def _query_until(base: str, query: str, want: int, timeout_s: float = 40) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    result: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(f"{base}/api/v1/query", params={"query": query}) as resp:
                    body = await resp.json()
                    result = body.get("data", {}).get("result", []) if resp.status == 200 else []
            except aiohttp.ClientError:
                result = []  # Prometheus still starting
            if len(result) >= want:
                return result
            await asyncio.sleep(0.25)
    raise AssertionError(f"{query}: {len(result)} series after {timeout_s} s, wanted {want}")


async def test_prometheus_scrapes_agent_series(agent: Agent, prometheus: str) -> None:
    """/api/v1/query returns one series per GPU with the agent's labels and values."""
    power = await _query_until(prometheus, "gputrace_gpu_power_watts", 4)
    devices = {str(d.gpu_index): d for d in agent.devices}
    for series in power:
        m = series["metric"]
        d = devices[m["gpu"]]
        assert (m["host"], m["uuid"], m["model"], m["pp_rank"], m["tp_rank"]) == (
            "prom-node", d.uuid, d.name, m["gpu"], "0")
        assert d.power_limit_w is not None
        assert float(series["value"][1]) == pytest.approx(70.0 + 0.5 * (d.power_limit_w - 70.0), abs=0.01)
    util = await _query_until(prometheus, "gputrace_gpu_utilization_ratio", 4)
    assert {float(s["value"][1]) for s in util} == {0.5}
    up = await _query_until(prometheus, 'up{job="gputrace"}', 1)
    assert float(up[0]["value"][1]) == 1.0  # the scrape with the bearer token succeeded
    dcgm = await _query_until(prometheus, "DCGM_FI_DEV_GPU_UTIL", 4)
    assert {s["metric"]["Hostname"] for s in dcgm} == {"prom-node"}
    assert {float(s["value"][1]) for s in dcgm} == {50.0}
    energy = await _query_until(prometheus, "gputrace_gpu_energy_joules_total", 4)
    assert all(float(s["value"][1]) > 0 for s in energy)
