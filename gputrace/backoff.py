"""Exponential back-off with jitter, for anything that retries: a reconnecting log follower, a
store write waiting for disk space."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential back-off with jitter between attempts."""

    initial_s: float = 0.2
    max_s: float = 30.0
    factor: float = 2.0
    jitter: float = 0.5  # each delay is drawn from [1 - jitter, 1] times the nominal one
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)  # seed it to replay

    def delay_s(self, attempt: int) -> float:
        nominal = min(self.max_s, self.initial_s * self.factor ** min(attempt, 64))
        return nominal * self.rng.uniform(1.0 - self.jitter, 1.0)
