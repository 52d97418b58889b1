"""The engine tier: real SGLang and vLLM servers on this machine's CPU with PP=2 (dummy weights,
a tiny Llama), captured by `gputrace run` with the built-in load sweeping C = 1, 4, 16 across the
engine's admission limit of 8. What is asserted is the engine's own truth (its /metrics, scraped by
the test; its log file; its token counters), never gputrace's reading of it.

Skipped with the reason when `.venv-engines` (`make engines`) or Prometheus is absent, checked
before any engine starts; GPUTRACE_REQUIRE_ENGINE_TESTS=1 makes that a failure. Each engine starts
once per module."""

from __future__ import annotations

import calendar
import contextlib
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from engine_fixtures import fixture_dir, line_signature
from engine_servers import (
    ADMISSION_LIMIT,
    EngineSetting,
    MetricsScraper,
    RunningEngine,
    free_port,
    require_engine_tier,
    running_engine,
)
from helpers import gputrace_process
from live_chain import gputrace_argv, http_ok, prometheus, wait_until
from tmux_screen import engine_line, stage_rows, watch_recorded

from gputrace.analysis.phase_figures import PhaseMetrics
from gputrace.analysis.result import Analysis
from gputrace.demo import child_process
from gputrace.store import Store

pytestmark = [pytest.mark.engine, pytest.mark.slow]

CONCURRENCY = (1, 4, 16)
LEVEL_S = {"sglang": 15.0, "vllm": 25.0}
MAX_TOKENS = {"sglang": 16, "vllm": 96}  # vLLM: long enough that 16 in flight keep 8 waiting
# Lines the engines write that gputrace must capture, counted by the test's own patterns.
SGLANG_BATCH = re.compile(r"\] (?:Prefill|Decode) batch[,.]")
SGLANG_RANK = re.compile(r"^\[[^\]]*\bPP(\d+)\b[^\]]*\]")
VLLM_STATS = re.compile(r"Avg prompt throughput: ")
# The stand-in GPUs' load: they are not the CPU engine's, so they read fully busy (SM activity
# 90 %); what is checked of them is that both paths read them.
AGENT_PATTERN = "constant:1.0"
DECIDED_BY_THE_GPUS = {"pipeline_underfilled", "stage_imbalance", "pcie_bound", "throttling"}


@dataclass
class Capture:
    """One real engine captured by `gputrace run`: the engine, the test's own scrapes, the run."""

    engine: RunningEngine
    scraper: MetricsScraper
    run_dir: Path
    run_stderr: str
    log_text: str
    prometheus_url: str  # a real Prometheus that scraped the engine's /metrics and the agent's DCGM_*
    dashboard_url: str  # another that scraped what the dashboard reads: the collector and the agent
    watch_screens: list[tuple[int, list[str]]]  # `gputrace watch` in tmux during the run, every second

    def phases(self) -> dict[str, tuple[int, int]]:
        """Phase label -> (start_ns, end_ns) from the run's markers (collector clock)."""
        with Store.open(self.run_dir, read_only=True) as store:
            rows = store.sql("SELECT ts_ns, label, kind FROM markers ORDER BY ts_ns")
        out: dict[str, tuple[int, int]] = {}
        for i, (ts, label, kind) in enumerate(rows):
            if kind == "phase":
                end = rows[i + 1][0] if i + 1 < len(rows) else time.time_ns()
                out[label] = (int(ts), int(end))
        return out

    def metric_in(self, name: str, window: tuple[int, int], **labels: str) -> list[float]:
        """The test's scrapes of one series inside a window (its second half: the level settled)."""
        start, end = window
        settled = start + (end - start) // 2
        return [v for ts, v in self.scraper.series(name, **labels) if settled <= ts <= end]


def _capture(setting: EngineSetting, tmp: Path) -> Iterator[Capture]:
    require_engine_tier()
    log_path = tmp / f"{setting.engine}.log"
    with contextlib.ExitStack() as outlives_the_engine, running_engine(setting, log_path) as engine:
        # Prometheus scrapes the engine beside gputrace's capture and stays up after the engine
        # stops, for the report from it alone
        # every 2 s: an engine's /metrics on this loaded CPU can take over a second to answer
        # an agent in --dcgm-compat mode stands in for dcgm-exporter (neither can read a GPU here:
        # its GPUs are simulated, at a constant load); Prometheus keeps only its DCGM_* series, as
        # dcgm-exporter would give them, and the capture pulls the same agent's samples
        agent_port = free_port()
        agent = outlives_the_engine.enter_context(child_process(
            gputrace_argv("agent", "--backend", "sim", "--sim-gpus", "2", "--sim-pattern", AGENT_PATTERN,
                          "--dcgm-compat", "--host-name", "engine-host", "--interval", "0.1",
                          "--listen", f"127.0.0.1:{agent_port}"), tmp / "agent.out"))
        wait_until(lambda: http_ok(f"http://127.0.0.1:{agent_port}/healthz"), what="agent", proc=agent)
        prom_url = outlives_the_engine.enter_context(prometheus(
            tmp, {setting.engine: engine.port, "dcgm": agent_port}, 2, keep={"dcgm": "DCGM_.*"}))
        # the user's own Prometheus beside the capture, as the shipped dashboard expects it: the
        # collector's exposition and the agent's (kept apart from the one above, which must hold
        # nothing of gputrace's)
        collector_port = free_port()
        dashboard_work = tmp / "dashboard-prometheus"
        dashboard_work.mkdir()
        dashboard_url = outlives_the_engine.enter_context(prometheus(
            dashboard_work, {"collector": collector_port, "agent": agent_port}, 2))
        cfg = tmp / "gputrace.toml"
        # vLLM's /metrics beside its log: its token counter is the phases' tok/s (its stats lines
        # average over 10 s windows); SGLang's capture stays log-only (its lines count every step)
        metrics = f'[hosts.engine_metrics]\nurl = "{engine.url}/metrics"\n\n' \
            if setting.engine == "vllm" else ""
        cfg.write_text(
            f'[run]\nname = "{setting.engine}-tier"\n\n[[hosts]]\nname = "engine-host"\n'
            f'agent = "127.0.0.1:{agent_port}"\n\n'
            f'[hosts.log]\nkind = "file"\npath = {json.dumps(str(log_path))}\n'
            f'engine = "{setting.engine}"\n\n{metrics}[topology]\npp_size = 2\n')
        run_dir = tmp / "run"
        argv = [sys.executable, "-m", "gputrace", "run", "--config", str(cfg), "--out", str(run_dir),
                "--listen", f"127.0.0.1:{collector_port}", "--url", engine.url, "--model", engine.model,
                "--concurrency", ",".join(map(str, CONCURRENCY)),
                "--duration-per-level", str(LEVEL_S[setting.engine]),
                "--max-tokens", str(MAX_TOKENS[setting.engine]), "--ignore-eos", "--warmup", "0",
                "--no-report"]
        # `gputrace watch` beside SGLang's capture only: on the two shared cores its redraws took
        # enough from vLLM (whose stats line comes every 10 s) to change what its tests read
        watching = watch_recorded(tmp, f"http://127.0.0.1:{collector_port}") \
            if setting.engine == "sglang" else contextlib.nullcontext([])
        with MetricsScraper(engine) as scraper, watching as watch_screens:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
            # the log as it stood when the collector stopped: what it could have read
            log_text = log_path.read_text(errors="replace")
        assert out.returncode == 0, out.stderr[-3000:]
        outlives = outlives_the_engine.pop_all()
    # the engine is stopped here (the tests read what was captured, and a restart has the cores);
    # Prometheus stays up until the module's tests are done
    with outlives:
        yield Capture(engine, scraper, run_dir, out.stderr, log_text, prom_url, dashboard_url, watch_screens)


@pytest.fixture(scope="module")
def sglang_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Capture]:
    yield from _capture(EngineSetting("sglang", "default"), tmp_path_factory.mktemp("sglang"))


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Capture]:
    yield from _capture(EngineSetting("vllm", "default"), tmp_path_factory.mktemp("vllm"))


def _store_requests(run_dir: Path) -> list[tuple[str, bool, int | None, int | None]]:
    with Store.open(run_dir, read_only=True) as store:
        return [(str(p), bool(ok), pt, ct) for p, ok, pt, ct in store.sql(
            "SELECT phase, ok, prompt_tokens, completion_tokens FROM requests")]


def _counter_delta(capture: Capture, name: str) -> float:
    series = capture.scraper.series(name)
    assert len(series) >= 2, f"{name} not scraped"
    return series[-1][1] - series[0][1]


# SGLang


def test_sglang_requests_wait_at_the_pool_limit(sglang_run: Capture) -> None:
    """At C=16 with max_running_requests 8, SGLang's own /metrics shows about 8 waiting and at
    most 8 running in all; at C=1 none waits."""
    phases = sglang_run.phases()
    assert set(phases) == {f"C={c}" for c in CONCURRENCY}
    queued = sglang_run.metric_in("sglang:num_queue_reqs", phases["C=16"], pp_rank="0")
    running = sglang_run.metric_in("sglang:num_running_reqs", phases["C=16"], pp_rank="0")
    assert queued and running, "no /metrics scrapes in the C=16 phase"
    assert statistics.median(queued) >= ADMISSION_LIMIT - 2, queued
    assert max(running) <= ADMISSION_LIMIT, running
    assert max(sglang_run.metric_in("sglang:num_queue_reqs", phases["C=1"], pp_rank="0")) == 0


def test_sglang_every_batch_line_is_stored_with_its_rank(sglang_run: Capture) -> None:
    """The store holds one scheduler event per batch line the engine wrote, per PP rank."""
    written: Counter[int] = Counter()
    for line in sglang_run.log_text.splitlines():
        if SGLANG_BATCH.search(line):
            rank = SGLANG_RANK.match(line)
            assert rank is not None, line
            written[int(rank.group(1))] += 1
    assert set(written) == {0, 1}
    with Store.open(sglang_run.run_dir, read_only=True) as store:
        stored = Counter({int(r): int(n) for r, n in store.sql(
            "SELECT pp_rank, count(*) FROM scheduler_events WHERE kind IN ('prefill', 'decode') "
            "GROUP BY 1")})
    assert stored == written


def test_sglang_request_records_match_the_engine_counters(sglang_run: Capture) -> None:
    """Every request the client sent is a record; the tokens they carry are the engine's own
    counts (generation and prompt token counters over the run)."""
    rows = _store_requests(sglang_run.run_dir)
    assert rows and all(ok for _, ok, _, _ in rows)
    assert {p for p, *_ in rows} == {f"C={c}" for c in CONCURRENCY}
    assert all(ct == MAX_TOKENS["sglang"] for *_, ct in rows)  # --ignore-eos
    assert sum(ct or 0 for *_, ct in rows) == _counter_delta(sglang_run, "sglang:generation_tokens_total")
    assert sum(pt or 0 for _, _, pt, _ in rows) == _counter_delta(sglang_run, "sglang:prompt_tokens_total")



def test_sglang_capture_has_a_busy_and_bubble_per_stage_from_its_stage_timers(sglang_run: Capture,
                                                                              tmp_path: Path) -> None:
    """[busy] Must show 2: the capture with the engine's own /metrics scrapes beside it (the
    collector's engine-metrics source stores the same rows) and no GPU samples (this CPU has
    none; the agent's are simulated): every stage of every phase gets its busy figure from
    sglang:scheduler_stage_seconds_total{category="run_batch"}, its bubble by the same definition,
    and the log schedule's figure beside it, agreeing within 10 points or saying why not."""
    import shutil

    from gputrace.analyse import analyse_run

    run = tmp_path / "run"
    shutil.copytree(sglang_run.run_dir, run)
    keys = ("host", "source", "ts_ns", "name", "labels_json", "value")
    cols: dict[str, list[object]] = {k: [] for k in keys}
    for snap in sglang_run.scraper.snapshots:
        for sample in snap["samples"]:  # type: ignore[attr-defined]
            labels = json.dumps(sample["labels"], sort_keys=True)
            for key, value in (("host", "engine-host"), ("source", "metrics"), ("ts_ns", snap["ts_ns"]),
                               ("name", sample["name"]), ("labels_json", labels),
                               ("value", float(sample["value"]))):
                cols[key].append(value)
    with Store.open(run) as store:
        store.sql("DELETE FROM gpu_samples")
        store.sql("DELETE FROM engine_metrics")
        store.append_columns("engine_metrics", cols)
        analysis = analyse_run(store, effects=False)
    phases = [pm for pm in analysis.metrics if pm.label.startswith("C=")]
    assert [pm.label for pm in phases] == [f"C={c}" for c in CONCURRENCY]
    for pm in phases:
        for st in pm.stages:
            assert st.busy_signal == "the engine's loop timers (run_batch)", (pm.label, st)
            assert st.busy_fraction is not None and 0.0 < st.busy_fraction <= 1.0
            assert st.bubble_fraction is not None and st.schedule_busy_fraction is not None
            agree = abs(st.busy_fraction - st.schedule_busy_fraction) <= 0.10
            assert ("agree within 10%" if agree else "they differ by") in (st.busy_signal_reason or "")
            print(f"\n{pm.label} stage {st.pp_rank}: busy {st.busy_fraction:.2f} (loop timers), bubble "
                  f"{st.bubble_fraction:.2f}, log schedule {st.schedule_busy_fraction:.2f}")

def test_sglang_capture_parses_as_the_fixture_does(sglang_run: Capture) -> None:
    """Format drift: a fresh capture's lines have the kinds and fields the recorded fixture has."""
    recorded = fixture_dir("sglang", "default") / "engine.log"
    assert line_signature("sglang", sglang_run.log_text) == line_signature("sglang", recorded.read_text())


# vLLM


VLLM_STATS_STATE = re.compile(r" (\d\d)-(\d\d) (\d\d:\d\d:\d\d) .*Running: (\d+) reqs, Waiting: (\d+) reqs")


def _vllm_logged(capture: Capture, window: tuple[int, int]) -> list[tuple[int, int]]:
    """(running, waiting) of vLLM's own stats lines stamped inside a window (its second half)."""
    start, end = window
    settled = start + (end - start) // 2
    year = time.gmtime(start / 1e9).tm_year
    out = []
    for line in capture.log_text.splitlines():
        m = VLLM_STATS_STATE.search(line)
        if m is None:
            continue
        stamp = time.strptime(f"{year}-{m.group(1)}-{m.group(2)} {m.group(3)}", "%Y-%m-%d %H:%M:%S")
        t_ns = int(calendar.timegm(stamp)) * 10**9
        if settled <= t_ns <= end + 10**9:
            out.append((int(m.group(4)), int(m.group(5))))
    return out


def _grown_in(capture: Capture, name: str, window: tuple[int, int]) -> float:
    """How much a counter of the test's own scrapes grew over a window."""
    inside = [v for ts, v in capture.scraper.series(name) if window[0] <= ts <= window[1]]
    assert len(inside) >= 2, f"{name}: {len(inside)} scrapes in the window"
    return inside[-1] - inside[0]


def test_vllm_requests_wait_at_max_num_seqs(vllm_run: Capture) -> None:
    """At C=16 with max_num_seqs 8, vLLM's own timers say its requests waited for admission (its
    queue time, summed per request: about a third of their time in the engine here, with or
    without a busy CPU), and at C=1 and C=4 they did not; no reading of its gauges holds more than
    the limit running or more than the offered load. The waiting gauge is not asserted: at PP=2 on
    this CPU the running and waiting gauges both read 0 at each batch turnover, and with the cores
    busy a whole level's settled half has read waiting 0 at every scrape (CI, stop 31)."""
    phases = vllm_run.phases()
    assert set(phases) == {f"C={c}" for c in CONCURRENCY}
    shares = {}
    for label, window in phases.items():
        queued_s = _grown_in(vllm_run, "vllm:request_queue_time_seconds_sum", window)
        in_engine_s = _grown_in(vllm_run, "vllm:e2e_request_latency_seconds_sum", window)
        assert _grown_in(vllm_run, "vllm:request_queue_time_seconds_count", window) > 0, label
        shares[label] = queued_s / in_engine_s
    print(f"vLLM queue time / time in the engine per level: {shares}")
    assert shares["C=16"] >= 0.15 and shares["C=1"] <= 0.02 and shares["C=4"] <= 0.02, shares
    waiting = vllm_run.metric_in("vllm:num_requests_waiting", phases["C=16"])
    running = vllm_run.metric_in("vllm:num_requests_running", phases["C=16"])
    logged = _vllm_logged(vllm_run, phases["C=16"])
    assert waiting and running, (waiting, running)
    assert all(r + w <= 16 for r, w in zip(running, waiting, strict=False)), (running, waiting)
    assert max(running) <= ADMISSION_LIMIT and max((r for r, _ in logged), default=0) <= ADMISSION_LIMIT
    assert max(vllm_run.metric_in("vllm:num_requests_waiting", phases["C=1"])) == 0


def _vllm_stats_stamps_ns(capture: Capture) -> list[int]:
    """The stamps (ns, second resolution) of every stats line vLLM wrote."""
    year = time.gmtime(time.time()).tm_year
    out = []
    for line in capture.log_text.splitlines():
        m = VLLM_STATS_STATE.search(line)
        if m is not None:
            stamp = time.strptime(f"{year}-{m.group(1)}-{m.group(2)} {m.group(3)}", "%Y-%m-%d %H:%M:%S")
            out.append(int(calendar.timegm(stamp)) * 10**9)
    return out


def test_vllm_every_stats_line_is_stored(vllm_run: Capture) -> None:
    """The store holds one stats event per stats line vLLM wrote while the collector followed it.
    vLLM goes on writing after the load ends (a stats line every 10 s), so a line stamped after the
    collector stopped may be missing; every line stamped two seconds before that must be there
    (the stamp is truncated to the second, the follower polls every 20 ms)."""
    stamps_ns = _vllm_stats_stamps_ns(vllm_run)
    assert len(stamps_ns) == sum(1 for line in vllm_run.log_text.splitlines() if VLLM_STATS.search(line))
    stopped_ns = json.loads((vllm_run.run_dir / "meta.json").read_text())["extra"]["collector"]["stopped_ns"]
    must_have = sum(1 for t in stamps_ns if t + 2 * 10**9 <= stopped_ns)
    with Store.open(vllm_run.run_dir, read_only=True) as store:
        (stored,) = store.sql("SELECT count(*) FROM scheduler_events WHERE kind = 'stats'")[0]
    assert must_have >= 3
    assert must_have <= stored <= len(stamps_ns), (must_have, stored, len(stamps_ns))


def test_vllm_request_records_match_the_engine_counters(vllm_run: Capture) -> None:
    """Every request is a record, and their tokens are vLLM's own generation/prompt counts."""
    rows = _store_requests(vllm_run.run_dir)
    assert rows and all(ok for _, ok, _, _ in rows)
    assert all(ct == MAX_TOKENS["vllm"] for *_, ct in rows)
    assert sum(ct or 0 for *_, ct in rows) == _counter_delta(vllm_run, "vllm:generation_tokens_total")
    assert sum(pt or 0 for _, _, pt, _ in rows) == _counter_delta(vllm_run, "vllm:prompt_tokens_total")
    assert len(rows) == _counter_delta(vllm_run, "vllm:request_success_total")


def test_vllm_capture_parses_as_the_fixture_does(vllm_run: Capture) -> None:
    """Format drift: a fresh vLLM capture's lines have the kinds and fields of the fixture's."""
    recorded = fixture_dir("vllm", "default") / "engine.log"
    assert line_signature("vllm", vllm_run.log_text) == line_signature("vllm", recorded.read_text())


# The same diagnosis from a Prometheus that scraped the engine, with nothing of gputrace's


def _store_findings(capture: Capture) -> dict[str, set[tuple[str, object, object]]]:
    from gputrace.analyse import analyse_run

    with Store.open(capture.run_dir, read_only=True) as store:
        gpus = store.sql("SELECT count(DISTINCT gpu_index), count(*) FROM gpu_samples")[0]
        findings = analyse_run(store, effects=False).findings
    assert gpus[0] == 2 and gpus[1] > 0, gpus  # the agent's samples were captured beside the log
    out: dict[str, set[tuple[str, object, object]]] = {}
    for f in findings:
        flag, value = (f.change.flag, f.change.value) if f.change else (None, None)
        out.setdefault(f.phase, set()).add((f.cause, flag, value))
    return out


def _scrape_health(prom_url: str) -> list[object]:
    """What Prometheus says of its targets (health, last error): for a failure's message."""
    import urllib.request

    with urllib.request.urlopen(f"{prom_url}/api/v1/targets", timeout=10) as resp:
        active = json.loads(resp.read())["data"]["activeTargets"]
    return [(t.get("scrapeUrl"), t.get("health"), t.get("lastError"), t.get("lastScrapeDuration"))
            for t in active]


def _report_window(window: tuple[int, int]) -> tuple[int, int]:
    """The part of a phase the Prometheus-alone report reads: from a quarter in (the level
    settled) to 1 s before its end (ns)."""
    start, end = window
    return start + (end - start) // 4, end - 10**9


def _prometheus_findings(capture: Capture, window: tuple[int, int],
                         tmp: Path) -> set[tuple[str, object, object]]:
    """`gputrace report --prometheus` over one phase's window (its settled part), given the
    admission limit as a flag (Prometheus does not carry the configuration)."""
    start, end = _report_window(window)
    out_dir = tmp / f"report-{start}"
    done = subprocess.run(
        [sys.executable, "-m", "gputrace", "report", "--prometheus", capture.prometheus_url,
         "--start", f"{start / 1e9:.3f}", "--end", f"{end / 1e9:.3f}", "--step", "1s",
         "--max-running-requests", str(ADMISSION_LIMIT), "--run-out", str(out_dir / "run"),
         "--out", str(out_dir), "--format", "json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stderr[-3000:], _scrape_health(capture.prometheus_url))
    doc = json.loads((out_dir / "findings.json").read_text())
    found = next((ln.removeprefix("series found: ").split(", ") for ln in done.stdout.splitlines()
                  if ln.startswith("series found: ")), [])
    assert {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_PROF_SM_ACTIVE"} <= set(found), done.stdout[-2000:]
    assert not [name for name in found if name.startswith("gputrace_")], found  # nothing of ours
    # the DCGM series reached the stages (vLLM's series carry no pp_rank: Prometheus gives one stage)
    busy = {row["pp_rank"]: row["busy_fraction"] for row in doc["table"]}
    assert busy and all(b is not None and b >= 0.85 for b in busy.values()), busy
    return {(f["cause"], (f.get("change") or {}).get("knob"), (f.get("change") or {}).get("value"))
            for f in doc["findings"]}


@pytest.mark.parametrize("engine_name", ["sglang", "vllm"])
def test_report_from_prometheus_alone_gives_the_capture_findings(
        engine_name: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """A real Prometheus scraped only the engine's /metrics (sglang:* per pp_rank, vllm:*) and an
    agent in --dcgm-compat mode standing in for dcgm-exporter (its DCGM_* series only). Per phase,
    the report from it alone (the load from the engine's gauges, no client gauge; the GPUs from
    the DCGM series) finds what the capture's store finds: at C=16 the admission limit with the
    same flag and value; at C=1 and C=4 nothing of the phase's own. The causes a bubble decides are
    left out: the stand-in GPUs' figures are not the CPU engine's (both paths read them, which
    _prometheus_findings checks), so what they say of idle stages says nothing of this run."""
    capture: Capture = request.getfixturevalue(f"{engine_name}_run")
    expected = _store_findings(capture)
    phases = capture.phases()
    whole_run = expected.get("*", set())

    def engines_own(findings: set[tuple[str, object, object]]) -> set[tuple[str, object, object]]:
        return {f for f in findings if f[0] not in DECIDED_BY_THE_GPUS}

    for label, window in phases.items():
        got = _prometheus_findings(capture, window, tmp_path)
        own, want = engines_own(got - whole_run), engines_own(expected.get(label, set()))
        if want and not _gauges_read_the_load(capture, engine_name, window):
            # The report can only read the load the engine's gauges show. vLLM's read 0 at each
            # batch turnover, and with the cores busy at nearly every scrape of a level; SGLang's
            # per-rank gauges hold the micro-batch a rank ran last, and with requests replaced
            # unevenly they have read 12-14 of a level of 16 (CI, stop 31 rerun); vLLM's running
            # plus waiting leaves out what its API server holds (a level of 16 read 16 for 5 s,
            # then 11.4 for 10 s: two levels, CI stop 34's clone). Then it must claim nothing the
            # capture does not, but for what the gauges guarantee: they hold no more requests than
            # were sent, so a limit found from them is one the capture's covers (above the limit,
            # at most the capture's value, same cause and flag).
            print(f"{label}: the engine's gauges read less than the offered load; found {own}")
            assert all(_covered_by(claim, want) for claim in own), (label, got, expected)
            continue
        assert own == want, (label, got, expected)


def _covered_by(claim: tuple[str, object, object], want: set[tuple[str, object, object]]) -> bool:
    """The claim is one the capture makes, or an admission limit read from gauges that hold fewer
    requests than were sent: the capture's cause and flag, a value above the limit and no higher
    than the capture's."""
    if claim in want:
        return True
    cause, knob, value = claim
    return cause == "admission_bound" and isinstance(value, int) and any(
        c == cause and k == knob and isinstance(v, int) and ADMISSION_LIMIT < value <= v
        for c, k, v in want)


def _gauges_read_the_load(capture: Capture, engine_name: str, window: tuple[int, int]) -> bool:
    """Whether the engine's gauges, as Prometheus holds them over the report's window, read the
    offered load of the admission level throughout (nine readings in ten, running plus waiting, at
    least 2 x the limit - 1; vLLM's turnover readings of 0 and 0 left out, as the report leaves
    them). A median was not enough: with a core busy, vLLM's gauges read 16 for part of a C=16
    window and 11 for the rest (its API server held the others), and the report rightly found two
    levels and a limit at each."""
    import urllib.parse
    import urllib.request

    start, end = _report_window(window)
    expr = ("vllm:num_requests_running + vllm:num_requests_waiting" if engine_name == "vllm" else
            # SGLang's names reach Prometheus as sglang_* or sglang:* (by its version)
            'sum({__name__=~"sglang[:_]num_running_reqs"}) '
            '+ sum({__name__=~"sglang[:_]num_queue_reqs", pp_rank="0"})')
    url = f"{capture.prometheus_url}/api/v1/query_range?" + urllib.parse.urlencode(
        {"query": expr, "start": f"{start / 1e9:.3f}", "end": f"{end / 1e9:.3f}", "step": "1"})
    with urllib.request.urlopen(url, timeout=10) as resp:
        result = json.loads(resp.read())["data"]["result"]
    readings = [float(v) for series in result for _, v in series["values"]]
    if engine_name == "vllm":
        readings = [v for v in readings if v > 0]
    return bool(readings) and sorted(readings)[len(readings) // 10] >= 2 * ADMISSION_LIMIT - 1



@pytest.mark.parametrize("engine_name", ["sglang", "vllm"])
def test_phase_throughput_is_the_generated_tokens(engine_name: str, request: pytest.FixtureRequest) -> None:
    """[prefill] Must show 3: in every phase of the capture the report's tok/s is within 5 % of
    the client's completion tokens (prefill lines' tokens are input, never counted as output),
    it says which source it took, and the prompt tokens are their own figure (input tok/s)."""
    from gputrace.analyse import analyse_run

    capture: Capture = request.getfixturevalue(f"{engine_name}_run")
    with Store.open(capture.run_dir, read_only=True) as store:
        analysis = analyse_run(store, effects=False)
    phases = [pm for pm in analysis.metrics if pm.label.startswith("C=")]
    assert [pm.label for pm in phases] == [f"C={c}" for c in CONCURRENCY]
    # SGLang's lines count every step; vLLM's stats lines average over 10 s windows, so its tok/s
    # is its own token counter, which the collector scraped from /metrics about every second
    source = {"sglang": "engine log", "vllm": "engine counter (vllm:generation_tokens_total)"}[engine_name]
    # vLLM's counter is read at the collector's scrapes (about 1-2 s apart under load): between
    # the first and last scrape inside a phase it is the engine's count alone, and it agrees with
    # the client's there (a run here: -0.006 %, 0.000 %, 0.000 % at C=1, 4, 16); the two intervals
    # that straddle the phase's edges are placed by the client's records (client_split), where
    # the rate of the interval after the edge read C=16 5-7 % high in 2 of 7 runs (a level's first
    # second ramps up)
    for pm in phases:
        assert pm.throughput_tok_s is not None and pm.client_throughput_tok_s
        print(f"\n{engine_name} {pm.label}: {pm.throughput_tok_s:.1f} tok/s ({pm.throughput_source}), "
              f"client {pm.client_throughput_tok_s:.1f}, log {pm.engine_gen_throughput_tok_s}; input "
              f"{pm.input_tok_s} tok/s, client {pm.client_input_tok_s}")
        assert pm.throughput_source == source, pm.label
        assert pm.throughput_tok_s == pytest.approx(pm.client_throughput_tok_s, rel=0.05), pm.label
        if engine_name == "vllm":
            # the engine's count alone between two of its scrapes, against the client's tokens
            # spread evenly over each request's life: that spread moves a span's edges by up to a
            # request's burst (0.006 % in session 28's run; 2.4 % at C=4 in a CI run of session 29)
            engine_rate, client_rate = _between_scrapes(capture, analysis, pm)
            assert engine_rate == pytest.approx(client_rate, rel=0.05), pm.label
        assert pm.input_tok_s is not None and pm.input_tok_s > 0


def _between_scrapes(capture: Capture, analysis: Analysis, pm: PhaseMetrics) -> tuple[float, float]:
    """(engine, client) tok/s between the first and last scrape of vLLM's token counter inside the
    phase: the engine's count alone, with no edge to place."""
    from gputrace.analysis.phase_figures import tokens_emitted

    with Store.open(capture.run_dir, read_only=True) as store:
        rows = store.sql("SELECT ts_ns, value FROM engine_metrics WHERE name = "
                         "'vllm:generation_tokens_total' ORDER BY ts_ns")
    t = np.array([r[0] for r in rows], dtype=np.float64)
    v = np.array([r[1] for r in rows], dtype=np.float64)
    inside = np.flatnonzero((t >= pm.start_ns) & (t < pm.end_ns))
    a, b = t[inside[0]], t[inside[-1]]
    rq = analysis.run.requests
    client = tokens_emitted(rq["first_token_ns"], rq["end_ns"], rq["completion_tokens"], int(a), int(b))
    span_s = (b - a) / 1e9
    return float(np.clip(np.diff(v[inside[0]:inside[-1] + 1]), 0, None).sum()) / span_s, client / span_s


# The shipped dashboard's panels, drawn from a Prometheus that scraped the real capture


@pytest.mark.parametrize("engine_name", ["sglang", "vllm"])
def test_dashboard_panels_render_a_real_engine_capture(engine_name: str, request: pytest.FixtureRequest,
                                                       tmp_path: Path) -> None:
    """`gputrace panels` over the whole sweep, from a Prometheus that scraped the collector of
    `gputrace run` and the agent as the shipped dashboard expects: a PNG per panel (kept in
    tests/artifacts/panels-ENGINE/), every panel with data, 2 pipeline stages, a busy heatmap row per
    stage, one phase mark per level."""
    from gputrace.prometheus.client import PrometheusClient
    from gputrace.prometheus.panels import query_panels, query_phase_marks

    capture: Capture = request.getfixturevalue(f"{engine_name}_run")
    windows = list(capture.phases().values())
    # to three quarters into the last level: the collector (whose finding line the range's end
    # shows) was up then
    start_s, end_s = windows[0][0] / 1e9, windows[-1][0] / 1e9 + 0.75 * LEVEL_S[engine_name]
    out = Path(__file__).parent / "artifacts" / f"panels-{engine_name}"
    shutil.rmtree(out, ignore_errors=True)  # a panel renamed since an earlier run leaves its PNG behind
    done = gputrace_process(
        "panels", "--prometheus", capture.dashboard_url, "--start", f"{start_s:.3f}", "--end", f"{end_s:.3f}",
        "--step", "1s", "--run", f"{engine_name}-tier", "--out", str(out), timeout_s=180)
    assert done.returncode == 0, done.stderr[-2000:]
    print(done.stdout)
    client = PrometheusClient(capture.dashboard_url)
    start_ms, end_ms = int(start_s * 1000), int(end_s * 1000)
    # Every panel has data, but "Finding now" (one instant at the range's end) read none in 3 of 6
    # vLLM runs, the collector's scrape before that instant succeeding (its `up` was 1): cause not
    # found (session 13). The finding lines the collector exported over the range are checked
    # instead, and what the end instant held is printed.
    empty = next((ln.removeprefix("no data: ").split(", ") for ln in done.stdout.splitlines()
                  if ln.startswith("no data: ")), [])
    assert set(empty) <= {"Finding now"}, done.stdout
    lines = client.query_range_chunked(f'gputrace_live_finding_info{{run="{engine_name}-tier"}}', start_ms,
                                       end_ms, 1000)
    newest = max(lines, key=lambda series: series.ts_ms[-1]).labels["finding"] if lines else None
    up = client.query_range_chunked('up{job="collector"}', end_ms - 10_000, end_ms, 1000)
    print(f"finding lines over the range: {len(lines)}; newest: {newest}; empty at the end: {empty}; "
          f"the collector's up over the last 10 s: {[v for series in up for v in series.values]}")
    assert newest is not None
    assert len(list(out.glob("*.png"))) == 20, done.stdout
    variables = {"run": f"{engine_name}-tier"}
    results = {r.panel["title"]: r for r in query_panels(client, start_ms, end_ms, 1000, variables)
               if r.panel["type"] != "row"}
    marks = query_phase_marks(client, start_ms, end_ms, 1000, variables)
    assert [m.title for m in marks] == [f"phase C={c}" for c in CONCURRENCY]
    stages = {s.legend: s for s in results["Micro-batches in flight vs pipeline stages"].series}
    stage_line = stages["pipeline stages (pp_size)"].values
    assert set(stage_line[np.isfinite(stage_line)]) == {2.0}, stages.keys()
    busy = results["Busy per stage (heatmap)"]
    assert sorted(s.legend for s in busy.series) == ["stage 0", "stage 1"]
    # an admission line names the limit in the engine's own words (vLLM's read SGLang's); the live
    # line is the report's finding, cause and summary ("its limit (max_num_seqs = 8)"). Whether the
    # live view reaches one at C=16 varies from run to run on this CPU (3 distinct lines over a
    # vLLM run, none of them admission_bound in one of 3): tests/test_live.py holds the words itself
    setting = {"sglang": "max_running_requests", "vllm": "max_num_seqs"}[engine_name]
    found = [series.labels["finding"] for series in lines]
    admission = [line for line in found if line.startswith("admission_bound")]
    assert all(f"({setting} = {ADMISSION_LIMIT})" in line for line in admission), found
    # Seen in these panels (session 13): SGLang's total read 2 running in 2 micro-batches at C=1,
    # vLLM's 0 running (a stats line at batch turnover) while 1 and 4 were in flight
    totals = {s.legend: dict(zip(s.ts_s.tolist(), s.values.tolist(), strict=True))
              for s in results["Engine running total vs its pool and the load"].series}
    engine, load = totals["engine running (total)"], totals["load in flight"]
    both = [(t, engine[t], load[t]) for t in sorted(engine) if t in load and np.isfinite(engine[t] + load[t])]
    assert len(both) >= 20, both
    assert all(running <= in_flight + 0.5 for _, running, in_flight in both), both
    assert all(running >= 0.5 for _, running, in_flight in both if in_flight >= 1), both


# The recommendation, applied to the real engine


def test_watch_reads_a_real_engine_capture(sglang_run: Capture) -> None:
    """`gputrace watch` in a 200x50 tmux pane beside SGLang's capture: in the settled half of every
    level it names the phase, draws PP0 and PP1 with the same bubble, and its engine line reads no
    more running than the load in flight nor than the pool of 8, at most 2 micro-batches in flight
    of 2 stages (SGLang's log gives every rank's), and at C=16 requests queued. The screens go to
    tests/artifacts/watch-sglang.txt."""
    artifact = Path(__file__).parent / "artifacts" / "watch-sglang.txt"
    artifact.parent.mkdir(exist_ok=True)
    screens = sglang_run.watch_screens
    artifact.write_text("".join(f"--- {time.strftime('%H:%M:%S', time.gmtime(ts / 1e9))} UTC\n"
                                + "\n".join(screen).rstrip() + "\n" for ts, screen in screens))
    for label, (start, end) in sglang_run.phases().items():
        level = int(label.removeprefix("C="))
        settled = [screen for ts, screen in screens
                   if start + (end - start) // 2 <= ts <= end and f"phase {label} " in screen[0]]
        assert len(settled) >= 3, (label, f"{len(settled)} screens; see {artifact}")
        assert all(set(stage_rows(screen)) == {0, 1} for screen in settled), (label, settled[-1])
        # both stages run the same requests on the same stand-in GPUs: the same bubble
        bubbles = [{pp: row.split("│")[4].strip() for pp, row in stage_rows(screen).items()}
                   for screen in settled]
        assert all(b[0] == b[1] != "n/a" for b in bubbles), (label, bubbles)
        lines = [line for screen in settled if (line := engine_line(screen)) is not None]
        assert lines, (label, settled[-1])
        print(label, "watch's engine line (running, pool, queued, micro-batches, stages):", lines)
        assert all(r <= min(level, ADMISSION_LIMIT) for r, *_ in lines), (label, lines)
        assert all(pool in (None, ADMISSION_LIMIT) for _, pool, _, _, _ in lines), (label, lines)
        assert max(r for r, *_ in lines) >= 1, (label, lines)  # a request runs at every level
        assert all(mbs is not None and mbs <= 2 and stages == 2 for _, _, _, mbs, stages in lines), lines
        if level == 16:
            assert max(q for _, _, q, _, _ in lines) > 0, (label, lines)


def _client_tok_s(requests_jsonl: Path, label: str) -> float:
    """Completion tokens over the level's duration, from `gputrace load --out`'s records."""
    rows = [json.loads(line) for line in requests_jsonl.read_text().splitlines()]
    marks = sorted((r["ts_ns"], r["label"]) for r in rows if r["type"] == "marker")
    start = next(ts for ts, lab in marks if lab == label)
    end = min((ts for ts, _ in marks if ts > start), default=max(r.get("end_ns") or 0 for r in rows))
    tokens = sum(r["completion_tokens"] or 0 for r in rows if r["type"] == "request" and r["ok"]
                 and r.get("end_ns") and start <= r["end_ns"] <= end)
    return tokens / ((end - start) / 1e9)


def _apply_recommendation(capture: Capture, tmp: Path, queue_metric: str, **labels: str) -> None:
    """gputrace's finding at C=16 names the admission limit; the engine restarted with that flag
    runs C=16 with nothing waiting. Prints throughput before and after (same C, same machine)."""
    from gputrace.analyse import analyse_run

    with Store.open(capture.run_dir, read_only=True) as store:
        findings = [f for f in analyse_run(store, effects=False).findings if f.phase == "C=16"]
    bound = [f for f in findings if f.cause == "admission_bound"]
    assert bound, [f.cause for f in findings]
    assert bound[0].change is not None
    flag, value = bound[0].change.flag, bound[0].change.value
    assert value == 16
    engine = capture.engine.setting.engine
    applied = EngineSetting(engine, "applied", (flag, str(value)))
    out = tmp / "requests.jsonl"
    with running_engine(applied, tmp / f"{engine}-applied.log") as restarted, \
            MetricsScraper(restarted) as scraper:
        load = subprocess.run(
            [sys.executable, "-m", "gputrace", "load", "--url", restarted.url, "--model", restarted.model,
             "--concurrency", "16", "--duration-per-level", str(LEVEL_S[engine]),
             "--max-tokens", str(MAX_TOKENS[engine]), "--ignore-eos", "--out", str(out)],
            capture_output=True, text=True, timeout=600)
        assert load.returncode == 0, load.stderr[-2000:]
    queued = [v for _, v in scraper.series(queue_metric, **labels)]
    settled = queued[len(queued) // 3:]
    assert settled and statistics.median(settled) == 0, queued
    with Store.open(capture.run_dir, read_only=True) as store:
        before = analyse_run(store, effects=False).metrics
    before_tok_s = next(pm.client_throughput_tok_s for pm in before if pm.label == "C=16")
    after_tok_s = _client_tok_s(out, "C=16")
    print(f"\n{engine} C=16: {flag} {value} applied: waiting median 0 (was about 8); "
          f"client tok/s {before_tok_s:.1f} -> {after_tok_s:.1f}")


def test_sglang_recommendation_applied_removes_the_wait(sglang_run: Capture, tmp_path: Path) -> None:
    """SGLang restarted with gputrace's `--max-running-requests 16` keeps none of C=16 waiting."""
    _apply_recommendation(sglang_run, tmp_path, "sglang:num_queue_reqs", pp_rank="0")


def test_vllm_recommendation_applied_removes_the_wait(vllm_run: Capture, tmp_path: Path) -> None:
    """vLLM restarted with gputrace's `--max-num-seqs 16` keeps none of C=16 waiting."""
    _apply_recommendation(vllm_run, tmp_path, "vllm:num_requests_waiting")
