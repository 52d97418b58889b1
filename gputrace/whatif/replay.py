"""The what-if's replay driver: the fitted model run over the captured phases, each phase stopped
once it knows its throughput, and the replays a report makes counted and shared.

A replayed phase stands for ``phase_s`` of the load level. It ends early once its throughput has
settled: the tokens of the last span and of the span before it agree within SETTLE_TOLERANCE,
each span at least SETTLE_MIN_S and at least the decode life of the requests the phase finished
(a closed loop's schedule repeats with that period: a span shorter than it can miss the dip of a
cohort's prefills). The rest of the phase is then taken at the rate of those two spans, so the
phase's figure is what the whole phase would give if it kept that rate: the figure a full replay
states, within the tolerance, for a fraction of the steps. A phase that never settles runs its
whole ``phase_s``, as before; so does every phase of a load that draws its requests' lengths
(their spread moves a span's tokens by more than the tolerance allows to judge: kv-bound seed 2
was advised the chunk beside the KV size, which the full replay puts inside the band). A load of
fixed lengths runs a schedule that repeats with the requests' lives, which the spans follow.

The simulator itself is untouched: this drives its engine and client phase by phase
(gputrace.sim.simulate's closed loop) and reads its trace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gputrace.sim.client import ClosedLoopClient, Phase
from gputrace.sim.engine import PipelineEngine
from gputrace.sim.params import SimParams, parse_start_ns
from gputrace.sim.simulate import SimResult, simulate

# A phase's throughput has settled when its last two spans' tokens agree within this: a third of
# the narrowest band a prediction states (fit.UNCERTAINTY_FLOOR, 3 %)
SETTLE_TOLERANCE = 0.01
SETTLE_MIN_S = 5.0  # a span is at least this long ...
SETTLE_LIVES = 1.0  # ... and this many decode lives of the phase's finished requests
WINDOW_S = 1.0  # how often the driver looks


@dataclass(frozen=True, slots=True)
class ReplayedPhase:
    """One phase as the driver ran it: its span in the replay, the length it stands for, and
    the rate (tokens/s) taken for the rest where it stopped early (None: it ran whole)."""

    label: str
    concurrency: int
    start_s: float
    stop_s: float
    phase_s: float
    rest_tok_s: float | None

    @property
    def rest_s(self) -> float:
        """Seconds of the phase not replayed (taken at ``rest_tok_s``)."""
        return max(self.phase_s - (self.stop_s - self.start_s), 0.0) if self.rest_tok_s is not None else 0.0


@dataclass
class ReplayStats:
    """What the what-if replayed for one analysis: replays run, engine steps they took, replays
    found in the cache (the findings' effects and the advice's search share it)."""

    replays: int = 0
    steps: int = 0
    cached: int = 0
    phases_stopped: int = 0
    phases: int = 0
    # (parameters, seed, labels) -> the replay's outcomes (whatif.fit.replay_outcomes') and Reached
    cache: dict[tuple[SimParams, int, Any], tuple[Any, Reached]] = field(default_factory=dict, repr=False)

    def find(self, p: SimParams, seed: int, labels: Any) -> Any | None:
        """The outcomes of a replay of ``p`` at ``seed``: its own, or that of a replay whose
        settings differ only where neither bound (same_replay); None: not replayed yet."""
        hit = self.cache.get((p, seed, labels))
        if hit is None:
            hit = next((v for (q, s, lab), v in self.cache.items()
                        if s == seed and lab == labels and same_replay(q, v[1], p)), None)
        if hit is not None:
            self.cached += 1
        return None if hit is None else hit[0]

    def text(self) -> str:
        return (f"{self.replays} replays ({self.cached} shared), {self.steps:,} engine steps; "
                f"{self.phases_stopped} of {self.phases} replayed phases stopped once settled")


@dataclass
class Replay:
    """A replay's engine trace and requests (a SimResult without log or ground truth), and how
    each phase was run."""

    result: SimResult
    phases: tuple[ReplayedPhase, ...]


class _TokenWindows:
    """Tokens out of the last stage per WINDOW_S window of a phase, from the trace's columns as
    they grow (each entry read once: its output time may lie ahead of the loop's clock)."""

    def __init__(self, tok_t: Sequence[float], tok_n: Sequence[int], start_s: float):
        self.tok_t, self.tok_n, self.start_s = tok_t, tok_n, start_s
        self.read = len(tok_t)
        self.counts = np.zeros(0)

    def update(self) -> None:
        t = np.asarray(self.tok_t[self.read:], dtype=np.float64)
        n = np.asarray(self.tok_n[self.read:], dtype=np.float64)
        self.read += len(t)
        keep = t >= self.start_s
        bins = ((t[keep] - self.start_s) // WINDOW_S).astype(np.int64)
        if len(bins):
            add = np.bincount(bins, weights=n[keep])
            if len(add) > len(self.counts):
                self.counts = np.concatenate((self.counts, np.zeros(len(add) - len(self.counts))))
            self.counts[:len(add)] += add

    def between(self, a: int, b: int) -> float:
        """Tokens of windows [a, b)."""
        return float(self.counts[a:b].sum())


def _decode_life_s(client: ClosedLoopClient, first: int) -> float:
    """The median decode life (first token to finish) of the requests the phase sent that are done."""
    lives = [r.finish_s - r.first_token_s for r in client.requests[first:]
             if r.finish_s is not None and r.first_token_s is not None]
    return float(np.median(lives)) if lives else float("inf")


def _run_phase(engine: PipelineEngine, client: ClosedLoopClient, label: str, c: int, start: float,
               phase_s: float, settle: bool) -> ReplayedPhase:
    """One closed-loop phase from ``start``: stopped once settled where ``settle`` (see the
    module's docstring)."""
    end = start + phase_s
    first = len(client.requests)
    engine.run_until(start)
    client.start_phase(Phase(label, c, start, end))
    windows = _TokenWindows(engine.trace.tok_t, engine.trace.tok_n, start)
    done = 0  # whole windows behind the loop's clock: their tokens are all counted
    while done * WINDOW_S < phase_s:
        done += 1
        t = min(start + done * WINDOW_S, end)
        engine.run_until(t)
        if t >= end or not settle:
            continue
        life = _decode_life_s(client, first)
        if not np.isfinite(life):
            continue
        span = int(np.ceil(max(SETTLE_MIN_S, SETTLE_LIVES * life) / WINDOW_S))
        if done < 2 * span:
            continue
        windows.update()
        older, newer = windows.between(done - 2 * span, done - span), windows.between(done - span, done)
        if newer > 0 and abs(newer - older) <= SETTLE_TOLERANCE * newer:
            return ReplayedPhase(label, c, start, t, phase_s, (older + newer) / (2 * span * WINDOW_S))
    return ReplayedPhase(label, c, start, end, phase_s, None)


def run_replay(p: SimParams, seed: int = 0) -> Replay:
    """The fitted model run over ``p``'s phases at ``seed``: the engine's trace and the requests
    only (no log text, no ground truth). A burst load (each level's requests at once, ended by
    the last) runs as the simulator runs it, whole."""
    p = dataclasses.replace(p, seed=seed)
    if p.client_mode != "closed":
        result = simulate(p, "whatif", log=False)
        return Replay(result, tuple(ReplayedPhase(ph.label, ph.target_concurrency, ph.start_s, ph.end_s,
                                                  ph.end_s - ph.start_s, None) for ph in result.phases))
    engine = PipelineEngine(p)
    client = ClosedLoopClient(p, engine, np.random.default_rng(p.seed))
    ran: list[ReplayedPhase] = []
    t = 0.0
    for c in p.concurrency:
        ph = _run_phase(engine, client, f"C={c}", c, t, p.phase_s, not p.draws_lengths)
        ran.append(ph)
        t = ph.stop_s
    client.stop()
    if p.drain_s <= 0:
        # no drain (a screening replay that states no latency): what finished by the last phase's
        # end is taken in, so its phases' throughput, bubbles and batches are a drained replay's
        engine.process_due(t)
    # as the simulator: requests in flight finish (their latencies), for drain_s at most
    deadline = t + p.drain_s
    while engine.busy() and engine.now < deadline:
        engine.run_until(min(engine.now + 1.0, deadline))
    end_s = max(t, min(engine.now, deadline))
    phases = [Phase(ph.label, ph.concurrency, ph.start_s, ph.stop_s) for ph in ran]
    result = SimResult("whatif", p, parse_start_ns(p.start), end_s, phases, client.requests, engine)
    return Replay(result, tuple(ran))


# Settings a replay may show it never reached: a change of them alone replays the same run
UNBOUND_KNOBS = frozenset({"max_running_requests", "chunked_prefill_size", "max_prefill_tokens"})


@dataclass(frozen=True, slots=True)
class Reached:
    """What a replay's admission reached: the most requests running at once, the most prompt
    tokens a step prefilled."""

    running_max: int
    prefill_step_tokens_max: int

    @classmethod
    def of(cls, replay: Replay) -> Reached:
        tr = replay.result.engine.trace
        return cls(max(tr.st_running, default=0), max(tr.pf_n, default=0))


def same_replay(ran: SimParams, reached: Reached, other: SimParams) -> bool:
    """Whether ``other`` replays exactly as ``ran`` did, having reached ``reached``: they differ
    only in the request pool and the prefill budget, and neither bound in ``ran``'s replay nor
    would in ``other``'s (SGLang: a slot admits min(K - its running, pool - running), so a pool
    at least K above the most running never binds; the budget is only spent by prefills, so a
    budget above the largest step's prompt tokens never cut one). vLLM admits to the pool
    directly: only its budget is compared."""
    a = {f.name: getattr(ran, f.name) for f in dataclasses.fields(ran)}
    b = {f.name: getattr(other, f.name) for f in dataclasses.fields(other)}
    differ = {k for k in a if a[k] != b[k]}
    if not differ or not differ <= UNBOUND_KNOBS or ran.micro_batch_cap != other.micro_batch_cap:
        return False
    pool = min(ran.max_running_requests, other.max_running_requests)
    if "max_running_requests" in differ and (
            not ran.engine_spec.microbatch_slots or pool < reached.running_max + ran.micro_batch_cap):
        return False
    budget = min(ran.chunked_prefill_size, ran.max_prefill_tokens, other.chunked_prefill_size,
                 other.max_prefill_tokens)
    return reached.prefill_step_tokens_max < budget


_SESSION: ContextVar[ReplayStats | None] = ContextVar("gputrace_whatif_replays", default=None)


@contextmanager
def replay_session() -> Iterator[ReplayStats]:
    """Replays inside share one cache and one count (an analysis: its fit, its findings' effects
    and its advice's search); inside a session already open, that one."""
    current = _SESSION.get()
    if current is not None:
        yield current
        return
    stats = ReplayStats()
    token = _SESSION.set(stats)
    try:
        yield stats
    finally:
        _SESSION.reset(token)


def current_session() -> ReplayStats | None:
    return _SESSION.get()


def counted(replay: Replay) -> Replay:
    """``replay``, counted in the open session (if any)."""
    stats = _SESSION.get()
    if stats is not None:
        stats.replays += 1
        stats.steps += len(replay.result.engine.trace.step_reqs)
        stats.phases += len(replay.phases)
        stats.phases_stopped += sum(ph.rest_tok_s is not None for ph in replay.phases)
    return replay
