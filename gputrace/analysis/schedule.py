"""The engine's running total reconstructed from one PP rank's scheduler lines.

SGLang's `#running-req` is one micro-batch: consecutive lines of a rank cycle through the
non-empty micro-batch slots, so the engine's total is the sum over one cycle. The cycle length is
the shortest period of the line sizes over a trailing window. Where that cannot tell (every size
equal: one micro-batch of 8 or eight of them read alike), two facts decide:
- requests waiting: a slot with room admits at its turn, so at steady state every slot is full
  and the engine runs min(max_running_requests, K x slots);
- otherwise the rank's compute share: with m <= pp_size micro-batches in flight each stage
  computes about m / pp_size of the time (the pipeline recurrence), so m = busy x pp_size.
Without either, the shortest period is kept (a lower bound) and the line counted as unsure.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class EngineTotals:
    """Per line: the engine's running total, the micro-batches it was summed over, and how."""

    running: np.ndarray
    microbatches: np.ndarray
    source: np.ndarray  # "period" | "queue" | "busy" | "lower bound"

    def counts(self) -> dict[str, int]:
        kinds, n = np.unique(self.source, return_counts=True)
        return {str(k): int(c) for k, c in zip(kinds, n, strict=True)}


def line_sizes(kind: np.ndarray, running_req: np.ndarray, new_seq: np.ndarray) -> np.ndarray:
    """Each line's micro-batch after its step: a decode line's #running-req; a prefill line's
    #running-req (the slot's requests that waited) plus the #new-seq it admitted."""
    sizes = np.nan_to_num(running_req.astype(np.float64))
    prefill = kind == "prefill"
    sizes[prefill] += np.nan_to_num(new_seq.astype(np.float64))[prefill]
    return sizes


def shortest_periods(sizes: np.ndarray, max_period: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Per line: the shortest period m in 1..max_period with the least mismatch |x_j - x_{j-m}|
    summed over the trailing ``window`` lines, and whether every period matched equally (all
    sizes alike, nothing to tell them apart)."""
    n = len(sizes)
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    costs = np.full((max_period, n), np.inf)
    for m in range(1, max_period + 1):
        diff = np.zeros(n)
        if m < n:
            diff[m:] = np.abs(sizes[m:] - sizes[:-m])
        cum = np.concatenate(([0.0], np.cumsum(diff)))
        lo = np.maximum(np.arange(n) - window + 1, m)  # lines with a partner m back
        hi = np.arange(n) + 1
        seen = hi - lo
        mismatch = (cum[hi] - cum[np.minimum(lo, hi)]) / np.maximum(seen, 1)
        costs[m - 1] = np.where(seen > 0, mismatch, np.inf)
    best = np.argmin(costs, axis=0)  # the first (shortest) of equal minima
    tied = np.all(costs == costs[best, np.arange(n)], axis=0) | ~np.isfinite(costs[best, np.arange(n)])
    return best.astype(np.int64) + 1, tied


def trailing_sums(sizes: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Per line i: the sum of sizes[i - m_i + 1 .. i] (fewer at the start)."""
    cum = np.concatenate(([0.0], np.cumsum(sizes)))
    hi = np.arange(len(sizes)) + 1
    return np.asarray(cum[hi] - cum[np.maximum(hi - m, 0)])


def engine_totals(sizes: np.ndarray, queue: np.ndarray, busy: np.ndarray, pp_size: int, slots: int,
                  k: int | None, pool: int | None) -> EngineTotals:
    """The engine's running total at each of one rank's lines (see the module's docstring);
    ``busy`` is the rank's compute share around each line (NaN where unknown)."""
    m, tied = shortest_periods(sizes, slots, window=2 * slots)
    source = np.where(tied, "lower bound", "period").astype(object)
    waiting = np.nan_to_num(queue.astype(np.float64)) > 0.5
    full = k is not None and pool is not None
    by_busy = tied & ~waiting & ~np.isnan(busy)
    m = np.where(by_busy, np.clip(np.rint(np.nan_to_num(busy) * pp_size), 1, slots), m).astype(np.int64)
    source[by_busy] = "busy"
    running = trailing_sums(sizes, m)
    if full:
        assert k is not None and pool is not None
        at_bound = waiting & tied
        running = np.where(at_bound, float(min(pool, k * slots)), running)
        m = np.where(at_bound, min(slots, -(-pool // max(k, 1))), m)
        source[at_bound] = "queue"
    return EngineTotals(running, m, source)
