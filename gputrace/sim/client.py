"""The simulated closed-loop client: per phase it keeps C requests in flight (or fewer, when it
cannot keep up: a cap on its own in-flight requests, or think time between requests).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gputrace.sim.engine import PipelineEngine, SimRequest
from gputrace.sim.params import SimParams


@dataclass(frozen=True, slots=True)
class Phase:
    """One load level: label, target concurrency and its span in run seconds."""

    label: str
    target_concurrency: int
    start_s: float
    end_s: float


def plan_phases(p: SimParams) -> list[Phase]:
    return [Phase(f"C={c}", c, i * p.phase_s, (i + 1) * p.phase_s) for i, c in enumerate(p.concurrency)]


class ClosedLoopClient:
    """Issues requests into ``engine``; every request it made stays in :attr:`requests`."""

    def __init__(self, p: SimParams, engine: PipelineEngine, rng: np.random.Generator):
        self.p = p
        self.engine = engine
        self.rng = rng
        self.requests: list[SimRequest] = []
        self.inflight = 0
        self.target = 0
        self.label: str | None = None
        self.issuing = False
        engine.on_complete = self._completed

    def start_phase(self, phase: Phase) -> None:
        """Raise (or lower) the level; new requests go out at the phase's start."""
        self.label = phase.label
        self.issuing = True
        cap = self.p.client_max_inflight
        self.target = min(phase.target_concurrency, cap) if cap else phase.target_concurrency
        while self.inflight < self.target:
            self._send(phase.start_s)

    def start_burst(self, label: str, concurrency: int, t_s: float) -> None:
        """A burst level: ``concurrency`` requests at once, none sent when they finish."""
        self.label = label
        self.issuing = False
        for _ in range(concurrency):
            self._send(t_s + self.p.burst_offset_s(len(self.requests)))

    def stop(self) -> None:
        """The end of the last phase: requests in flight finish, no new ones go out."""
        self.issuing = False

    def _send(self, t_s: float) -> None:
        p = self.p
        recorded_in, recorded_out = p.lengths_of(len(self.requests)) or (0, 0)
        n_in, n_out = recorded_in or p.input_tokens, recorded_out or p.max_tokens
        # drawn only where set: a load without long prompts keeps its seeds' draws
        if p.long_prompt_share and not recorded_in and self.rng.uniform() < p.long_prompt_share:
            n_in = p.long_input_tokens
        if p.input_tokens_jitter and not recorded_in:
            n_in = max(1, round(n_in * (1 + self.rng.uniform(-p.input_tokens_jitter, p.input_tokens_jitter))))
        if p.output_tokens_jitter and not recorded_out:
            n_out = max(1, round(n_out * self.rng.uniform(1 - p.output_tokens_jitter, 1.0)))
        req = SimRequest(rid=len(self.requests), arrival_s=t_s + p.client_latency_s, input_tokens=n_in,
                         output_tokens=n_out, phase=self.label, client_start_s=t_s)
        self.requests.append(req)
        self.inflight += 1
        self.engine.add_arrival(req)

    def _completed(self, req: SimRequest, t_s: float) -> None:
        self.inflight -= 1
        if self.issuing and self.inflight < self.target:
            self._send(t_s + self.p.client_latency_s + self.p.think_s)
