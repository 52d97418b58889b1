"""The engine's running total reconstructed from one rank's lines (gputrace.analysis.schedule):
the sum over one cycle of the micro-batch slots, and what decides when equal sizes cannot tell."""

from __future__ import annotations

import numpy as np

from gputrace.analysis.schedule import engine_totals, line_sizes, shortest_periods

NAN = float("nan")


def _totals(sizes: list[float], queue: float = 0.0, busy: float = NAN, pp: int = 8, k: int | None = 8,
            pool: int | None = 64):  # type: ignore[no-untyped-def]
    x = np.array(sizes, dtype=float)
    return engine_totals(x, np.full(len(x), queue), np.full(len(x), busy), pp, pp, k, pool)


def test_a_repeating_cycle_is_summed_once() -> None:
    """Sizes 7, 1, 7, 1 (two micro-batches): the total is 8 once the cycle is seen, from the period."""
    t = _totals([7, 1] * 10, pp=2, k=16, pool=8)
    assert t.running[-1] == 8 and t.microbatches[-1] == 2 and t.source[-1] == "period"


def test_four_uneven_slots() -> None:
    """3, 2, 2, 1 repeating: a period of 4, a total of 8 (neither one micro-batch nor 8 x 3)."""
    t = _totals([3, 2, 2, 1] * 6)
    assert t.running[-1] == 8 and t.microbatches[-1] == 4


def test_equal_sizes_with_a_queue_mean_every_slot_full() -> None:
    """All lines say 2 with requests waiting: every slot holds K (a slot with room admits at its
    turn), so the engine runs min(pool, K x slots) = 16."""
    t = _totals([2] * 30, queue=16, k=2)
    assert t.running[-1] == 16 and t.source[-1] == "queue"


def test_equal_sizes_without_a_queue_take_the_compute_share() -> None:
    """All lines say 2, nothing waits, each stage computes half the time: 4 micro-batches of 2 for
    8 stages, 8 running; without the compute share the period gives only a lower bound (2)."""
    t = _totals([2] * 30, busy=0.5, k=2)
    assert t.running[-1] == 8 and t.source[-1] == "busy"
    bare = _totals([2] * 30, k=2)
    assert bare.running[-1] == 2 and bare.source[-1] == "lower bound"


def test_prefill_lines_count_the_admitted() -> None:
    """A prefill line's micro-batch after its step: the requests that waited in the slot plus the
    new ones."""
    kinds = np.array(["decode", "prefill", "decode"], dtype=object)
    sizes = line_sizes(kinds, np.array([4.0, 1.0, 5.0]), np.array([NAN, 3.0, NAN]))
    assert list(sizes) == [4.0, 4.0, 5.0]


def test_shortest_period_prefers_the_first_of_equal_ones() -> None:
    """A cycle of 3 also repeats at 6: the shortest is taken."""
    m, tied = shortest_periods(np.array([5.0, 1.0, 2.0] * 5), 8, 16)
    assert m[-1] == 3 and not tied[-1]
