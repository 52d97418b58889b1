"""The collector's inputs with arbitrary values ([robust] Must show 2): marks posted to /v1/mark,
engine log lines with any field values, agent sample pages with any rows, model-server answers to
the load generator. One collector runs through every example, in process, with its real HTTP server,
log follower, agent client, parsers, store and batching writer; after each example it still runs,
every valid record is in the store and every other one is counted."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gputrace.collect import CollectOptions, Collector
from gputrace.config import parse_config
from gputrace.load import LoadSpec, run_load
from gputrace.model import RECORD_TABLES, EngineConfig, GpuSample, SchedulerEvent
from gputrace.store import Store

sys.path.insert(0, str(Path(__file__).parent))
from fake_clock import until
from openai_server import ServerBehaviour, start_server

EXAMPLES = 30  # about 15 s on the shared machine: a bounded run, not a fuzzing campaign

# -- strategies ---------------------------------------------------------------------------------

ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=12)  # lone surrogates included
LINE_TEXT = st.text(st.characters(exclude_characters="\n\r", exclude_categories=("Cs",)), max_size=12)
NUMBER = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True))
JSON = st.recursive(st.one_of(st.none(), st.booleans(), NUMBER, ANY_TEXT),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ANY_TEXT, inner, max_size=3),
                    max_leaves=8)
MARK = st.one_of(
    JSON, st.binary(max_size=24),
    st.fixed_dictionaries({"label": st.one_of(ANY_TEXT, JSON)}, optional={
        "kind": st.one_of(st.sampled_from(["phase", "end", "note"]), JSON),
        "target_concurrency": st.one_of(st.integers(-3, 2**64), JSON),
        "ts_ns": st.one_of(st.integers(-3, 2**64), JSON),
        "host": st.one_of(ANY_TEXT, JSON)}))
FIELD = st.one_of(st.integers(-(2**70), 2**70), st.floats(), LINE_TEXT)
SGLANG = st.builds("[2026-01-02 03:04:05 PP{}] Decode batch, #running-req: {}, #token: {}, token usage: {}, "
                   "cuda graph: True, gen throughput (token/s): {}, #queue-req: {}".format,
                   FIELD, FIELD, FIELD, FIELD, FIELD, FIELD)
VLLM = st.builds("INFO 12-01 09:01:54 [loggers.py:335] Engine 000: Avg prompt throughput: {} tokens/s, "
                 "Avg generation throughput: {} tokens/s, Running: {} reqs, Waiting: {} reqs, "
                 "GPU KV cache usage: {}%, Prefix cache hit rate: {}%".format,
                 FIELD, FIELD, FIELD, FIELD, FIELD, FIELD)
CONFIG = st.builds("[2026-01-02 03:04:06] max_total_num_tokens={}, max_running_requests={}".format,
                   FIELD, FIELD)
LINE = st.one_of(SGLANG, VLLM, CONFIG, LINE_TEXT)
SAMPLE_FIELDS = [f.name for f in fields(GpuSample)]
SAMPLE_ROW = st.one_of(
    st.dictionaries(st.sampled_from(SAMPLE_FIELDS), JSON, max_size=6).map(json.dumps),
    st.fixed_dictionaries({"host": JSON, "gpu_index": JSON, "ts_ns": JSON},
                          optional={name: JSON for name in SAMPLE_FIELDS[3:]}).map(json.dumps),
    JSON.map(json.dumps), LINE_TEXT)
SSE_EVENT = st.one_of(JSON.map(json.dumps), st.just("[DONE]"), LINE_TEXT,
                      st.fixed_dictionaries({"choices": JSON, "usage": JSON}).map(json.dumps))
ANSWER = st.one_of(
    JSON.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"choices": JSON, "usage": JSON, "error": JSON}).map(
        lambda v: json.dumps(v).encode()),
    st.lists(SSE_EVENT, max_size=4).map(lambda evs: "".join(f"data: {e}\n\n" for e in evs).encode()),
    st.binary(max_size=40))


@st.composite
def inputs(draw: st.DrawFn) -> dict[str, Any]:
    return {"marks": draw(st.lists(MARK, max_size=4)),
            "lines": draw(st.lists(LINE, max_size=6)), "valid_lines": draw(st.integers(0, 2)),
            "page": draw(st.lists(SAMPLE_ROW, max_size=6)), "valid_samples": draw(st.integers(0, 2)),
            "answer": draw(ANSWER), "stream": draw(st.booleans())}


# -- the collector and the servers it reads -----------------------------------------------------

class ScriptedAgent:
    """A real HTTP server speaking the agent's pull protocol; it serves the pages a test queues, as
    a broken or hostile agent could."""

    def __init__(self) -> None:
        self.pages: list[str] = []
        self.requests = 0

    async def start(self) -> tuple[web.AppRunner, str]:
        app = web.Application()
        app.router.add_get("/v1/samples", self._samples)
        app.router.add_get("/v1/time", self._time)
        app.router.add_get("/v1/info", self._info)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"

    async def _time(self, request: web.Request) -> web.Response:
        return web.json_response({"host": "node0", "time_ns": time.time_ns()})

    async def _info(self, request: web.Request) -> web.Response:
        return web.json_response({"devices": []})

    async def _samples(self, request: web.Request) -> web.Response:
        self.requests += 1
        body = self.pages.pop(0) if self.pages else ""
        return web.Response(text=body, content_type="application/x-ndjson", charset="utf-8",
                            headers={"X-Gputrace-Instance": "scripted"})


@dataclass
class Harness:
    loop: asyncio.AbstractEventLoop
    collector: Collector
    store: Store
    agent: ScriptedAgent
    logs: list[Path]
    openai_url: str
    behaviour: ServerBehaviour
    session: aiohttp.ClientSession
    lines_written: int = 0
    serial: int = 0  # keys the valid records each example adds

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout=30))


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    root = tmp_path_factory.mktemp("properties")
    loop = asyncio.new_event_loop()
    agent = ScriptedAgent()
    agent_runner, agent_url = loop.run_until_complete(agent.start())
    logs = [root / "sglang.log", root / "vllm.log"]
    for log in logs:
        log.touch()
    # each line goes to both logs: an SGLang and a vLLM parser read every one
    cfg = parse_config(f'[[hosts]]\nname = "node0"\nagent = "{agent_url}"\n\n[hosts.log]\nkind = "file"\n'
                       f'path = {json.dumps(str(logs[0]))}\nengine = "sglang"\n\n'
                       f'[[hosts]]\nname = "node1"\n\n[hosts.log]\nkind = "file"\n'
                       f'path = {json.dumps(str(logs[1]))}\nengine = "vllm"\n', root / "gputrace.toml")
    store = Store.create(root / "run")
    collector = Collector(cfg, store, CollectOptions(listen="127.0.0.1:0", agent_poll_s=0.005, flush_s=0.05,
                                                     probe_interval_s=3600, ready_timeout_s=1))
    loop.run_until_complete(collector.start())
    behaviour = ServerBehaviour(token_interval_s=0, ttft_s=0)
    openai_runner, openai_url, _ = loop.run_until_complete(start_server(behaviour))
    session = loop.run_until_complete(_session())
    try:
        yield Harness(loop, collector, store, agent, logs, openai_url, behaviour, session)
    finally:
        loop.run_until_complete(session.close())
        loop.run_until_complete(collector.stop())
        loop.run_until_complete(openai_runner.cleanup())
        loop.run_until_complete(agent_runner.cleanup())
        store.close()
        loop.close()


async def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession()


async def _until(h: Harness, condition: Any, what: str, timeout_s: float = 20.0) -> None:
    def met() -> bool:
        assert h.collector.problems() == [], f"waiting for {what}"  # a source that stopped says why
        return bool(condition())
    await until(met, what, timeout_s)


def _rejected(h: Harness, *record_types: type) -> int:
    return sum(h.collector.writer.rejected.get(t.__name__, 0) for t in record_types)


# -- the property -------------------------------------------------------------------------------

async def _post_marks(h: Harness, marks: list[Any]) -> set[tuple[str, int]]:
    """POST each; the (label, ts_ns) of those accepted. A refused one must be a 400, counted."""
    accepted: set[tuple[str, int]] = set()
    bad_before = h.collector.live.counts["bad_marks"]
    refused = 0
    for mark in marks:
        data = mark if isinstance(mark, bytes) else json.dumps(mark).encode()
        async with h.session.post(f"{h.collector.url}/v1/mark", data=data) as resp:
            assert resp.status in (200, 400), await resp.text()
            if resp.status == 400:
                refused += 1
            else:
                accepted.add((mark["label"], (await resp.json())["ts_ns"]))
    assert h.collector.live.counts["bad_marks"] - bad_before == refused
    return accepted


async def _write_lines(h: Harness, lines: list[str], valid_tokens: list[int]) -> None:
    valid = [f"[2026-01-02 03:04:05 PP0] Decode batch, #running-req: 3, #token: {t}, token usage: 0.25, "
             "cuda graph: True, gen throughput (token/s): 100.00, #queue-req: 0" for t in valid_tokens]
    for log in h.logs:
        with log.open("a", encoding="utf-8") as fh:
            fh.write("".join(line + "\n" for line in [*lines, *valid]))
    h.lines_written += len(h.logs) * (len(lines) + len(valid))
    await _until(h, lambda: h.collector.live.counts["log_lines"] == h.lines_written, "the follower")


async def _serve_page(h: Harness, rows: list[str], valid_ts: list[int]) -> int:
    """Serve one page; returns its lines as the client splits them."""
    valid = [json.dumps({"host": "node0", "gpu_index": 0, "ts_ns": ts, "utilization_ratio": 0.5, "seq": ts})
             for ts in valid_ts]
    body = "\n".join([*rows, *valid])
    served_before = h.agent.requests
    h.agent.pages.append(body)
    # once the collector asks again, it has handled the page
    await _until(h, lambda: h.agent.requests >= served_before + 2 and not h.agent.pages, "the agent client")
    return sum(1 for line in body.split("\n") if line)  # NDJSON: only \n ends a line


async def _run_load(h: Harness, answer: bytes, stream: bool) -> list[str]:
    h.behaviour.raw_answer = answer
    spec = LoadSpec(url=h.openai_url, model="m", concurrency=(1,), max_tokens=4, requests_per_level=2,
                    stream=stream, request_timeout_s=10)
    result = await run_load(spec, on_record=h.collector.add_load_record)
    assert len(result.requests) == 2  # every request ends as a record, whatever the answer
    assert all(r.ok or r.error for r in result.requests)
    return [r.request_id for r in result.requests]


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(example=inputs())
# a form feed inside a line: str.splitlines cuts there, NDJSON does not (CI, stop 31)
@example(example={"marks": [], "lines": [], "valid_lines": 0, "page": ["0\x0c0"], "valid_samples": 0,
                  "answer": b"null", "stream": False})
def test_arbitrary_inputs_keep_the_collector_running_and_are_stored_or_counted(
        harness: Harness, example: dict[str, Any]) -> None:
    """Whatever the marks, lines, pages and answers hold, the collector keeps running; each valid
    record is in the store; every record taken in is stored or counted as rejected; every input
    not taken in is counted (a 400 mark, an unrecognised line, a bad sample line)."""
    h = harness
    counts = h.collector.live.counts
    before = dict(counts)
    h.serial += 1
    keys = [h.serial * 10 + i for i in range(2)]
    valid_tokens = [10**12 + k for k in keys[:example["valid_lines"]]]
    valid_ts = [10**15 + k for k in keys[:example["valid_samples"]]]

    accepted = h.run(_post_marks(h, example["marks"]))
    h.run(_write_lines(h, example["lines"], valid_tokens))
    served = h.run(_serve_page(h, example["page"], valid_ts))
    request_ids = h.run(_run_load(h, example["answer"], example["stream"]))
    assert h.collector.writer.flush()

    assert h.collector.problems() == [], "a source stopped or the store failed"
    # log lines: each is unrecognised, or a record stored or rejected
    records = (counts["log_lines"] - before["log_lines"]) - (counts["unrecognised_lines"]
                                                             - before["unrecognised_lines"])
    assert records >= len(valid_tokens)
    stored_tokens = {t for (t,) in h.store.sql("SELECT num_token FROM scheduler_events")}
    assert set(valid_tokens) <= stored_tokens
    total_records = h.store.count(RECORD_TABLES[SchedulerEvent]) + h.store.count(RECORD_TABLES[EngineConfig])
    assert total_records + _rejected(h, SchedulerEvent, EngineConfig) == counts["log_lines"] - counts[
        "unrecognised_lines"]
    # agent pages: each line is a sample (stored or rejected) or a counted bad line
    samples = counts["gpu_samples"] - before["gpu_samples"]
    assert samples + counts["bad_sample_lines"] - before["bad_sample_lines"] == served
    assert h.store.count("gpu_samples") + _rejected(h, GpuSample) == counts["gpu_samples"]
    stored_ts = {t for (t,) in h.store.sql("SELECT ts_ns FROM gpu_samples WHERE ts_ns >= ?", [10**15])}
    assert set(valid_ts) <= stored_ts
    # marks and the load's records
    markers = set(h.store.sql("SELECT label, ts_ns FROM markers"))
    assert accepted <= markers
    stored_ids = {i for (i,) in h.store.sql("SELECT request_id FROM requests")}
    rejected_requests = h.collector.writer.rejected.get("RequestRecord", 0)
    assert len(set(request_ids) - stored_ids) <= rejected_requests
    assert counts["requests"] == h.store.count("requests") + rejected_requests
