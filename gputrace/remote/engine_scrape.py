"""The engine's own Prometheus endpoint (SGLang ``--enable-metrics``, vLLM ``/metrics``) as a
collector source: scraped about once a second, parsed with prometheus_client's text parser, the
series the diagnosis can use kept with their labels as EngineMetricSample records. The only module
that talks to an engine's metrics endpoint.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp

from gputrace.backoff import Backoff
from gputrace.errors import SourceError
from gputrace.exposition import parse_text
from gputrace.logsetup import get_logger
from gputrace.model import EngineMetricSample

log = get_logger("engines.metrics")
RETRY = Backoff(initial_s=1.0, max_s=30.0)

# Gauges and counters kept by sample name; histograms (latencies) by their _sum and _count only:
# the buckets multiply the rows twenty-fold and the means are what the report compares.
KEPT_SAMPLES = frozenset({
    "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:gen_throughput",
    "sglang:cache_hit_rate", "sglang:fwd_occupancy", "sglang:forward_execution_seconds_total",
    # the scheduler loop's wall time per pp_rank by category (0.5.23+): run_batch is the forward
    "sglang:scheduler_stage_seconds_total", "sglang:scheduler_idle_seconds_total",
    "sglang:realtime_tokens_total", "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "vllm:generation_tokens_total", "vllm:prompt_tokens_total",
    "vllm:iteration_tokens_total_sum", "vllm:iteration_tokens_total_count",
})
KEPT_HISTOGRAMS = frozenset({
    "sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
    "sglang:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds", "vllm:iteration_tokens_total", "vllm:request_prompt_tokens",
})


def kept(sample_name: str) -> bool:
    """Whether a sample of this name is stored."""
    if sample_name in KEPT_SAMPLES:
        return True
    base, _, suffix = sample_name.rpartition("_")
    return suffix in ("sum", "count") and base in KEPT_HISTOGRAMS


def parse_metrics_text(text: str, host: str, source: str, ts_ns: int) -> list[EngineMetricSample]:
    """The kept samples of one scrape; raises ValueError for text that is not the exposition format."""
    out = []
    for family in parse_text(text):
        for s in family.samples:
            if kept(s.name):
                out.append(EngineMetricSample(host, source, ts_ns, s.name,
                                              json.dumps(s.labels, sort_keys=True), float(s.value)))
    return out


@dataclass(frozen=True, slots=True)
class MetricsEndpoint:
    """Where and how to scrape: the URL the collector reaches (after any port forward)."""

    url: str
    token: str | None = None
    interval_s: float = 1.0
    timeout_s: float = 5.0


@dataclass(slots=True)
class ScrapeStats:
    scrapes: int = 0
    failures: int = 0
    unparsable: int = 0


async def follow_metrics(endpoint: MetricsEndpoint, host: str, source: str, stats: ScrapeStats,
                         on_problem: Callable[[str | None], None] | None = None,
                         backoff: Backoff = RETRY
                         ) -> AsyncIterator[list[EngineMetricSample]]:
    """Each scrape's kept samples, about every ``interval_s``; an endpoint that fails or answers
    something else is retried with back-off and reported through ``on_problem`` (None: fine again)."""
    headers = {"Authorization": f"Bearer {endpoint.token}"} if endpoint.token else {}
    timeout = aiohttp.ClientTimeout(total=endpoint.timeout_s)
    attempt = 0
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        while True:
            started = time.monotonic()
            try:
                batch = await _scrape(session, endpoint.url, host, source)
            except SourceError as exc:
                stats.failures += 1
                if "not the Prometheus text format" in str(exc):
                    stats.unparsable += 1
                if on_problem is not None:
                    on_problem(str(exc))
                if attempt == 0:
                    log.warning("engine_metrics_unavailable", url=endpoint.url, error=str(exc))
                await asyncio.sleep(max(endpoint.interval_s, backoff.delay_s(attempt)))
                attempt += 1
                continue
            attempt = 0
            stats.scrapes += 1
            if on_problem is not None:
                on_problem(None)
            yield batch
            await asyncio.sleep(max(0.0, endpoint.interval_s - (time.monotonic() - started)))


async def _scrape(session: aiohttp.ClientSession, url: str, host: str, source: str
                  ) -> list[EngineMetricSample]:
    try:
        async with session.get(url) as resp:
            if resp.status != 200:
                raise SourceError(f"engine metrics {url}: HTTP {resp.status}")
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError) as exc:
        raise SourceError(f"engine metrics {url}: {type(exc).__name__}: {exc}") from exc
    try:
        return parse_metrics_text(text, host, source, time.time_ns())
    except (ValueError, TypeError, IndexError) as exc:  # what the text parser raises on bad input
        raise SourceError(f"engine metrics {url}: not the Prometheus text format ({exc})") from exc
