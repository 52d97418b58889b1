"""Back-off delays: exponential up to a cap, jittered by the random source it is given."""

from __future__ import annotations

import random

from gputrace.backoff import Backoff


def test_a_seeded_source_replays_the_same_delays() -> None:
    """Two back-offs on equally seeded sources give the same delays; each within its jitter band."""
    first = Backoff(initial_s=0.5, max_s=4.0, rng=random.Random(7))
    second = Backoff(initial_s=0.5, max_s=4.0, rng=random.Random(7))
    delays = [first.delay_s(n) for n in range(8)]
    assert delays == [second.delay_s(n) for n in range(8)]
    for n, delay in enumerate(delays):
        nominal = min(4.0, 0.5 * 2.0**n)
        assert 0.5 * nominal <= delay <= nominal


def test_without_jitter_the_delay_is_the_nominal_one() -> None:
    """jitter=0: 0.2, 0.4, 0.8 ... capped at max_s, huge attempt numbers included."""
    backoff = Backoff(jitter=0.0)
    assert [backoff.delay_s(n) for n in range(4)] == [0.2, 0.4, 0.8, 1.6]
    assert backoff.delay_s(10_000) == 30.0
