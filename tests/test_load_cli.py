"""`gputrace load` as a user runs it: its own process against a real OpenAI-protocol server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import gputrace_process

from gputrace.imports.request_files import parse_requests_jsonl
from gputrace.model import Marker, RequestRecord

sys.path.insert(0, str(Path(__file__).parent))
from openai_server import ServerBehaviour, ServerStats, start_server


@pytest.fixture
def server_thread() -> Iterator[tuple[str, ServerStats]]:
    """The fixture server on its own event loop in a thread, so the CLI can run as a process."""
    with serving(ServerBehaviour(token_interval_s=0.002)) as served:
        yield served


@contextlib.contextmanager
def serving(behaviour: ServerBehaviour) -> Iterator[tuple[str, ServerStats]]:
    """The fixture server answering as ``behaviour`` says, on its own event loop in a thread."""
    loop = asyncio.new_event_loop()
    started: dict[str, object] = {}
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        runner, url, stats = loop.run_until_complete(start_server(behaviour))
        started.update(runner=runner, url=url, stats=stats)
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    yield str(started["url"]), started["stats"]  # type: ignore[misc]
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_load_command_table_and_out_file(server_thread: tuple[str, ServerStats], tmp_path: Path) -> None:
    """The table lists each level; --out holds typed request and marker lines; markers posted."""
    url, stats = server_thread
    out = tmp_path / "load.jsonl"
    proc = gputrace_process(
        "load", "--url", url, "--model", "m", "--concurrency", "2,5", "--max-tokens", "6",
        "--requests-per-level", "10", "--out", str(out), env={"GPUTRACE_MARK_URL": url + "/mark"},
    )
    assert proc.returncode == 0, proc.stderr
    for text in ("C=2", "C=5", "TTFT ms p50/p90/p99", "in flight mean", "client CPU"):
        assert text in proc.stdout
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert {line["type"] for line in lines} == {"request", "marker"}
    parsed = parse_requests_jsonl(out)
    requests = [r for r in parsed.records if isinstance(r, RequestRecord)]
    markers = [r for r in parsed.records if isinstance(r, Marker)]
    assert parsed.bad == 0 and len(requests) == 20
    assert [m.label for m in markers] == ["C=2", "C=5", "end"]
    assert [m["label"] for m in stats.markers] == ["C=2", "C=5", "end"]


def test_load_command_usage_error(server_thread: tuple[str, ServerStats]) -> None:
    """Contradictory options: one error line, exit status 2."""
    url, _ = server_thread
    proc = gputrace_process("load", "--url", url, "--model", "m", "--requests-per-level", "3",
                     "--duration-per-level", "2")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["gputrace: error: give --requests-per-level or "
                                                "--duration-per-level, not both"]


@pytest.mark.parametrize("level", ["100000000000", "1000000", "193"])
def test_a_concurrency_past_what_the_machine_holds_is_refused_at_once(tmp_path: Path, level: str) -> None:
    """--concurrency 10^11 grew `load` to 3 GB in 30 s with no output, 10^6 never ended: a level
    past the connections this process may open (here 256 files, 64 kept for itself) is one error
    line, exit 2, nothing sent or written."""
    def limit_open_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    out = tmp_path / "load.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "gputrace", "load", "--url", "http://127.0.0.1:1", "--model", "m",
         "--concurrency", f"1,{level}", "--out", str(out)],
        capture_output=True, text=True, timeout=60, preexec_fn=limit_open_files)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"gputrace: error: --concurrency: {level} requests in flight need as many open connections; "
        "this machine can hold at most 192 (its open-file limit is 256: raise it with ulimit -n)"]
    assert not out.exists()


def test_interrupted_load_keeps_finished_requests(
    server_thread: tuple[str, ServerStats], tmp_path: Path
) -> None:
    """Ctrl-C mid-sweep: exit 130, and --out already holds the marker and every finished request."""
    import signal
    import time

    url, _ = server_thread
    out = tmp_path / "load.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gputrace", "load", "--url", url, "--model", "m", "--concurrency", "4",
         "--max-tokens", "20", "--duration-per-level", "60", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # a terminal's Ctrl-C: a runner started in the background (`cmd &` without job control)
        # ignores SIGINT, and its children inherit that, so the load would never see it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (not out.exists() or out.read_text().count('"request"') < 8):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    parsed = parse_requests_jsonl(out)
    assert parsed.bad == 0
    assert [m.label for m in parsed.records if isinstance(m, Marker)] == ["C=4"]
    assert sum(isinstance(r, RequestRecord) for r in parsed.records) >= 8


def test_a_dead_server_fails_the_load_with_the_reason(tmp_path: Path) -> None:
    """`gputrace load` against nothing, even at one level of C=1, prints why the requests failed
    and exits 1 ([robust] #8: it exited 0 and never said why); every request is a record."""
    out_file = tmp_path / "requests.jsonl"
    argv = [sys.executable, "-m", "gputrace", "load", "--url", "http://127.0.0.1:1", "--model", "m",
            "--concurrency", "1", "--requests-per-level", "3", "--out", str(out_file)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "failed: 3 x ClientConnectorError" in out.stdout
    assert out.stderr.strip().splitlines()[-1].startswith("gputrace: error: every request failed (3), e.g.: ")
    records = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert sum(1 for r in records if r["type"] == "request" and not r["ok"] and r["error"]) == 3


def test_load_command_burst(server_thread: tuple[str, ServerStats], tmp_path: Path) -> None:
    """`gputrace load --burst`: C requests per level, all of them recorded, the levels in order."""
    url, _ = server_thread
    out = tmp_path / "load.jsonl"
    proc = gputrace_process("load", "--url", url, "--model", "m", "--concurrency", "2,4", "--max-tokens", "4",
                     "--burst", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    parsed = parse_requests_jsonl(out)
    requests = [r for r in parsed.records if isinstance(r, RequestRecord)]
    assert sorted((r.phase, r.ok) for r in requests) == [("C=2", True)] * 2 + [("C=4", True)] * 4


@pytest.mark.parametrize("behaviour", [
    ServerBehaviour(token_interval_s=0, ttft_s=0, malformed="usage"),
    ServerBehaviour(token_interval_s=0, ttft_s=0, raw_answer=json.dumps({
        "choices": [{"message": {"content": "a b"}}],
        "usage": {"prompt_tokens": 2**63, "completion_tokens": 2}}).encode())], ids=["text", "past-int64"])
def test_run_against_a_server_with_bad_usage_counts_stores_every_request(
        tmp_path: Path, behaviour: ServerBehaviour) -> None:
    """`gputrace run` with the built-in load against a server whose usage counts are text or past
    int64 ([robust] #1: the collector's writer stopped, no meta.extra, no report): every request is
    stored with its count unknown, the run ends 0 with its report."""
    from gputrace.store import Store

    cfg = tmp_path / "gputrace.toml"
    cfg.write_text('[[hosts]]\nname = "h"\n')
    with serving(behaviour) as (url, _):
        out = subprocess.run([sys.executable, "-m", "gputrace", "run", "--config", str(cfg), "--out",
                              str(tmp_path / "run"), "--listen", "", "--url", url, "--model", "m",
                              "--concurrency", "1,2", "--requests-per-level", "3", "--max-tokens", "4",
                              "--no-stream", "--warmup", "0"],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    with Store.open(tmp_path / "run", read_only=True) as store:
        assert store.count("requests") == 6 == store.meta.extra["collector"]["counts"]["requests"]
        assert store.sql("SELECT count(*) FROM requests WHERE prompt_tokens IS NULL") == [(6,)]
    assert json.loads((tmp_path / "run" / "report" / "findings.json").read_text())["phases"]
