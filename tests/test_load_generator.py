"""The load generator against a real aiohttp server on loopback that speaks the OpenAI streaming
protocol (tests/openai_server.py) and counts the requests it holds at once."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import free_port
from structlog.testing import capture_logs

from gputrace.errors import SourceError, UsageError
from gputrace.load import LoadSpec, run_load, spec_from_config
from gputrace.load.stats import inflight_in_window, inflight_series

sys.path.insert(0, str(Path(__file__).parent))
from openai_server import ServerBehaviour, ServerStats, start_server

Server = Callable[..., Any]


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    """Starts fixture servers on free ports; stops them after the test."""
    runners = []

    async def start(**behaviour: Any) -> tuple[str, ServerStats]:
        runner, url, stats = await start_server(ServerBehaviour(**behaviour))
        runners.append(runner)
        return url, stats

    yield start
    for runner in runners:
        await runner.cleanup()



async def test_exactly_c_in_flight_per_level(server: Server) -> None:
    """Client and server both see exactly C requests in flight in each level, never more."""
    url, stats = await server(token_interval_s=0.01, ttft_s=0.01)
    spec = LoadSpec(url=url, model="m", concurrency=(4, 16, 2), max_tokens=30, requests_per_level=48)
    result = await run_load(spec)
    assert [lv.label for lv in result.levels] == ["C=4", "C=16", "C=2"]
    assert stats.max_active == 16
    times, counts = inflight_series(result.requests)
    for lv in result.levels:
        c = lv.target_concurrency
        assert c is not None and lv.steady_start_ns is not None
        steady = (times >= lv.steady_start_ns) & (times < lv.end_ns)
        assert counts[steady].max() == c, lv  # never more than C ...
        assert lv.inflight_mean is not None and lv.inflight_mean == pytest.approx(c, rel=0.01)  # ... nor less
        # A slot restarts within microseconds; only an OS preemption of this process on a busy
        # machine can hold a slot empty for the 1 ms that inflight_min counts.
        assert lv.inflight_min is not None and lv.inflight_min >= c - 1, lv
        assert not lv.short
        # The server's own count over the same steady window: never above C, and near it (it shares
        # this event loop, so it registers each request a little after the client sends it).
        assert stats.max_active_in(lv.steady_start_ns + 2_000_000, lv.end_ns) <= c
        assert stats.mean_active(lv.steady_start_ns, lv.end_ns) >= 0.85 * c


async def test_each_request_opens_its_own_connection(server: Server) -> None:
    """No request is sent on a kept-alive connection: under a busy CPU vLLM 0.32 dropped about one in
    ten of those (ServerDisconnectedError, CI stop 31), never one on a fresh connection."""
    url, stats = await server(token_interval_s=0.001, ttft_s=0.001)
    spec = LoadSpec(url=url, model="m", concurrency=(2,), max_tokens=4, requests_per_level=12)
    result = await run_load(spec)
    assert all(r.ok for r in result.requests)
    assert stats.requests == 12 and len(stats.connections) == 12


async def test_markers_records_and_mark_url(server: Server) -> None:
    """Each level starts with a phase marker (posted to --mark-url too); every request is complete."""
    url, stats = await server()
    spec = LoadSpec(
        url=url, model="m", concurrency=(2, 4), max_tokens=7, requests_per_level=10,
        warmup_s=0.05, mark_url=url + "/mark", host="client-a",
    )
    result = await run_load(spec)
    labels = [(m.label, m.kind, m.target_concurrency) for m in result.markers]
    assert labels == [("warmup", "phase", 2), ("C=2", "phase", 2), ("C=4", "phase", 4), ("end", "end", None)]
    assert [m["label"] for m in stats.markers] == ["warmup", "C=2", "C=4", "end"]
    posted = stats.markers[2]
    ts = result.markers[2].ts_ns
    assert posted == {"label": "C=4", "kind": "phase", "target_concurrency": 4, "ts_ns": ts}
    by_phase = {lab: [r for r in result.requests if r.phase == lab] for lab in ("C=2", "C=4")}
    assert len(by_phase["C=2"]) == 10 and len(by_phase["C=4"]) == 10
    assert len({r.request_id for r in result.requests}) == len(result.requests)
    for r in result.requests:
        assert r.ok and r.error is None and r.host == "client-a"
        assert r.first_token_ns is not None and r.end_ns is not None
        assert r.start_ns < r.first_token_ns <= r.end_ns
        assert r.completion_tokens == 7 and r.prompt_tokens is not None and r.prompt_tokens > 0
    # A request belongs to the level during which it started.
    marks = {m.label: m.ts_ns for m in result.markers}
    assert all(marks["C=2"] <= r.start_ns < marks["C=4"] for r in by_phase["C=2"])
    assert all(marks["C=4"] <= r.start_ns < marks["end"] for r in by_phase["C=4"])


async def test_non_streaming(server: Server) -> None:
    """--no-stream: tokens come from usage and there is no first-token time."""
    url, _ = await server()
    result = await run_load(LoadSpec(url=url, model="m", concurrency=(3,), max_tokens=5,
                                     requests_per_level=9, stream=False))
    assert len(result.requests) == 9
    assert all(r.ok and r.first_token_ns is None and r.completion_tokens == 5 for r in result.requests)
    (lv,) = result.levels
    assert lv.ttft_ms is None and lv.itl_ms is None and lv.output_tokens == 45
    assert lv.aggregate_tok_s is not None and lv.aggregate_tok_s > 0


async def test_tokens_counted_without_usage(server: Server) -> None:
    """A server that ignores include_usage: completion tokens are counted from the stream."""
    url, _ = await server(send_usage=False)
    spec = LoadSpec(url=url, model="m", concurrency=(2,), max_tokens=9, requests_per_level=4)
    result = await run_load(spec)
    assert [r.completion_tokens for r in result.requests] == [9, 9, 9, 9]
    assert all(r.prompt_tokens is None for r in result.requests)


async def test_errors_are_recorded(server: Server) -> None:
    """HTTP errors become failed records with the status and message; the run goes on."""
    url, _ = await server(fail_every=4)
    spec = LoadSpec(url=url, model="m", concurrency=(2,), max_tokens=3, requests_per_level=20)
    result = await run_load(spec)
    failed = [r for r in result.requests if not r.ok]
    assert len(result.requests) == 20 and len(failed) == 5
    assert all(r.error is not None and r.error.startswith("HTTP 500: ") for r in failed)
    assert all(r.completion_tokens is None for r in failed)
    assert result.levels[0].failed == 5 and result.levels[0].ok == 15


async def test_stream_cut_short_is_an_error(server: Server) -> None:
    """A stream that ends before data: [DONE] is a failed request that says so."""
    url, _ = await server(cut_after_tokens=3)
    spec = LoadSpec(url=url, model="m", concurrency=(1,), max_tokens=8, requests_per_level=2)
    result = await run_load(spec)
    assert [r.ok for r in result.requests] == [False, False]
    assert all("before 'data: [DONE]' after 3 chunks" in (r.error or "") for r in result.requests)


async def test_warns_when_server_caps_concurrency(server: Server) -> None:
    """A server that refuses beyond 3 requests: the level is short of C=8 and a warning says so."""
    url, stats = await server(max_active=3, token_interval_s=0.01)
    with capture_logs() as logs:
        result = await run_load(
            LoadSpec(url=url, model="m", concurrency=(8,), max_tokens=10, duration_per_level_s=1.0)
        )
    (lv,) = result.levels
    assert stats.refused > 0 and lv.failed > 0
    assert lv.short and lv.inflight_mean is not None and lv.inflight_mean < 7.9
    assert result.short_levels == [lv]
    warnings = [e for e in logs if e["event"] == "client kept fewer requests in flight than asked"]
    assert warnings and warnings[0]["target"] == 8


async def test_duration_per_level(server: Server) -> None:
    """--duration-per-level: each level lasts its time; in-flight requests carry over."""
    url, _ = await server(token_interval_s=0.005)
    result = await run_load(
        LoadSpec(url=url, model="m", concurrency=(2, 6), max_tokens=20, duration_per_level_s=0.4)
    )
    c2, c6 = result.levels
    assert c2.duration_s == pytest.approx(0.4, abs=0.05)
    assert c6.start_ns == c2.end_ns
    assert c2.inflight_mean == pytest.approx(2, rel=0.01) and c6.inflight_mean == pytest.approx(6, rel=0.01)


async def test_mark_url_failure_is_not_fatal(server: Server) -> None:
    """A mark URL nobody listens on: warned, and the load still runs."""
    url, _ = await server()
    with capture_logs() as logs:
        result = await run_load(
            LoadSpec(url=url, model="m", concurrency=(1,), max_tokens=2, requests_per_level=2,
                     mark_url=f"http://127.0.0.1:{free_port()}/mark")
        )
    assert len(result.requests) == 2
    assert any(e["event"] == "marker post failed" for e in logs)


async def test_unreachable_server_is_one_error() -> None:
    """Nothing listening: one SourceError naming the endpoint, not a table of failures."""
    url = f"http://127.0.0.1:{free_port()}"
    spec = LoadSpec(url=url, model="m", concurrency=(2,), requests_per_level=50)
    with pytest.raises(SourceError, match="cannot connect"):
        await run_load(spec)


def test_spec_validation() -> None:
    """Contradictory or impossible options are usage errors."""
    with pytest.raises(UsageError, match="not both"):
        LoadSpec(url="http://x", model="m", concurrency=(1,), requests_per_level=1, duration_per_level_s=1)
    with pytest.raises(UsageError, match="positive"):
        LoadSpec(url="http://x", model="m", concurrency=(0,))
    with pytest.raises(UsageError, match="http"):
        LoadSpec(url="x:80", model="m", concurrency=(1,))
    assert LoadSpec(url="http://h:1/v1", model="m", concurrency=(1,)).endpoint == "http://h:1/v1/chat/completions"


def test_spec_from_config() -> None:
    """gputrace.toml's [load] table becomes a LoadSpec; overrides such as mark_url win."""
    from gputrace.config import LoadConfig

    cfg = LoadConfig(url="http://h:30000", model="qwen", concurrency=(1, 8), max_tokens=64,
                     duration_per_level_s=30.0, stream=False)
    spec = spec_from_config(cfg, mark_url="http://127.0.0.1:9/mark")
    assert (spec.url, spec.model, spec.concurrency, spec.max_tokens) == ("http://h:30000", "qwen", (1, 8), 64)
    assert spec.duration_per_level_s == 30.0 and spec.requests_per_level is None and not spec.stream
    assert spec.mark_url == "http://127.0.0.1:9/mark"


def test_inflight_series_handles_back_to_back_slots() -> None:
    """A slot that ends and restarts at the same nanosecond is counted once, and the microsecond
    gap between one request's end and the next start does not set the minimum."""
    from gputrace.model import RequestRecord

    recs = [
        RequestRecord(host="h", request_id="a", start_ns=0, end_ns=10_000_000),
        RequestRecord(host="h", request_id="b", start_ns=10_000_000, end_ns=20_000_000),
        RequestRecord(host="h", request_id="c", start_ns=0, end_ns=5_000_000),
        RequestRecord(host="h", request_id="d", start_ns=5_000_500, end_ns=20_000_000),
    ]
    times, counts = inflight_series(recs)
    assert counts.max() == 2
    mean, low = inflight_in_window(times, counts, 0, 20_000_000)
    assert low == 2 and mean == pytest.approx(2.0, rel=1e-3)


def test_level_stats_from_records() -> None:
    """Aggregate tok/s counts only tokens generated inside the level; TTFT and ITL from the records."""
    from gputrace.load.stats import level_stats
    from gputrace.model import Marker, RequestRecord

    s = 1_000_000_000
    recs = [
        RequestRecord(host="h", request_id="a", start_ns=0, first_token_ns=s // 10, end_ns=2 * s,
                      completion_tokens=101, phase="C=2"),
        RequestRecord(host="h", request_id="b", start_ns=0, first_token_ns=s, end_ns=3 * s,
                      completion_tokens=100, phase="C=2"),
    ]
    markers = [Marker(host="h", ts_ns=0, label="C=2", target_concurrency=2),
               Marker(host="h", ts_ns=2 * s, label="end", kind="end")]
    (lv,) = level_stats(recs, markers)
    assert lv.aggregate_tok_s == pytest.approx((101 + 50) / 2)
    assert lv.ttft_ms is not None and lv.ttft_ms[0] == pytest.approx(550.0)
    assert lv.itl_ms is not None and lv.itl_ms[0] == pytest.approx((19.0 + 2000 / 99) / 2)
    assert lv.ok == 2 and lv.failed == 0 and lv.output_tokens == 201


async def test_prompts_file(server: Server, tmp_path: Path) -> None:
    """--prompts JSONL: 'prompt' and 'messages' lines are sent in turn; a bad line is warned about."""
    from gputrace.load.generator import load_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a b c"}\nnot json\n{"messages": [{"role": "user", "content": "d e"}]}\n')
    with capture_logs() as logs:
        prompts = load_prompts(path)
    assert prompts == ("a b c", [{"role": "user", "content": "d e"}])
    assert any(e["event"] == "prompts skipped" and e["bad_lines"] == 1 for e in logs)
    url, _ = await server()
    spec = LoadSpec(url=url, model="m", concurrency=(1,), max_tokens=2, requests_per_level=4, prompts=prompts)
    result = await run_load(spec)
    # The fixture server counts prompt tokens as whitespace words of the messages it received.
    assert [r.prompt_tokens for r in result.requests] == [3, 2, 3, 2]


async def test_failing_sink_stops_the_run(server: Server) -> None:
    """If on_record raises (say the store is gone), the run stops and raises it, not loses records."""
    url, _ = await server()
    seen: list[object] = []

    def sink(record: object) -> None:
        seen.append(record)
        if len(seen) == 5:
            raise OSError("disk full")

    spec = LoadSpec(url=url, model="m", concurrency=(2,), max_tokens=2, requests_per_level=1000)
    with pytest.raises(OSError, match="disk full"):
        await run_load(spec, on_record=sink)
    assert len(seen) == 5


async def test_drain_abandons_requests_after_the_last_level(server: Server) -> None:
    """With drain_s, requests still running after the last level are abandoned, not waited for."""
    url, _ = await server(token_interval_s=0.05, ttft_s=0.01)
    spec = LoadSpec(url=url, model="m", concurrency=(4,), max_tokens=1000, duration_per_level_s=0.5,
                    drain_s=0.2)
    result = await run_load(spec)
    assert result.wall_s < 5.0  # 1000 tokens at 20/s would take 50 s per request
    assert [m.kind for m in result.markers] == ["phase", "end"]
    assert all(not r.ok or r.completion_tokens for r in result.requests)


def test_token_counts_that_are_not_counts_are_none() -> None:
    """`usage` values a server should not send (a string, a bool, 2^63) become None at the client,
    never a record the store cannot hold; malformed choices do not crash the parse ([robust] #1, #8)."""
    import json as _json

    from gputrace.load.generator import _parse_completion, token_count

    assert [token_count(v) for v in (12, "12", True, 2**63, -1, 1.5, None)] == [12, None, None, None, None,
                                                                                None, None]
    body = _json.dumps({"choices": [1], "usage": {"prompt_tokens": "7", "completion_tokens": 2**63}})
    assert _parse_completion(body.encode()) == (None, 0, None)
    body = _json.dumps({"choices": [{"message": {"content": "a b c"}}], "usage": {"prompt_tokens": 5}})
    assert _parse_completion(body.encode()) == (5, 3, None)


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(("malformed", "said"), [
    ("choices", ["choices[0] not an object"]),
    ("usage", ["usage.completion_tokens not a token count", "usage.prompt_tokens not a token count"])])
async def test_malformed_answers_are_records_and_the_summary_says_so(
        server: Server, malformed: str, said: list[str], stream: bool) -> None:
    """Answers with `"choices": [1]` or usage counts as strings ([robust] #8: AttributeError in the
    workers, no records; the summary died): every request is a record, the summary prints and
    names what was not as the protocol says."""
    from rich.console import Console

    from gputrace.load.console import print_summary

    url, _ = await server(malformed=malformed)
    spec = LoadSpec(url=url, model="m", concurrency=(2,), max_tokens=4, requests_per_level=6, stream=stream)
    result = await run_load(spec)
    assert len(result.requests) == 6
    assert result.malformed == dict.fromkeys(said, 6)
    console = Console(record=True, width=200)
    print_summary(result, console)
    text = console.export_text()
    assert all(f"6 answers with {what}" in text for what in said)


@pytest.mark.parametrize(("raw", "stream", "error"), [
    (b"[" * 100_000, False, "malformed answer: RecursionError"),
    (b"data: " + b"[" * 100_000 + b"\n\n", True, "malformed answer: RecursionError"),
    (b'{"error": "\\ud800 boom"}', False, "\\ud800 boom"),
    (b'data: {"error": {"message": "\\udfff"}}\n\ndata: [DONE]\n\n', True, "\\udfff"),
    (b"\xff\xfe", False, "JSONDecodeError"),
])
async def test_hostile_answers_fail_their_request_and_the_run_goes_on(
        server: Server, raw: bytes, stream: bool, error: str) -> None:
    """A deeply nested answer failed the worker silently and the run never ended; an error text
    with a lone surrogate stopped the summary: each is now one failed request with a printable
    error, and the run ends."""
    from rich.console import Console

    from gputrace.load.console import print_summary

    url, _ = await server(raw_answer=raw)
    spec = LoadSpec(url=url, model="m", concurrency=(2,), max_tokens=4, requests_per_level=4, stream=stream)
    result = await asyncio.wait_for(run_load(spec), timeout=30)
    assert len(result.requests) == 4
    assert all(not r.ok and r.error is not None and r.error.startswith(error) for r in result.requests)
    assert all(r.error is not None and r.error.isprintable() for r in result.requests)
    print_summary(result, Console(record=True, width=200))


async def test_requests_abandoned_at_the_drain_are_counted_apart(server: Server, tmp_path: Path) -> None:
    """Requests still running when the drain time runs out are abandoned, not failed ([robust] #8):
    the level, the summary and the analysis count them apart, and findings' unfinished_requests
    says how many (it said 0 when 63 of 89 were abandoned)."""
    import json

    from rich.console import Console

    from gputrace.analyse import analyse_run
    from gputrace.commands.load import no_request_completed
    from gputrace.load.console import failure_reasons, print_summary
    from gputrace.report.render import write_report
    from gputrace.store import Store

    url, _ = await server(token_interval_s=0.05, ttft_s=0.01)
    spec = LoadSpec(url=url, model="m", concurrency=(4,), max_tokens=1000, duration_per_level_s=0.5,
                    drain_s=0.2)
    result = await run_load(spec)
    assert result.abandoned == 4 == len(result.requests)
    (level,) = result.levels
    assert (level.ok, level.failed, level.abandoned) == (0, 0, 4)
    assert failure_reasons(result) == []
    console = Console(record=True, width=200)
    print_summary(result, console)
    assert "abandoned: 4 requests still running when the drain time" in console.export_text()
    assert no_request_completed(result) == ("no request completed: 4 abandoned when the drain time "
                                            "after the last level ran out")
    with Store.create(tmp_path / "run") as store:
        store.append(result.requests)
        store.append(result.markers)
        analysis = analyse_run(store, effects=False)
        (phase,) = analysis.metrics
    assert (phase.requests_failed, phase.unfinished_requests, phase.requests_completed) == (0, 4, 0)
    write_report(analysis, tmp_path / "report", formats=["json"])
    (written,) = json.loads((tmp_path / "report" / "findings.json").read_text())["phases"]
    assert (written["unfinished_requests"], written["requests_failed"]) == (4, 0)


async def test_burst_sends_c_at_once_and_waits_for_the_last(server: Server) -> None:
    """--burst: each level's C requests start together, nothing replaces a finished one, and the
    next level starts only once the last of them is back (how the motivating sweep was measured)."""
    url, stats = await server(token_interval_s=0.005, ttft_s=0.005)
    spec = LoadSpec(url=url, model="m", concurrency=(3, 6), max_tokens=10, burst=True)
    result = await run_load(spec)
    assert [lv.label for lv in result.levels] == ["C=3", "C=6"]
    by_phase = {label: [r for r in result.requests if r.phase == label] for label in ("C=3", "C=6")}
    assert [len(v) for v in by_phase.values()] == [3, 6] and all(r.ok for r in result.requests)
    assert stats.max_active == 6
    for reqs in by_phase.values():  # all of a level go out together
        starts = [r.start_ns for r in reqs]
        assert max(starts) - min(starts) < 50_000_000
    last_of_first = max(r.end_ns for r in by_phase["C=3"] if r.end_ns is not None)
    assert min(r.start_ns for r in by_phase["C=6"]) >= last_of_first
    marks = {m.label: m.ts_ns for m in result.markers}
    assert marks["C=6"] >= last_of_first


def test_burst_refuses_level_lengths() -> None:
    """A burst level ends when its requests are back: a request count, a duration or a warm-up
    with --burst is a usage error that says which to drop."""
    for extra in ({"requests_per_level": 4}, {"duration_per_level_s": 1.0}, {"warmup_s": 1.0}):
        with pytest.raises(UsageError, match="--burst"):
            LoadSpec(url="http://x", model="m", concurrency=(1,), burst=True, **extra)  # type: ignore[arg-type]


async def test_records_and_markers_are_stamped_on_the_injected_clock(server: Server) -> None:
    """A generator given a clock (1 h ahead here) stamps every marker and request time on it."""
    from gputrace.load.generator import LoadGenerator

    url, _ = await server()
    hour_ns = 3600 * 10**9
    spec = LoadSpec(url=url, model="m", concurrency=(2,), max_tokens=3, requests_per_level=4)
    before_ns = time.time_ns()
    result = await LoadGenerator(spec, clock_ns=lambda: time.time_ns() + hour_ns).run()
    after_ns = time.time_ns()
    stamps = [m.ts_ns for m in result.markers] + [t for r in result.requests
                                                    for t in (r.start_ns, r.first_token_ns, r.end_ns)]
    assert len(stamps) == 2 + 3 * 4
    assert all(t is not None and before_ns + hour_ns <= t <= after_ns + hour_ns for t in stamps)
