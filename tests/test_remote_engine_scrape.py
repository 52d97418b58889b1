"""The engine's own /metrics as a collector source: parsed and stored with its labels, captured
live from the real-time simulator by `gputrace collect`, and checked against the log."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from fake_clock import until
from live_chain import free_port, get_json, http_ok, wait_until

from gputrace.analyse import analyse_run
from gputrace.collect import CollectOptions, Collector
from gputrace.config import parse_config
from gputrace.errors import ConfigError
from gputrace.model import Marker
from gputrace.remote.engine_scrape import parse_metrics_text
from gputrace.sim import scenario_params
from gputrace.sim.server import SimServer, start_sim_server
from gputrace.store import Store

SPEED = 1.0  # the log states rates per simulated second: compare them in real time
SGLANG_TEXT = """\
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="m",pp_rank="1",tp_rank="0"} 7.0
# HELP sglang:e2e_request_latency_seconds Histogram of end-to-end request latency in seconds
# TYPE sglang:e2e_request_latency_seconds histogram
sglang:e2e_request_latency_seconds_bucket{le="0.1",model_name="m"} 1.0
sglang:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 3.0
sglang:e2e_request_latency_seconds_sum{model_name="m"} 4.5
sglang:e2e_request_latency_seconds_count{model_name="m"} 3.0
# TYPE sglang:cache_hit_rate_unknown_thing gauge
sglang:cache_hit_rate_unknown_thing 1.0
"""


def test_kept_samples_keep_their_labels_and_histograms_their_sum_and_count() -> None:
    """Gauges keep every label; a histogram keeps _sum and _count, not its buckets; others are dropped."""
    rows = parse_metrics_text(SGLANG_TEXT, "node0", "http://127.0.0.1:30000/metrics", 5)
    got = {(r.name, r.labels_json, r.value) for r in rows}
    assert got == {
        ("sglang:num_queue_reqs", json.dumps({"engine_type": "unified", "model_name": "m", "pp_rank": "1",
                                              "tp_rank": "0"}, sort_keys=True), 7.0),
        ("sglang:e2e_request_latency_seconds_sum", '{"model_name": "m"}', 4.5),
        ("sglang:e2e_request_latency_seconds_count", '{"model_name": "m"}', 3.0)}
    assert {r.ts_ns for r in rows} == {5}


@pytest.mark.parametrize(("url", "why"), [("127.0.0.1:30000/metrics", "http:// or https://"),
                                          ("http://127.0.0.1:99999/metrics", "bad port")])
def test_a_bad_engine_metrics_url_is_refused_naming_the_key(url: str, why: str) -> None:
    """[hosts.engine_metrics] url must be an explicit http(s) URL with a valid port."""
    text = f'[[hosts]]\nname = "n"\n[hosts.engine_metrics]\nurl = "{url}"\n'
    with pytest.raises(ConfigError, match=rf"hosts\[0\]\.engine_metrics\.url: .*{why}"):
        parse_config(text, Path("g.toml"))


async def _load(url: str, seconds: float, concurrency: int) -> None:
    """A closed loop of ``concurrency`` clients for ``seconds`` (wall)."""
    deadline = time.monotonic() + seconds
    payload = {"prompt": "the pipeline " * 40, "max_tokens": 48}

    async def client(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < deadline:
            async with session.post(url + "/v1/completions", json=payload) as r:
                assert r.status == 200
                await r.read()

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))


@pytest.fixture
async def sim(tmp_path: Path) -> AsyncIterator[SimServer]:
    """A simulated SGLang PP8 whose pool (max_running_requests 16) a load of 32 fills: 16 wait."""
    params = scenario_params("pool-bound", {"max_running_requests": 16, "device_timer": True})
    srv = await start_sim_server(params, log_path=tmp_path / "sched.log", speed=SPEED)
    yield srv
    await srv.close()


def _config(tmp_path: Path, metrics_url: str) -> Path:
    cfg = tmp_path / "gputrace.toml"
    cfg.write_text(f'[[hosts]]\nname = "node0"\n[hosts.log]\nkind = "file"\n'
                   f'path = {json.dumps(str(tmp_path / "sched.log"))}\n'
                   f'[hosts.engine_metrics]\nurl = "{metrics_url}"\ninterval_s = 0.2\n'
                   "[topology]\npp_size = 8\n")
    return cfg


async def test_collect_stores_the_engine_metrics_of_a_live_engine(sim: SimServer, tmp_path: Path) -> None:
    """`gputrace collect` scrapes the simulated SGLang's /metrics beside its log: every rank's
    gauges are stored with their labels, the token counter grows with the load, and the metrics
    agree with the log (no disagreement note)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gputrace", "collect", "--config",
                             str(_config(tmp_path, sim.url + "/metrics")), "--out", str(tmp_path / "run"),
                             "--listen", f"127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        await asyncio.to_thread(wait_until, lambda: http_ok(f"http://127.0.0.1:{port}/healthz"), 30.0,
                                "collector healthy", proc)
        async with aiohttp.ClientSession() as s:
            await s.post(f"http://127.0.0.1:{port}/v1/mark", json={"label": "C=32", "target_concurrency": 32})
            await _load(sim.url, 8.0, 32)
            # the live view while the engine still has work: no GPU samples here, so each stage's
            # busy share is SGLang's device timer's, as the report ranks it
            async with s.get(f"http://127.0.0.1:{port}/v1/status") as r:
                live_stages = (await r.json())["stages"]
            await s.post(f"http://127.0.0.1:{port}/v1/mark", json={"label": "end", "kind": "end"})
            async with s.get(f"http://127.0.0.1:{port}/v1/status") as r:
                scraped = (await r.json())["counts"]["engine_metric_samples"]
        status = f"http://127.0.0.1:{port}/v1/status"  # a scrape after the end mark is stored too

        def scraped_again() -> bool:
            counts = get_json(status)["counts"]
            return isinstance(counts, dict) and counts["engine_metric_samples"] > scraped
        await asyncio.to_thread(wait_until, scraped_again, 30.0, "a scrape after the end mark", proc)
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = await asyncio.to_thread(proc.communicate, timeout=30)
    assert proc.returncode == 0, err.decode()
    with Store.open(tmp_path / "run", read_only=True) as store:
        rows = store.sql("SELECT name, labels_json, count(*), max(value) FROM engine_metrics GROUP BY ALL")
        analysis = analyse_run(store, effects=False)
    ranks = {json.loads(labels)["pp_rank"] for name, labels, _, _ in rows
             if name == "sglang:num_running_reqs"}
    assert ranks == {str(s) for s in range(8)}
    assert {name for name, *_ in rows} >= {
        "sglang:num_queue_reqs", "sglang:token_usage", "sglang:gen_throughput",
        "sglang:realtime_tokens_total",
        "sglang:forward_execution_seconds_total"}
    assert min(n for *_, n, _ in rows) >= 10  # scraped every 0.2 s for over 8 s
    tokens = max(v for name, _, _, v in rows if name == "sglang:realtime_tokens_total")
    assert tokens > 1000
    disagreements = [n for n in analysis.notes if "engine metrics say" in n or "token counter" in n]
    assert not disagreements, analysis.notes
    assert [row["pp_rank"] for row in live_stages] == list(range(8)), live_stages
    for row in live_stages:
        assert row["busy_signal"] == "the engine's device timer (forward_execution_seconds)", row
        assert 0.0 < row["busy_ratio"] <= 1.0 and row["bubble_ratio"] is not None, row
    print("live busy by the device timer:", [round(row["busy_ratio"], 2) for row in live_stages])


async def _fixed_metrics_server(started_ns: int) -> tuple[web.AppRunner, str]:
    """An endpoint that says no request ever waits and 50 tokens a second are generated."""

    async def metrics(_: web.Request) -> web.Response:
        tokens = (time.time_ns() - started_ns) / 1e9 * 50
        labels = 'model_name="m",engine_type="unified",pp_rank="0",tp_rank="0"'
        return web.Response(text=f"# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{{{labels}}} 0\n"
                                 f"# TYPE sglang:realtime_tokens counter\n"
                                 f"sglang:realtime_tokens_total{{{labels}}} {tokens}\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/metrics"


async def test_metrics_that_disagree_with_the_log_are_reported(sim: SimServer, tmp_path: Path) -> None:
    """Where the engine's metrics (no queue, 50 tok/s) and its log (16 waiting, over 1000 tok/s)
    disagree, the report says both figures in a note."""
    runner, url = await _fixed_metrics_server(time.time_ns())
    cfg = parse_config(_config(tmp_path, url).read_text(), tmp_path / "gputrace.toml")
    store = Store.create(tmp_path / "run")
    collector = Collector(cfg, store, CollectOptions(listen=None))
    try:
        await collector.start()
        collector.add_load_record(Marker("client", time.time_ns(), "C=32", target_concurrency=32))
        await _load(sim.url, 8.0, 32)
        collector.add_load_record(Marker("client", time.time_ns(), "end", kind="end"))
        scraped = collector.live.counts["engine_metric_samples"]
        await until(lambda: collector.live.counts["engine_metric_samples"] > scraped,
                    "a scrape after the end mark")
    finally:
        await collector.stop()
        await runner.cleanup()
    analysis = analyse_run(store, effects=False)
    store.close()
    note = next(n for n in analysis.notes if n.startswith("C=32: engine metrics say"))
    assert "0.0 requests waiting on average, the log says" in note
    assert "token counter gives 50 tok/s" in note and "aliased" in note
