"""A closed-loop load generator for OpenAI-compatible chat endpoints (SGLang, vLLM, the simulator):
per level it keeps exactly C requests in flight and records every request and phase marker."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, Unpack

import aiohttp
import numpy as np

from gputrace.config import LoadConfig, concurrency_problem
from gputrace.errors import ConfigError, SourceError, UsageError
from gputrace.json_types import JsonObject, JsonValue
from gputrace.load.stats import LevelStats, level_stats
from gputrace.logsetup import get_logger
from gputrace.model import ABANDONED_PREFIX, Marker, RequestRecord, is_abandoned

log = get_logger("load")

DEFAULT_PROMPTS: tuple[str, ...] = (
    "Explain how pipeline parallelism splits a transformer across GPUs.",
    "Write a short story about a lighthouse keeper who collects clocks.",
    "List the trade-offs between tensor parallelism and pipeline parallelism.",
    "Summarise the history of the printing press in a few paragraphs.",
    "Describe what a KV cache is and why it limits batch size.",
    "Write a poem about a train crossing a frozen lake at night.",
)
CHAT_PATH = "/v1/chat/completions"
_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream, application/json"}
_LAG_INTERVAL_S = 0.05
_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 1.0

RecordSink = Callable[[RequestRecord | Marker], None]
_ERROR_CHARS = 300
# What parsing a hostile answer can raise beyond ValueError (deep nesting, a JSON type where
# another belongs): the request fails with it; the worker goes on (it died and the run hung).
_MALFORMED = (RecursionError, TypeError, AttributeError, KeyError, IndexError)


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """What to run. Exactly one of ``requests_per_level`` / ``duration_per_level_s`` may be set;
    with neither, each level issues ``4 * C`` requests."""

    url: str
    model: str
    concurrency: tuple[int, ...]
    max_tokens: int = 512
    requests_per_level: int | None = None
    duration_per_level_s: float | None = None
    warmup_s: float = 0.0
    prompts: tuple[Any, ...] = DEFAULT_PROMPTS  # str (a user message) or a list of chat messages
    temperature: float = 0.0
    stream: bool = True
    ignore_eos: bool = False
    # each level sends its C requests at once and ends when the last is back (no replacements)
    burst: bool = False
    mark_url: str | None = None
    host: str = field(default_factory=socket.gethostname)
    request_timeout_s: float = 600.0
    drain_s: float | None = None  # after the last level, cancel requests still running after this

    def __post_init__(self) -> None:
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise UsageError(f"concurrency levels must be positive integers, got {self.concurrency}")
        for level in self.concurrency:
            if (problem := concurrency_problem(level)) is not None:
                raise UsageError(f"--concurrency: {problem}")
        if self.requests_per_level is not None and self.duration_per_level_s is not None:
            raise UsageError("give --requests-per-level or --duration-per-level, not both")
        if self.requests_per_level is not None and self.requests_per_level < 1:
            raise UsageError("--requests-per-level must be at least 1")
        if self.duration_per_level_s is not None and self.duration_per_level_s <= 0:
            raise UsageError("--duration-per-level must be positive")
        if self.max_tokens < 1:
            raise UsageError("--max-tokens must be at least 1")
        if self.warmup_s < 0:
            raise UsageError("--warmup must not be negative")
        if not self.url.startswith(("http://", "https://")):
            raise UsageError(f"--url must start with http:// or https://, got {self.url!r}")
        if not self.prompts:
            raise UsageError("no prompts to send")
        if self.burst and (self.requests_per_level is not None or self.duration_per_level_s is not None
                           or self.warmup_s > 0):
            raise UsageError("--burst sends C requests per level and ends the level when they are back: "
                             "drop --requests-per-level, --duration-per-level and --warmup")

    @property
    def endpoint(self) -> str:
        base = self.url.rstrip("/")
        if base.endswith("/chat/completions"):
            return base
        if base.endswith("/v1"):
            return base + "/chat/completions"
        return base + CHAT_PATH


def load_prompts(path: str | os.PathLike[str]) -> tuple[Any, ...]:
    """Prompts from a JSONL file: one object per line with ``prompt`` (text) or ``messages`` (chat)."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read prompts: {exc.strerror}") from exc
    prompts: list[Any] = []
    bad = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(obj, dict) and isinstance(obj.get("messages"), list):
            prompts.append(obj["messages"])
        elif isinstance(obj, dict) and isinstance(obj.get("prompt") or obj.get("text"), str):
            prompts.append(obj.get("prompt") or obj.get("text"))
        else:
            bad += 1
    if bad:
        log.warning("prompts skipped", file=str(p), bad_lines=bad)
    if not prompts:
        raise ConfigError(f"{p}: no prompts (each line needs a JSON object with 'prompt' or 'messages')")
    return tuple(prompts)


class LoadSpecFields(TypedDict, total=False):
    """Fields of a LoadSpec by name: what ``spec_from_config`` sets over the ``[load]`` table."""

    url: str
    model: str
    concurrency: tuple[int, ...]
    max_tokens: int
    requests_per_level: int | None
    duration_per_level_s: float | None
    warmup_s: float
    prompts: tuple[Any, ...]
    temperature: float
    stream: bool
    ignore_eos: bool
    burst: bool
    mark_url: str | None
    host: str
    request_timeout_s: float
    drain_s: float | None


def spec_from_config(load: LoadConfig, **overrides: Unpack[LoadSpecFields]) -> LoadSpec:
    """A LoadSpec from gputrace.toml's ``[load]`` table; ``overrides`` (e.g. mark_url) win."""
    fields: LoadSpecFields = {
        "url": load.url,
        "model": load.model,
        "concurrency": tuple(load.concurrency),
        "max_tokens": load.max_tokens,
        "requests_per_level": load.requests_per_level,
        "duration_per_level_s": load.duration_per_level_s,
        "temperature": load.temperature,
        "stream": load.stream,
        "ignore_eos": load.ignore_eos,
        "burst": load.burst,
    }
    if load.prompts_file:
        fields["prompts"] = load_prompts(load.prompts_file)
    fields.update(overrides)
    return LoadSpec(**fields)


def _payloads(spec: LoadSpec) -> list[bytes]:
    """Request bodies encoded once, so the hot loop sends bytes."""
    out = []
    for prompt in spec.prompts:
        messages: JsonValue = prompt if isinstance(prompt, list) else \
            [{"role": "user", "content": str(prompt)}]
        body: JsonObject = {
            "model": spec.model,
            "messages": messages,
            "max_tokens": spec.max_tokens,
            "temperature": spec.temperature,
            "stream": spec.stream,
        }
        if spec.stream:
            body["stream_options"] = {"include_usage": True}
        if spec.ignore_eos:
            body["ignore_eos"] = True
        out.append(json.dumps(body).encode())
    return out


@dataclass(slots=True)
class _Level:
    label: str
    concurrency: int
    n_requests: int | None
    duration_s: float | None
    issued: int = 0
    ended: int = 0  # requests of this level that have their record (burst levels end at n)


@dataclass(frozen=True, slots=True)
class LoadResult:
    """Everything one run produced: records for the store, and the per-level figures."""

    requests: list[RequestRecord]
    markers: list[Marker]
    levels: list[LevelStats]
    wall_s: float
    cpu_s: float  # this process's CPU seconds during the run
    malformed: dict[str, int] = field(default_factory=dict)  # answer fields that were not what the
    # protocol says (read as not available), with how many answers had each

    @property
    def abandoned(self) -> int:
        """Requests still running when the drain time ran out (neither completed nor failed)."""
        return sum(1 for r in self.requests if is_abandoned(r.error))

    def records(self) -> list[RequestRecord | Marker]:
        """Markers and requests in time order (for ``write_jsonl`` or a store)."""
        both: list[RequestRecord | Marker] = [*self.markers, *self.requests]
        return sorted(both, key=lambda r: r.ts_ns if isinstance(r, Marker) else r.start_ns)

    @property
    def short_levels(self) -> list[LevelStats]:
        return [lv for lv in self.levels if lv.short and lv.label != "warmup"]


class LoadGenerator:
    """Runs one sweep. ``inflight``, ``target_concurrency`` and ``phase`` can be read live (a
    collector exports them); ``on_record`` receives every record as it is produced."""

    def __init__(self, spec: LoadSpec, on_record: RecordSink | None = None, *,
                 clock_ns: Callable[[], int] = time.time_ns,
                 monotonic_s: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.on_record = on_record
        self.clock_ns = clock_ns  # epoch ns: the records' and markers' times
        self.monotonic_s = monotonic_s  # level durations, the run's wall time, the loop's lag
        self.inflight = 0
        self.target_concurrency = 0
        self.phase: str | None = None
        self.completed = 0
        self.failed = 0
        self.abandoned = 0
        self.malformed: Counter[str] = Counter()  # answer fields not as the protocol says
        self._payloads = _payloads(spec)
        self._levels = self._plan()
        self._level_idx = -1
        self._level_started = 0.0
        self._finished = False
        self._abort: Exception | None = None
        self._workers: dict[int, asyncio.Task[None]] = {}
        self._done = asyncio.Event()
        self._records: list[RequestRecord] = []
        self._markers: list[Marker] = []
        self._posts: list[asyncio.Task[None]] = []
        self._lag_ts: list[int] = []
        self._lag_s: list[float] = []
        self._seq = 0
        self._ever_ok = False
        self._connect_failures = 0
        self._timer: asyncio.TimerHandle | None = None
        self._run_id = secrets.token_hex(3)
        self._session: aiohttp.ClientSession | None = None

    def _plan(self) -> list[_Level]:
        spec = self.spec
        levels = []
        if spec.warmup_s > 0:
            levels.append(_Level("warmup", spec.concurrency[0], None, spec.warmup_s))
        for c in spec.concurrency:
            n = spec.requests_per_level
            if spec.burst:
                n = c
            elif n is None and spec.duration_per_level_s is None:
                n = 4 * c
            levels.append(_Level(f"C={c}", c, n, spec.duration_per_level_s))
        return levels

    # -- progress (read by the console) -------------------------------------------------------

    @property
    def level(self) -> _Level | None:
        return self._levels[self._level_idx] if 0 <= self._level_idx < len(self._levels) else None

    def level_progress(self) -> tuple[float, float]:
        """(done, total) of the current level, in requests issued or seconds elapsed."""
        lv = self.level
        if lv is None:
            return 0.0, 1.0
        if lv.n_requests is not None:
            return float(lv.issued), float(lv.n_requests)
        return min(self.monotonic_s() - self._level_started, lv.duration_s or 0.0), float(lv.duration_s or 1)

    @property
    def level_labels(self) -> list[str]:
        return [lv.label for lv in self._levels]

    # -- the run -------------------------------------------------------------------------------

    async def run(self) -> LoadResult:
        wall0, cpu0 = self.monotonic_s(), time.process_time()
        max_c = max(self.spec.concurrency)
        # The connector must never be the hidden cap on concurrency; a few spare for marker posts.
        # A connection per request (as SGLang's bench_serving, a session per request): on a busy CPU
        # vLLM 0.32's server dropped 11 of 126 requests sent on a kept-alive connection
        # (ServerDisconnectedError; a 3 s client keep-alive did not help) and none of 117 on fresh ones.
        connector = aiohttp.TCPConnector(limit=max_c + 8, limit_per_host=0, ttl_dns_cache=300,
                                         force_close=True)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=self.spec.request_timeout_s)
        lag_task: asyncio.Task[None] | None = None
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as s:
            self._session = s
            try:
                lag_task = asyncio.create_task(self._watch_loop_lag())
                self._start_level(0)
                await self._done.wait()
                if self._posts:
                    await asyncio.gather(*self._posts, return_exceptions=True)
            finally:
                if self._timer is not None:
                    self._timer.cancel()
                if lag_task is not None:
                    lag_task.cancel()
                for task in list(self._workers.values()):
                    task.cancel()
                if self._workers:
                    await asyncio.gather(*self._workers.values(), return_exceptions=True)
        if self._abort is not None:
            raise self._abort
        lag = (np.array(self._lag_ts, dtype=np.int64), np.array(self._lag_s, dtype=np.float64))
        requests = sorted(self._records, key=lambda r: r.start_ns)
        levels = level_stats(requests, self._markers, lag)
        for lv in levels:
            if lv.short and lv.label != "warmup":
                log.warning(
                    "client kept fewer requests in flight than asked",
                    level=lv.label,
                    target=lv.target_concurrency,
                    inflight_mean=round(lv.inflight_mean or 0.0, 2),
                    inflight_min=lv.inflight_min,
                    failed=lv.failed,
                )
        return LoadResult(
            requests=requests,
            markers=list(self._markers),
            levels=levels,
            wall_s=self.monotonic_s() - wall0,
            cpu_s=time.process_time() - cpu0,
            malformed=dict(self.malformed),
        )

    def _start_level(self, idx: int) -> None:
        self._level_idx = idx
        lv = self._levels[idx]
        self._level_started = self.monotonic_s()
        self.phase = lv.label
        self.target_concurrency = lv.concurrency
        self._emit_marker(lv.label, "phase", lv.concurrency)
        if self.spec.burst:
            for slot in range(lv.concurrency):
                self._workers[slot] = asyncio.create_task(self._burst_request(slot, idx))
            return
        for slot in range(lv.concurrency):
            if slot not in self._workers:
                self._workers[slot] = asyncio.create_task(self._worker(slot))
        if lv.duration_s is not None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(lv.duration_s, self._advance, idx)

    def _advance(self, from_idx: int) -> None:
        """End level ``from_idx``: start the next, or stop issuing and let the last requests finish."""
        if from_idx != self._level_idx or self._finished:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if from_idx + 1 < len(self._levels):
            self._start_level(from_idx + 1)
        else:
            self._finish()

    def _finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        self.target_concurrency = 0
        self.phase = None
        self._emit_marker("end", "end", None)
        if not self._workers:
            self._done.set()
        elif self.spec.drain_s is not None:
            asyncio.get_running_loop().call_later(self.spec.drain_s, self._cancel_workers)

    def _cancel_workers(self) -> None:
        """The drain time is up: requests still running after the last level are abandoned."""
        if self._workers:
            log.info("load_requests_abandoned", count=len(self._workers))
        for task in list(self._workers.values()):
            task.cancel()

    def _next_phase(self, slot: int) -> str | None:
        """The phase label of the slot's next request, or None when the slot should stop."""
        while True:
            lv = self.level
            if self._finished or lv is None or slot >= lv.concurrency:
                return None
            if lv.n_requests is not None and lv.issued >= lv.n_requests:
                self._advance(self._level_idx)
                continue
            lv.issued += 1
            return lv.label

    async def _burst_request(self, slot: int, idx: int) -> None:
        """One request of burst level ``idx``; the last of them to end starts the next level."""
        lv = self._levels[idx]
        lv.issued += 1
        seq = self._seq
        self._seq += 1
        try:
            record = await self._request(self._payloads[seq % len(self._payloads)], lv.label, seq)
            self._records.append(record)
            self._deliver(record)
            if record.ok:
                self.completed += 1
            elif is_abandoned(record.error):
                self.abandoned += 1
            else:
                self.failed += 1
        finally:
            self._workers.pop(slot, None)
            lv.ended += 1
            if lv.ended >= lv.concurrency:
                self._advance(idx)
            if self._finished and not self._workers:
                self._done.set()

    async def _worker(self, slot: int) -> None:
        backoff = 0.0
        try:
            while True:
                phase = self._next_phase(slot)
                if phase is None:
                    return
                seq = self._seq
                self._seq += 1
                record = await self._request(self._payloads[seq % len(self._payloads)], phase, seq)
                self._records.append(record)
                self._deliver(record)
                if record.ok:
                    self.completed += 1
                    backoff = 0.0
                    continue
                if is_abandoned(record.error):
                    self.abandoned += 1
                    return
                self.failed += 1
                # Back off after a failure so a refusing server is not hammered; the gap shows as
                # fewer requests in flight, which is what the level's figures must then report.
                backoff = min(max(backoff * 2, _BACKOFF_MIN_S), _BACKOFF_MAX_S)
                await asyncio.sleep(backoff)
        finally:
            self._workers.pop(slot, None)
            if self._finished and not self._workers:
                self._done.set()

    async def _request(self, payload: bytes, phase: str, seq: int) -> RequestRecord:
        assert self._session is not None
        first_ns: int | None = None
        prompt_tokens: int | None = None
        completion_tokens: int | None = None
        error: str | None = None
        self.inflight += 1
        start_ns = self.clock_ns()
        try:
            async with self._session.post(self.spec.endpoint, data=payload, headers=_HEADERS) as resp:
                if resp.status != 200:
                    body = await resp.read()
                    error = f"HTTP {resp.status}: {body[:200].decode(errors='replace').strip()}"
                elif self.spec.stream:
                    first_ns, prompt_tokens, completion_tokens, error = await _read_sse(resp, self.malformed,
                                                                                    self.clock_ns)
                else:
                    prompt_tokens, completion_tokens, error = _parse_completion(await resp.read(),
                                                                                self.malformed)
        except asyncio.CancelledError:
            if not self._finished:
                raise
            # only the drain timer cancels a request after the last level: record it, then stop
            error = f"{ABANDONED_PREFIX} still running when the drain time after the last level ran out"
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}".strip()
            if isinstance(exc, aiohttp.ClientConnectorError):
                self._note_connect_failure(exc)
        except _MALFORMED as exc:
            error = f"malformed answer: {type(exc).__name__}: {exc}"
        except Exception as exc:  # every request ends as a record, whatever went wrong in between
            log.exception("load_request_client_error", request=seq)
            error = f"client error: {type(exc).__name__}: {exc}"
        finally:
            end_ns = self.clock_ns()
            self.inflight -= 1
        if error is None:
            self._ever_ok = True
        return RequestRecord(
            host=self.spec.host,
            request_id=f"{self._run_id}-{seq}",
            start_ns=start_ns,
            first_token_ns=first_ns,
            end_ns=end_ns,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            ok=error is None,
            error=None if error is None else printable(error),
            phase=phase,
        )

    def _deliver(self, record: RequestRecord | Marker) -> None:
        """Hand a record to ``on_record``; if that fails the run stops and ``run`` raises it (a
        sink that silently lost records, or a slot that silently died, would be worse)."""
        if self.on_record is None or self._abort is not None:
            return
        try:
            self.on_record(record)
        except Exception as exc:
            self._abort = exc
            self._finish()

    def _note_connect_failure(self, exc: Exception) -> None:
        """Nothing has ever answered: stop early with one clear line instead of a table of failures."""
        if self._ever_ok:
            return
        self._connect_failures += 1
        if self._connect_failures >= max(8, self.target_concurrency) and self._abort is None:
            self._abort = SourceError(f"{self.spec.endpoint}: cannot connect: {exc}")
            self._finish()

    def _emit_marker(self, label: str, kind: str, target: int | None) -> None:
        marker = Marker(
            host=self.spec.host, ts_ns=self.clock_ns(), label=label, kind=kind, target_concurrency=target
        )
        self._markers.append(marker)
        self._deliver(marker)
        if self.spec.mark_url:
            self._posts.append(asyncio.create_task(self._post_marker(marker)))

    async def _post_marker(self, marker: Marker) -> None:
        assert self._session is not None and self.spec.mark_url is not None
        body = {
            "label": marker.label,
            "kind": marker.kind,
            "target_concurrency": marker.target_concurrency,
            "ts_ns": marker.ts_ns,
        }
        try:
            async with self._session.post(
                self.spec.mark_url, json=body, timeout=aiohttp.ClientTimeout(total=5)
            ) as resp:
                if resp.status >= 300:
                    log.warning("marker_rejected", url=self.spec.mark_url, status=resp.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("marker post failed", url=self.spec.mark_url, error=f"{type(exc).__name__}: {exc}")

    async def _watch_loop_lag(self) -> None:
        """Samples how late the event loop wakes up: a busy client shows here before anywhere else."""
        while True:
            t0 = self.monotonic_s()
            await asyncio.sleep(_LAG_INTERVAL_S)
            self._lag_s.append(max(self.monotonic_s() - t0 - _LAG_INTERVAL_S, 0.0))
            self._lag_ts.append(self.clock_ns())


def printable(text: str) -> str:
    """An error text from a server, safe to print and store: a lone surrogate from its JSON stopped
    the summary (UnicodeEncodeError) and cannot be stored; cut to a few lines' length."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")[:_ERROR_CHARS]


def _note(malformed: Counter[str] | None, what: str) -> None:
    if malformed is not None:
        malformed[what] += 1


async def _read_sse(resp: aiohttp.ClientResponse, malformed: Counter[str] | None = None,
                    clock_ns: Callable[[], int] = time.time_ns
                    ) -> tuple[int | None, int | None, int | None, str | None]:
    """Reads an SSE chat stream: (first token ns, prompt tokens, completion tokens, error). Fields
    not as the protocol says are read as not available and counted in ``malformed``, once per
    answer."""
    odd: Counter[str] = Counter()
    try:
        return await _read_sse_events(resp, odd, clock_ns)
    finally:
        if malformed is not None:
            malformed.update(odd.keys())


async def _read_sse_events(resp: aiohttp.ClientResponse, malformed: Counter[str], clock_ns: Callable[[], int]
                           ) -> tuple[int | None, int | None, int | None, str | None]:
    first_ns: int | None = None
    prompt_tokens: int | None = None
    usage_completion: int | None = None
    counted = 0
    error: str | None = None
    done = False
    tail = b""
    async for chunk in resp.content.iter_any():
        now = clock_ns()
        lines = (tail + chunk).split(b"\n")
        tail = lines.pop()
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                continue
            if not data:
                continue
            event = json.loads(data)
            if not isinstance(event, dict):
                continue
            if "error" in event:
                err = event["error"]
                error = str(err.get("message", err) if isinstance(err, dict) else err)[:200]
                continue
            choices = event.get("choices")
            if choices and isinstance(choices, list) and isinstance(choices[0], dict):
                delta = choices[0].get("delta")
                delta = delta if isinstance(delta, dict) else {}
                if delta.get("content") or delta.get("reasoning_content"):
                    counted += 1
                    if first_ns is None:
                        first_ns = now
            elif choices:
                _note(malformed, "choices[0] not an object")
            usage = event.get("usage")
            if usage and isinstance(usage, dict):
                prompt_tokens = _usage_count(usage, "prompt_tokens", malformed)
                usage_completion = _usage_count(usage, "completion_tokens", malformed)
    if not done and error is None:
        # The server closed the stream early (crashed, restarted): the request did not complete.
        error = f"stream ended before 'data: [DONE]' after {counted} chunks"
    completion = usage_completion if usage_completion is not None else counted
    return first_ns, prompt_tokens, completion, error


def _parse_completion(body: bytes, malformed: Counter[str] | None = None
                      ) -> tuple[int | None, int | None, str | None]:
    """A non-streaming response: (prompt tokens, completion tokens, error)."""
    obj = json.loads(body)
    if not isinstance(obj, dict):
        return None, None, "response is not a JSON object"
    if "error" in obj:
        err = obj["error"]
        return None, None, str(err.get("message", err) if isinstance(err, dict) else err)[:200]
    usage = obj.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    completion = _usage_count(usage, "completion_tokens", malformed)
    choices = obj.get("choices")
    first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    if choices and not first:
        _note(malformed, "choices[0] not an object")
    if completion is None:
        # No usage block: estimate from the text (whitespace words); better than nothing.
        message = first.get("message")
        text = message.get("content") if isinstance(message, dict) else None
        completion = len(text.split()) if isinstance(text, str) else 0
    return _usage_count(usage, "prompt_tokens", malformed), completion, None


def _usage_count(usage: JsonObject, key: str, malformed: Counter[str] | None) -> int | None:
    value = usage.get(key)
    count = token_count(value)
    if count is None and value is not None:
        _note(malformed, f"usage.{key} not a token count")
    return count


def token_count(value: object) -> int | None:
    """A server's token count, or None when it is not one (a string, a bool, past any real count:
    such values reached the store and stopped its writer)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**53:
        return None
    return value


async def run_load(spec: LoadSpec, on_record: RecordSink | None = None) -> LoadResult:
    """Run a sweep and return its records and per-level figures (records also go to ``on_record``
    as they are produced, so a collector can store them while the run goes on)."""
    return await LoadGenerator(spec, on_record).run()

