"""`gputrace report --prometheus`: a real Prometheus scrapes a live simulator chain (agent and
collector) through two load levels; the report built from Prometheus alone names the levels and the
micro-batch cap, and range queries longer than Prometheus' 11,000-step limit are split and stitched."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from live_chain import free_port, gputrace_argv, process, prometheus, sim_chain, wait_until

from gputrace.analyse import analyse_run
from gputrace.backoff import Backoff
from gputrace.errors import SourceError, UsageError
from gputrace.imports.prometheus import (
    import_prometheus,
    parse_matchers,
    parse_step_ms,
    parse_time_ms,
    selector,
    target_markers,
)
from gputrace.prometheus.client import MAX_POINTS_PER_SERIES, PrometheusClient, chunk_windows
from gputrace.store import Store

LEVELS = (1, 32)
LEVEL_S = 9.0


# -- pure parts --------------------------------------------------------------------------------

@given(st.integers(0, 10**6), st.integers(0, 50_000), st.integers(1, 5_000), st.integers(1, 12_000))
def test_chunk_windows_cover_every_step_once(start: int, n_steps: int, step: int, max_points: int) -> None:
    """Windows hold at most max_points steps each and together every step of [start, end] once."""
    end = start + n_steps * step + step // 2  # an end off the grid is not a step
    windows = chunk_windows(start, end, step, max_points)
    steps = np.concatenate([np.arange(lo, hi + 1, step) for lo, hi in windows])
    assert all((hi - lo) // step + 1 <= max_points for lo, hi in windows)
    assert np.array_equal(steps, np.arange(start, end + 1, step))


def test_command_line_values() -> None:
    """Times (RFC 3339 or unix seconds), steps and matchers parse; bad ones are usage errors."""
    assert parse_time_ms("2026-01-02T03:04:05.250Z", "--start") == 1767323045250
    assert parse_time_ms("2026-01-02T04:04:05.25+01:00", "--start") == 1767323045250
    assert parse_time_ms("1767323045.25", "--start") == 1767323045250
    assert [parse_step_ms(s) for s in ("1s", "500ms", "1m30s", "0.25", "2")] == [1000, 500, 90_000, 250, 2000]
    m = parse_matchers('{run="a \\"b\\"", job=~"agent.*"}')
    assert [str(x) for x in m] == ['run="a \\"b\\""', 'job=~"agent.*"']
    # run= only narrows the collector's families; job= narrows every family
    assert selector(["x"], m, frozenset({"host"})) == '{__name__=~"x", job=~"agent.*"}'
    for bad in (lambda: parse_time_ms("2026-01-02T03:04:05", "--start"),
                lambda: parse_time_ms("yesterday", "--end"), lambda: parse_step_ms("1x"),
                lambda: parse_step_ms("0.0001"), lambda: parse_matchers("{run=x}"),
                lambda: chunk_windows(10, 5, 1)):
        with pytest.raises(UsageError):
            bad()


def test_engine_series_are_read_in_either_spelling() -> None:
    """prometheus_client (0.22+) answers an OpenMetrics scrape with `escaping=underscores`, so a
    Prometheus 2.x that scraped SGLang or vLLM holds `sglang_num_running_reqs` where the engine
    named `sglang:num_running_reqs` (seen with the real engines in the engine tier): both spellings
    give the same field and count for the same role."""
    from gputrace.imports.prometheus import ENGINE_FIELDS, SERIES_ROLES

    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert ENGINE_FIELDS[name.replace(":", "_")] == ENGINE_FIELDS[name]
    roles = set(SERIES_ROLES["engine running requests"])
    assert {"sglang_num_running_reqs", "vllm_num_requests_running"} <= roles


def test_level_changes_become_markers() -> None:
    """A level starts at the step showing it and the one before ends two steps earlier; an absent
    level ends the last one."""
    nan = np.nan
    grid = np.arange(1, 14, dtype=np.int64) * 1_000_000_000
    target = np.array([nan, nan, 1, 1, 1, 1, 32, 32, 32, 32, 32, nan, nan])
    got = [(m.kind, m.label, m.target_concurrency, int(m.ts_ns // 1_000_000_000))
           for m in target_markers(target, grid)]
    assert got == [("phase", "C=1", 1, 3), ("end", "end", None, 5), ("phase", "C=32", 32, 7),
                   ("end", "end", None, 10)]
    assert target_markers(np.full(5, nan), grid[:5]) == []


# -- against a real Prometheus ----------------------------------------------------------------

@dataclass(frozen=True)
class Capture:
    """A Prometheus that scraped a live chain through the load levels, and when that happened."""

    prom: str
    start_s: float
    load_start_s: float
    end_s: float
    direct_run: Path


def instant(prom: str, expr: str) -> list[dict[str, Any]]:
    url = f"{prom}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        result: list[dict[str, Any]] = json.loads(resp.read())["data"]["result"]
        return result


@contextlib.asynccontextmanager
async def proxy_to(prom: str, answer_first: Callable[[web.Request], web.Response | None]
                   ) -> AsyncIterator[str]:
    """A proxy on a free loopback port in front of Prometheus: each request gets
    ``answer_first(request)`` where that is a response, else Prometheus' own answer. Its URL."""
    async def forward(request: web.Request) -> web.Response:
        own = answer_first(request)
        if own is not None:
            return own
        async with aiohttp.ClientSession() as session, session.request(
                request.method, f"{prom}{request.rel_url}", data=await request.read(),
                headers={"Content-Type": request.headers.get("Content-Type", "text/plain")}) as resp:
            return web.Response(body=await resp.read(), status=resp.status, content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    try:
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Capture]:
    """C=1 then C=32 on microbatch-cap with Prometheus scraping the agent and the collector."""
    work = tmp_path_factory.mktemp("prom-capture")
    with sim_chain(work / "chain", scenario="microbatch-cap") as c:
        collector_port = free_port()
        with prometheus(work, {"agent": c.agent_port, "collector": collector_port}) as prom:
            # Prometheus applies its targets a few seconds after it starts: wait for the scrape
            # loops (the collector's target reports up=0 until the run starts) before the load.
            wait_until(lambda: len(instant(prom, "up")) == 2 and instant(prom, 'up{job="agent"} == 1'),
                       timeout_s=30, what="Prometheus scraping both targets")
            start_s = time.time()
            run_argv = gputrace_argv(
                "run", "--config", str(c.config), "--out", str(work / "run"),
                "--listen", f"127.0.0.1:{collector_port}", "--url", c.engine_url, "--model", "default",
                "--concurrency", ",".join(map(str, LEVELS)), "--duration-per-level", str(LEVEL_S),
                "--max-tokens", "64", "--warmup", "0", "--no-report")
            with process(run_argv, work / "run.out") as run:
                # the load gauge and the engine's first log lines reach the collector at different
                # times, so they can land in different scrapes: the window starts once both have
                wait_until(lambda: instant(prom, "gputrace_load_target_concurrency")
                           and instant(prom, 'gputrace_engine_running_requests{pp_rank="0",tp_rank="0"}'),
                           timeout_s=30, what="the collector's load and engine gauges scraped", proc=run)
                load_start_s = time.time()
                run.wait(timeout=60)
            assert run.returncode == 0, (work / "run.out").read_text()[-2000:]
            # the collector is gone: Prometheus marks its series stale at the next scrape
            wait_until(lambda: not instant(prom, "gputrace_load_target_concurrency"), timeout_s=10,
                       what="the load gauge going stale")
            yield Capture(prom, start_s, load_start_s, time.time(), work / "run")


def rfc3339(t_s: float) -> str:
    return datetime.fromtimestamp(t_s, UTC).isoformat().replace("+00:00", "Z")


@pytest.mark.system
@pytest.mark.slow
def test_report_from_prometheus_names_levels_and_cap(capture: Capture, tmp_path: Path) -> None:
    """The report from Prometheus alone has the two levels as phases and microbatch_cap (K = 2, given
    with the pool since Prometheus does not carry the engine's settings) at C=32."""
    out = tmp_path / "report"
    done = subprocess.run(gputrace_argv(
        "report", "--prometheus", capture.prom, "--start", rfc3339(capture.start_s),
        "--end", f"{capture.end_s:.3f}", "--max-running-requests", "64", "--pp-max-micro-batch-size", "2",
        "--run-out", str(tmp_path / "run"), "--out", str(out), "--format", "json,md"),
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads((out / "findings.json").read_text())
    phases = {p["label"]: p for p in doc["phases"]}
    assert list(phases) == [f"C={c}" for c in LEVELS]
    assert [p["target_concurrency"] for p in phases.values()] == list(LEVELS)
    # the offered load comes from the client's in-flight gauge: the closed loop kept each level
    for level, p in zip(LEVELS, phases.values(), strict=True):
        assert 0.85 * level <= p["inflight_mean"] <= level + 0.01, p
    # Each level lasts LEVEL_S; a level shows up to 2 steps (2 s) late, and the 2 steps before the
    # next change are left out of it.
    for p in phases.values():
        assert LEVEL_S - 4.0 <= p["duration_s"] <= LEVEL_S + 0.5, p
    cap = [f for f in doc["findings"] if f["cause"] == "microbatch_cap"]
    c32 = [{k: r.get(k) for k in ("pp_rank", "microbatch_size_max", "microbatch_size_mean", "queue_req_mean")}
           for r in doc["table"] if r["phase"] == "C=32"]
    assert [f["phase"] for f in cap] == ["C=32"], (doc["findings"], c32)
    assert cap[0]["evidence"]["K"] == 2 and cap[0]["recommendation"].startswith("--pp-max-micro-batch-size")
    assert cap[0]["evidence"]["microbatch_size_max"] <= 2
    # The same run as captured directly: the bubble fraction per stage agrees at the capped level.
    direct = tmp_path / "direct"
    subprocess.run(gputrace_argv("report", str(capture.direct_run), "--out", str(direct), "--format", "json"),
                   check=True, capture_output=True, timeout=120)
    ref = json.loads((direct / "findings.json").read_text())

    def per_stage(d: dict[str, Any], column: str) -> np.ndarray:
        return np.array([r[column] for r in d["table"] if r["phase"] == "C=32"])
    assert np.max(np.abs(per_stage(doc, "bubble_fraction") - per_stage(ref, "bubble_fraction"))) < 0.05
    with Store.open(tmp_path / "run", read_only=True) as store:
        assert store.meta.extra["source"] == "prometheus"
        assert store.meta.extra["step_ms"] == 1000  # --step auto: the scrape interval
        # every NVML period of each step, from the agent's busy counter, not one per scrape
        assert store.meta.extra["utilization_from"].startswith("gputrace_gpu_busy_seconds_total")
        assert store.meta.topology["pp_size"] == 8 and len(store.meta.topology["placements"]) == 8
        assert store.count("devices") == 8
        assert store.count("load_samples") >= 2 * LEVEL_S - 4


@pytest.mark.system
@pytest.mark.slow
def test_range_longer_than_the_limit_is_split_and_stitched(capture: Capture, tmp_path: Path) -> None:
    """At a 1 ms step the load window exceeds 11,000 steps: Prometheus refuses it in one query, the
    chunked query and the import cover every step exactly once."""
    client = PrometheusClient(capture.prom)
    start_ms = int(capture.load_start_s * 1000)
    end_ms = start_ms + 12_500  # 12,501 steps of 1 ms
    expr = 'gputrace_gpu_power_watts{gpu="0"}'
    with pytest.raises(SourceError, match="11,000"):
        client.query_range(expr, start_ms, end_ms, 1)  # the limit is the server's, not ours
    expected = np.arange(start_ms, end_ms + 1, 1)
    queries = client.queries
    (whole,) = client.query_range_chunked(expr, start_ms, end_ms, 1)
    assert client.queries - queries == 2
    assert np.array_equal(whole.ts_ms, expected)
    (small,) = client.query_range_chunked(expr, start_ms, end_ms, 1, max_points=3_000)
    assert np.array_equal(small.ts_ms, expected) and np.array_equal(small.values, whole.values)
    # every scraped value shows up, held until the next scrape
    (coarse,) = client.query_range(expr, start_ms, end_ms, 1000)
    assert np.array_equal(whole.values[coarse.ts_ms - start_ms], coarse.values)

    summary = import_prometheus(client, tmp_path / "run", start_ms, end_ms, 1,
                                parse_matchers('{gpu="0"}'), max_points=MAX_POINTS_PER_SERIES)
    assert summary.windows == 2 and summary.gpus == 1
    with Store.open(tmp_path / "run", read_only=True) as store:
        ts = store.columns("gpu_samples", order_by="ts_ns")["ts_ns"]
        assert np.array_equal(ts, expected * 1_000_000)
        ev = store.columns("scheduler_events", where="pp_rank = 0 AND tp_rank = 0", order_by="log_ts_ns")
        assert len(ev["log_ts_ns"]) == len(np.unique(ev["log_ts_ns"])) == len(expected)


@pytest.mark.system
@pytest.mark.slow
def test_errors_are_one_line(capture: Capture, tmp_path: Path) -> None:
    """Unreachable Prometheus, a reversed range and a selection without series each give one clear line."""
    start, end = f"{capture.start_s:.3f}", f"{capture.end_s:.3f}"
    cases = [
        (["--prometheus", f"http://127.0.0.1:{free_port()}", "--start", start, "--end", end], 1,
         "unreachable"),
        (["--prometheus", capture.prom, "--start", end, "--end", start], 2, "is not after --start"),
        (["--prometheus", capture.prom, "--start", start, "--end", end, "--match", '{host="nope"}'], 1,
         "no gputrace GPU or engine series"),
        (["--prometheus", capture.prom, "--start", start], 2, "needs --start and --end"),
        ([str(tmp_path), "--prometheus", capture.prom, "--start", start, "--end", end], 2, "not both"),
    ]
    for args, code, text in cases:
        done = subprocess.run(gputrace_argv("report", *args, "--out", str(tmp_path / "out")),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == code, (args, done.stderr)
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("gputrace: error:") and text in lines[0], done.stderr


@pytest.mark.system
@pytest.mark.slow
async def test_bearer_token_reaches_prometheus_behind_a_proxy(capture: Capture, tmp_path: Path) -> None:
    """--token-file sends the bearer token an auth proxy in front of Prometheus asks for; without it
    the refusal is one line."""
    def refuse_without_token(request: web.Request) -> web.Response | None:
        if request.headers.get("Authorization") != "Bearer s3cret":
            return web.json_response({"status": "error", "error": "bad token"}, status=401)
        return None

    token = tmp_path / "token"
    token.write_text("s3cret\n")
    async with proxy_to(capture.prom, refuse_without_token) as url:
        async def report(*extra: str) -> tuple[int, str]:
            proc = await asyncio.create_subprocess_exec(*gputrace_argv(
                "report", "--prometheus", url, "--start", f"{capture.start_s:.3f}",
                "--end", f"{capture.end_s:.3f}", "--format", "json", "--out", str(tmp_path / "out"), *extra),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            _, err = await asyncio.wait_for(proc.communicate(), timeout=90)
            return int(proc.returncode or 0), err.decode()
        code, err = await report()
        assert code == 1 and "HTTP 401: bad token" in err, err
        code, err = await report("--token-file", str(token))
        assert code == 0, err[-2000:]
        phases = json.loads((tmp_path / "out" / "findings.json").read_text())["phases"]
        assert [p["label"] for p in phases] == [f"C={c}" for c in LEVELS]


@pytest.mark.system
@pytest.mark.slow
async def test_an_import_rides_out_later_answers_and_stores_what_a_direct_one_does(
        capture: Capture, tmp_path: Path) -> None:
    """A proxy in front of Prometheus answers every third call 503 (Retry-After: 0), 429 or 502,
    in turn: the import asks those again and stores exactly what an import straight from
    Prometheus stores (one such answer ended the import)."""
    calls = 0

    def later_every_third(request: web.Request) -> web.Response | None:
        nonlocal calls
        calls += 1
        if calls % 3:
            return None
        status = (503, 429, 502)[(calls // 3) % 3]
        return web.json_response({"status": "error", "error": "try later"}, status=status,
                                 headers={"Retry-After": "0"} if status == 503 else None)

    start_ms, end_ms = int(capture.start_s * 1000), int(capture.end_s * 1000)
    async with proxy_to(capture.prom, later_every_third) as url:
        proxied = PrometheusClient(url, backoff=Backoff(0.01, 0.05))
        # the import is synchronous: in a thread, while this loop answers as the proxy
        await asyncio.to_thread(import_prometheus, proxied, tmp_path / "proxied", start_ms, end_ms, 1000, [],
                                {"max_running_requests": 64})
    await asyncio.to_thread(import_prometheus, PrometheusClient(capture.prom), tmp_path / "direct", start_ms,
                            end_ms, 1000, [], {"max_running_requests": 64})
    assert proxied.retries >= 3 and calls >= 9
    tables = ("gpu_samples", "scheduler_events", "load_samples", "markers", "devices")
    with Store.open(tmp_path / "proxied", read_only=True) as a, \
            Store.open(tmp_path / "direct", read_only=True) as b:
        for table in tables:
            assert a.count(table) == b.count(table) > 0, table
        got = a.columns("gpu_samples", order_by="ts_ns, gpu_index")
        want = b.columns("gpu_samples", order_by="ts_ns, gpu_index")
        for col in ("ts_ns", "gpu_index", "utilization_ratio"):
            assert np.array_equal(got[col], want[col], equal_nan=col == "utilization_ratio"), col


@pytest.mark.system
@pytest.mark.slow
def test_job_matcher_selects_the_collector_alone(capture: Capture, tmp_path: Path) -> None:
    """A job= matcher narrows every family: the collector's series alone give the stages from the
    engine's ranks, and the analysis still runs (no GPU figures)."""
    client = PrometheusClient(capture.prom)
    summary = import_prometheus(client, tmp_path / "run", int(capture.start_s * 1000),
                                int(capture.end_s * 1000), 1000, parse_matchers('{job="collector"}'),
                                {"max_running_requests": 64})
    assert (summary.gpus, summary.ranks, summary.runs) == (0, 8, ["live"])
    with Store.open(tmp_path / "run", read_only=True) as store:
        assert store.meta.topology == {}
        analysis = analyse_run(store, effects=False)
    assert analysis.run.pp_size == 8 and analysis.run.engine.pp_size == 8
    assert [p.label for p in analysis.phases] == [f"C={c}" for c in LEVELS]
    assert all(s.busy_fraction is None for m in analysis.metrics for s in m.stages)


def test_where_nothing_waits_the_ranks_sum_is_bounded_by_the_requests_in_the_system() -> None:
    """SGLang's per-rank running gauges each hold the micro-batch that rank ran last: one
    micro-batch of 1 on PP8 reads 1 on every rank (sum 8); 4 micro-batches of 2 read 2 (sum 16).
    Where nothing waited across the law's window, the requests in the system by Little's law (the
    latency sum's growth) bound the sum; where requests wait nearby (every slot full, or the step
    into such a level), the sum stands, bounded by the pool."""
    from gputrace.imports.prometheus import engine_load

    running = np.array([1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0])
    queue = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 16.0, np.nan])
    ranks = {("", pp, 0, 0): {"running_req": running, "queue_req": queue} for pp in range(8)}
    in_system = np.array([1.02, 0.9, 8.1, 7.8, 5.0, 25.0, np.nan])  # noisy, lagging the step to 32
    load = engine_load(ranks, 7, in_system, pool=64, half=1)
    # the fifth step is within a step of the queue: the sum stands there
    assert load[:6].tolist() == pytest.approx([1.02, 0.9, 8.1, 7.8, 16.0, 32.0])
    assert np.isnan(load[6])  # no queue read: no load claimed
    assert engine_load(ranks, 7, None, pool=12)[:6].tolist() == [8.0, 8.0, 12.0, 12.0, 12.0, 28.0]


@pytest.mark.parametrize(("found", "schema"), [
    (["DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_PROF_PCIE_TX_BYTES"], "4.8"),
    (["DCGM_FI_DEV_GPU_UTIL_RATIO", "DCGM_FI_PROF_PCIE_TX_BYTES"], "4.9"),
    (["DCGM_FI_DEV_GPU_UTIL_RATIO", "DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND"], "4.10"),
    (["DCGM_FI_DEV_SM_CLOCK_HERTZ"], "4.9+"),
    (["DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_SM_CLOCK_HERTZ"], "4.8+4.9+"),
    (["gputrace_gpu_utilization_ratio"], ""),
])
def test_the_import_names_the_dcgm_exporter_schema(found: list[str], schema: str) -> None:
    """[busy] dcgm-exporter's schema from the series found: the names before 4.9, 4.9's DCGM 4.7
    names (4.10 told apart only by PCIe/NVLink *_PER_SECOND), both in one range, or none."""
    from gputrace.imports.prometheus import GPU_FIELDS, dcgm_schema
    assert dcgm_schema(found) == schema
    # each series converts by its own name: 4.9's utilization is already a ratio, its clocks in Hz
    assert GPU_FIELDS["DCGM_FI_DEV_GPU_UTIL"] == ("utilization_ratio", 100.0)
    assert GPU_FIELDS["DCGM_FI_DEV_GPU_UTIL_RATIO"] == ("utilization_ratio", 1.0)
    assert GPU_FIELDS["DCGM_FI_DEV_SM_CLOCK_HERTZ"] == ("sm_clock_hz", 1.0)
    assert GPU_FIELDS["DCGM_FI_DEV_FB_USED_BYTES"] == ("memory_used_bytes", 1.0)
    assert GPU_FIELDS["DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL"] == ("energy_j", 1.0)


def test_sglang_stage_timers_from_prometheus_are_kept_as_engine_metrics() -> None:
    """[busy] report --prometheus keeps SGLang's loop and device timers (either spelling of the
    name) as the collector's engine-metrics rows, so the analysis ranks them the same way."""
    from gputrace.analysis.engine_metrics import engine_busy, series_from_columns
    from gputrace.imports.prometheus import engine_timer_rows
    from gputrace.prometheus.client import Series

    t_ms = np.arange(0, 11_000, 1000, dtype=np.int64) + 1_700_000_000_000
    series = [Series({"__name__": "sglang_scheduler_stage_seconds_total", "category": "run_batch",
                      "pp_rank": str(rank), "tp_rank": "0", "instance": "node0:30000", "job": "sglang"},
                     t_ms, np.arange(11, dtype=np.float64) * share)
              for rank, share in ((0, 0.6), (1, 0.3))]
    cols = engine_timer_rows(series, "http://prom")
    assert set(cols["name"]) == {"sglang:scheduler_stage_seconds_total"}
    assert all('"job"' not in lj and '"category": "run_batch"' in lj for lj in cols["labels_json"])
    mapping = {k: np.asarray(v) for k, v in cols.items()}
    busy = engine_busy(series_from_columns(mapping), int(t_ms[0]) * 10**6, int(t_ms[-1] + 1) * 10**6)
    assert {r: round(b.busy_fraction, 3) for r, b in busy.items()} == {0: 0.6, 1: 0.3}
    assert {b.signal for b in busy.values()} == {"loop timers"}


def test_vllm_gauges_read_low_are_lifted_to_the_requests_in_the_system() -> None:
    """vLLM's running and waiting gauges flip to 0 between batches at PP=2 (a level of 16 has read
    3 on average). Little's law lifts a reading to the requests in the system, never above the
    most the gauges read within the law's window (the law's figure lumps with few completions);
    where the law has no figure, or the gauges none, the reading stands."""
    from gputrace.imports.prometheus import engine_load

    running = np.array([8.0, 0.0, 0.0, 8.0, 0.0, 0.0, 1.0, np.nan])
    queue = np.array([8.0, 0.0, 0.0, 8.0, 0.0, 0.0, 0.0, 0.0])
    in_system = np.array([15.6, 16.2, 23.0, 15.9, np.nan, 9.0, 1.0, 1.0])
    load = engine_load({("", 0, 0, 0): {"running_req": running, "queue_req": queue}}, 8, in_system,
                       pool=8, half=1, engine="vllm")
    # a dip to 0 beside a reading of 16 is a batch turnover: it reads as the 16 beside it (the
    # law's figure, 23, would be capped by that 16 anyway); so is the 0 where the law has no figure
    # but its figures beside it say requests were in; its 9 lifts a turnover only to the 1 the
    # gauges truly read beside it
    assert load.tolist()[:7] == pytest.approx([16.0, 16.0, 16.0, 16.0, 16.0, 1.0, 1.0])
    queue[7] = np.nan
    load = engine_load({("", 0, 0, 0): {"running_req": running, "queue_req": queue}}, 8, in_system,
                       pool=8, half=1, engine="vllm")
    assert np.isnan(load[7])  # no queue read: no load claimed, whatever the law says


def test_vllm_turnover_readings_far_from_a_true_one_claim_nothing() -> None:
    """With the cores busy vLLM's gauges read (0, 0) at nearly every scrape of a level of 16 (CI,
    stop 31): a turnover reading takes the true readings beside it, and where none is within the
    law's window it claims nothing, neither 0 nor the law's low figure (vLLM's end-to-end timer
    covers about half of a request's time there: the law said 7 where 16 were in flight)."""
    from gputrace.imports.prometheus import engine_load

    running = np.array([8.0, 0.0, 0.0, 0.0, 0.0, 0.0, 8.0, 0.0, 0.0, 0.0])
    queue = np.array([8.0, 0.0, 0.0, 0.0, 0.0, 0.0, 8.0, 0.0, 0.0, 0.0])
    in_system = np.array([7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 0.0, 0.0, 0.0])  # then the level is over
    load = engine_load({("", 0, 0, 0): {"running_req": running, "queue_req": queue}}, 10, in_system,
                       pool=8, half=1, engine="vllm")
    assert load[[0, 1, 5, 6]].tolist() == [16.0, 16.0, 16.0, 16.0]
    assert np.isnan(load[2:5]).all()
    # no request in the engine by the law within the window: a 0 is a true reading
    assert load[8:].tolist() == [0.0, 0.0]


def test_sglang_readings_caught_mid_turnover_are_lifted_where_requests_wait() -> None:
    """SGLang's gauges at a level of 16 over PP2 read 4+2 running and 6 waiting as often as 4+4 and
    8 (a scrape between a request's end and its replacement's prefill; CI, stop 31: 12-14 of 16,
    and the level seemed below the pool). Where requests wait, Little's law lifts a reading to the
    requests in the system, never above the most the gauges read within its window; where nothing
    waits the bound by the law stands as before."""
    from gputrace.imports.prometheus import engine_load

    rank0 = np.array([4.0, 4.0, 4.0, 4.0, 1.0, 1.0])
    rank1 = np.array([2.0, 4.0, 2.0, 2.0, 1.0, 1.0])
    queue = np.array([6.0, 8.0, 6.0, 6.0, 0.0, 0.0])
    in_system = np.array([15.6, 16.3, 17.0, 15.2, 1.1, 0.9])
    ranks = {("", 0, 0, 0): {"running_req": rank0, "queue_req": queue},
             ("", 1, 0, 0): {"running_req": rank1, "queue_req": queue}}
    load = engine_load(ranks, 6, in_system, pool=8, half=1)
    # lifted to the law's figure, capped by the 16 read within a step; the fourth step has no 16
    # within its window: it stays at the 12 read. The fifth is within a step of a queue: its sum
    # stands (the law's 1.1 lifts nothing down); the last, with nothing waiting near, is bounded
    # by the law's 0.9 as before
    assert load.tolist() == pytest.approx([15.6, 16.0, 16.0, 12.0, 2.0, 0.9])
    assert engine_load(ranks, 6, None, pool=8).tolist() == [12.0, 16.0, 12.0, 12.0, 2.0, 2.0]
