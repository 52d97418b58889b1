"""[prefill] Must show 3: a phase's tok/s from the engine's own token counter (vLLM's
vllm:generation_tokens_total, scraped about every 1-2 s), and where its two edge intervals fall."""

from __future__ import annotations

import numpy as np
import pytest

from gputrace.analysis.engine_metrics import MetricSeries, counter_tokens

S = 1_000_000_000


def _ramp_run() -> tuple[MetricSeries, dict[str, np.ndarray]]:
    """A level of 10 s from t=10 s: for its first 2 s the engine generates 10 tok/s (its requests'
    prompts going in), then 100 tok/s; before it, 100 tok/s too (a level that ends as the next
    one's prompts go in). Per second of the run one client request whose tokens come out evenly
    over that second, as many as the engine generated then. Scrapes every 1.5 s, from 0.7 s."""
    def rate(t_s: float) -> float:
        return 10.0 if 10 <= t_s < 12 else 100.0

    seconds = np.arange(0, 25)
    tokens = np.array([rate(float(s)) for s in seconds])
    requests = {"first_token_ns": (seconds * S).astype(np.float64),
                "end_ns": ((seconds + 1) * S).astype(np.float64) - 1.0,
                "completion_tokens": tokens + 1.0}  # the first token at first_token_ns, the rest spread
    scrapes = np.arange(0.7, 24.0, 1.5)
    cumulative = np.array([sum(rate(float(s)) * min(max(t - s, 0.0), 1.0) for s in seconds) for t in scrapes])
    # each request's first token is counted at its start, as the client's records place it
    cumulative += np.array([float((seconds <= t).sum()) for t in scrapes])
    series = MetricSeries("vllm:generation_tokens_total", {}, (scrapes * S).astype(np.int64), cumulative)
    return series, requests


def test_an_edge_interval_is_placed_as_the_clients_requests_emitted_their_tokens() -> None:
    """The level's first 2 s run at half its rate. The interval that straddles its start, given
    the rate of the interval after it, puts the ramp's seconds at the full rate and reads the
    level high; split as the client's requests emitted their tokens, the count is the engine's
    and the level reads its true tokens."""
    series, requests = _ramp_run()
    start, end = 10 * S, 20 * S
    truth = 2 * 10.0 + 8 * 100.0 + 10  # the tokens and the ten first tokens of the level's seconds
    without = counter_tokens(series, start, end)
    with_client = counter_tokens(series, start, end, requests=requests)
    assert without is not None and with_client is not None
    assert without > truth * 1.015  # the rate after the edge, over the ramp
    assert with_client == pytest.approx(truth, rel=0.005)


def test_without_a_client_token_in_an_edge_interval_the_rates_place_it() -> None:
    """An edge interval in which the client emitted nothing (a load the run did not record) cannot
    be split by the client: the rates of the neighbouring intervals place it, as without records."""
    series, requests = _ramp_run()
    late = {k: v[12:] for k, v in requests.items()}  # the client's records begin at 12 s
    start, end = 10 * S, 20 * S
    assert counter_tokens(series, start, end, requests=late) == counter_tokens(series, start, end)
