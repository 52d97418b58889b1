"""The agent's sampling loop and its ring buffer of sequenced samples.

Sampling runs in its own thread so a slow NVML call never stalls an HTTP response and a slow client
never delays a sample; the ring is shared under one lock.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from gputrace.gpu.sampler import ROW_INDEX, Sampler, SampleRow
from gputrace.logsetup import get_logger
from gputrace.model import GpuSample

log = get_logger("agent.sampling")


class CursorTooOld(Exception):
    """The requested cursor fell out of the ring; ``oldest_seq`` is the first sample still held."""

    def __init__(self, oldest_seq: int) -> None:
        super().__init__(f"cursor older than the ring; oldest available seq is {oldest_seq}")
        self.oldest_seq = oldest_seq


_GPU, _TS, _UTIL, _MEMORY_UTIL, _LOST = (ROW_INDEX[name] for name in (
    "gpu_index", "ts_ns", "utilization_ratio", "memory_utilization_ratio", "lost"))


# the loop files the ring's pending batches itself once this many wait (bounds the memory they hold
# when nobody reads; readers file them anyway)
_FILE_AFTER_TICKS = 64
_COMPACT_AFTER_BATCHES = 1024  # expired batches dropped off the list's front together, not one by one
# A utilization sample covers the time since the GPU's previous one (NVML's period, or the agent's
# interval where the driver keeps no samples); a longer gap (the agent paused, the GPU lost and
# back) is counted at most this long in the busy-seconds counter, not as if the last reading held.
MAX_BUSY_PERIOD_NS = 2_000_000_000


def _first_seq_of(batch: tuple[int, list[SampleRow], int]) -> int:
    return batch[0]


class SampleRing:
    """Samples numbered 1, 2, 3, ... kept for ``retention_ns`` (and at most ``max_samples``).

    Sequence numbers are implicit (each batch's first seq plus the position) and expiry is
    tracked per batch, so adding a batch costs no per-sample Python work. Samples are held as rows
    (see SampleRow); readers get GpuSample records or the rows themselves.

    It also keeps, per GPU, the newest tick record (ts_ns == the batch's added_ns), the newest
    records carrying utilization and memory utilization, and the seconds the GPU was busy since the
    agent started (each utilization sample times the period it covers), for /metrics: a scraper
    that reads the utilization every 15 s sees one NVML period (1/6-1/5 s) of the 15; the busy
    counter's increase over the same 15 s is all of them.

    A batch is handed over by appending ``(rows, added_ns)`` to ``pending`` (one atomic C call: no
    lock, no Python frame on the sampling thread, which is cold at every tick) and filed in order,
    under the lock, by the next reader or by ``file_pending``; every reader sees every batch.
    """

    def __init__(self, retention_ns: int, max_samples: int = 1_000_000) -> None:
        self.retention_ns = retention_ns
        self.max_samples = max_samples
        self.pending: deque[tuple[list[SampleRow], int]] = deque()
        # (seq of its first row, rows, added_ns), oldest first from self._head on: a list, so a
        # seq is found by bisection (a deque or a flat row list is walked from its start: 18 ms
        # under the lock at the 1M cap); expired batches are cut off the front in bulk
        self._batches: list[tuple[int, list[SampleRow], int]] = []
        self._head = 0
        self._held = 0  # rows in the live batches
        self._first_seq = 1  # seq of the oldest row held (of the next one when none is)
        self._latest: dict[int, SampleRow] = {}
        self._latest_util: dict[int, SampleRow] = {}
        self._latest_memory_util: dict[int, SampleRow] = {}
        self._busy_s: dict[int, float] = {}
        self._util_ts: dict[int, int] = {}  # per GPU: the ts of the utilization sample counted last
        self._lock = threading.Lock()

    def extend(self, samples: list[SampleRow], added_ns: int) -> None:
        """Hand a batch over; the ring keeps the list itself, so it must not change afterwards."""
        self.pending.append((samples, added_ns))

    def file_pending(self) -> None:
        """File the batches handed over (readers do it first; the loop when many are waiting)."""
        with self._lock:
            self._file()

    def _file(self) -> None:
        pending, batches = self.pending, self._batches
        latest, latest_util, latest_memory_util = self._latest, self._latest_util, self._latest_memory_util
        while pending:
            samples, added_ns = pending.popleft()
            if not samples:
                continue
            for row in samples:
                gpu, lost = row[_GPU], row[_LOST]
                if row[_UTIL] is not None or lost:
                    latest_util[gpu] = row
                    if not lost:
                        self._count_busy(gpu, row[_TS], row[_UTIL])
                if row[_MEMORY_UTIL] is not None or lost:
                    latest_memory_util[gpu] = row
                if row[_TS] == added_ns:
                    latest[gpu] = row
            batches.append((self._first_seq + self._held, samples, added_ns))
            self._held += len(samples)
            self._expire(added_ns - self.retention_ns)

    def _count_busy(self, gpu: int, ts_ns: int, utilization: float) -> None:
        """Add the busy seconds of one utilization sample: its ratio times the time since the GPU's
        previous one (at most MAX_BUSY_PERIOD_NS; the first one, or one not newer, counts none)."""
        previous = self._util_ts.get(gpu)
        if previous is None:
            self._busy_s.setdefault(gpu, 0.0)
        elif ts_ns <= previous:
            return
        else:
            self._busy_s[gpu] += utilization * min(ts_ns - previous, MAX_BUSY_PERIOD_NS) / 1e9
        self._util_ts[gpu] = ts_ns

    def busy_seconds(self) -> dict[int, float]:
        """Per GPU: the seconds it was busy (by its utilization samples) since the agent started."""
        with self._lock:
            self._file()
            return dict(self._busy_s)

    def _expire(self, horizon_ns: int) -> None:
        batches, head = self._batches, self._head
        while head < len(batches) and (batches[head][2] < horizon_ns or self._held > self.max_samples):
            first_seq, rows, added_ns = batches[head]
            self._held -= len(rows)
            self._first_seq += len(rows)
            batches[head] = (first_seq, [], added_ns)  # its rows freed now, the entry at compaction
            head += 1
        if head > _COMPACT_AFTER_BATCHES and head * 2 > len(batches):
            del batches[:head]
            head = 0
        self._head = head

    @property
    def newest_seq(self) -> int:
        """The sequence number of the newest sample (0 before the first)."""
        with self._lock:
            self._file()
            return self._first_seq + self._held - 1

    def oldest_seq(self) -> int:
        """The seq of the oldest sample held (the next one to come when the ring is empty)."""
        with self._lock:
            self._file()
            return self._first_seq

    def after(self, since: int, limit: int) -> list[tuple[int, GpuSample]]:
        """Up to ``limit`` samples with seq > since; CursorTooOld when some of them were dropped."""
        return [(seq, GpuSample(*row)) for seq, row in enumerate(self.rows_after(since, limit), since + 1)]

    def rows_after(self, since: int, limit: int) -> list[SampleRow]:
        """``after`` as rows: the first has seq since + 1, the next since + 2, ..."""
        with self._lock:
            self._file()
            oldest = self._first_seq
            if since < oldest - 1:
                raise CursorTooOld(oldest)
            return self._rows_from(since + 1, limit)

    def _rows_from(self, seq: int, limit: int) -> list[SampleRow]:
        batches = self._batches
        if seq >= self._first_seq + self._held:
            return []
        i = bisect_right(batches, seq, lo=self._head, key=_first_seq_of) - 1
        offset = seq - batches[i][0]
        page: list[SampleRow] = []
        while len(page) < limit and i < len(batches):
            page += batches[i][1][offset:offset + limit - len(page)]
            offset = 0
            i += 1
        return page

    def latest(self) -> tuple[dict[int, SampleRow], dict[int, SampleRow], dict[int, SampleRow]]:
        """Per GPU: the newest tick record, the newest with utilization, with memory utilization."""
        with self._lock:
            self._file()
            return dict(self._latest), dict(self._latest_util), dict(self._latest_memory_util)

    def __len__(self) -> int:
        with self._lock:
            self._file()
            return self._held


@dataclass(slots=True)
class LoopStats:
    """What the loop has done, for /metrics and /healthz."""

    ticks: int = 0
    samples: int = 0
    errors: int = 0
    last_tick_ns: int | None = None
    last_sample_cost_s: float = 0.0


class SamplingLoop:
    """Calls ``sampler.sample`` every ``interval_s`` on its own thread and fills the ring."""

    def __init__(self, sampler: Sampler, ring: SampleRing, interval_s: float,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.sampler = sampler
        self.ring = ring
        self.interval_s = interval_s
        self.stats = LoopStats()
        self._clock_ns = clock_ns
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="gputrace-sampling", daemon=True)

    def start(self) -> None:
        self.tick()  # one sample before serving, so /metrics is never empty
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def tick(self) -> None:
        started = time.perf_counter()
        now_ns = self._clock_ns()
        try:
            samples = self.sampler.sample_rows(now_ns)
        except Exception as exc:  # a failing backend must not kill the agent: count, log, retry
            self.stats.errors += 1
            if self.stats.errors <= 10:
                log.error("sampling_failed", error=f"{type(exc).__name__}: {exc}", errors=self.stats.errors)
            return
        pending = self.ring.pending
        pending.append((samples, now_ns - self.sampler.lag_ns))  # SampleRing.extend without its frame
        if len(pending) >= _FILE_AFTER_TICKS:
            self.ring.file_pending()
        st = self.stats
        st.ticks += 1
        st.samples += len(samples)
        st.last_tick_ns = now_ns
        st.last_sample_cost_s = time.perf_counter() - started

    def _run(self) -> None:
        # time.sleep, not Event.wait: a timed wait costs about twice the CPU per wake-up, and the
        # agent wakes 10-100 times a second for ever; naps of at most 0.5 s bound stop()'s wait
        next_at = time.monotonic() + self.interval_s
        while True:
            while (left := next_at - time.monotonic()) > 0 and not self._stopping:
                time.sleep(min(left, 0.5))
            if self._stopping:
                return
            self.tick()
            next_at += self.interval_s
            now = time.monotonic()
            if next_at < now:  # fell behind (suspended, overloaded): skip the missed ticks
                next_at = now + self.interval_s
