"""What the simulator writes in an engine's own formats, as each engine package provides it
(``Engine.simulated``): its scheduler log from a virtual run, the log lines the real-time server
writes as the engine runs (None where it is not served in real time) and its /metrics series.
The simulator asks the engine for these; it never names one.

The engines read what they need of the simulator's parameters and its trace through the
protocols below, so gputrace/engines/ imports nothing of gputrace/sim/.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

# One logged step of one rank: its values by the simulator's field names (running_req, ...)
StepFields = dict[str, float | int | bool]


class StepRecord(NamedTuple):
    """One step a rank logs: (seconds into the run, emission order, stage, "decode"/"prefill",
    its values). Sorted, records run in time and then emission order (the values are never
    compared: the order is unique)."""

    t_s: float
    order: int
    stage: int
    kind: str
    fields: StepFields


class SimDeployment(Protocol):
    """The simulator's parameters an engine's writers read (SimParams has them all)."""

    @property
    def model_path(self) -> str: ...
    @property
    def pp_size(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def max_running_requests(self) -> int: ...
    @property
    def pp_max_micro_batch_size(self) -> int | None: ...
    @property
    def pp_async_batch_depth(self) -> int: ...
    @property
    def chunked_prefill_size(self) -> int: ...
    @property
    def max_prefill_tokens(self) -> int: ...
    @property
    def max_total_num_tokens(self) -> int: ...
    @property
    def context_len(self) -> int: ...
    @property
    def decode_log_interval(self) -> int: ...
    @property
    def device_timer(self) -> bool: ...
    @property
    def cuda_graph_max_bs(self) -> int: ...
    @property
    def memory_total_bytes(self) -> int: ...
    @property
    def weights_bytes_per_gpu(self) -> int: ...
    @property
    def seed(self) -> int: ...


class SimTrace(Protocol):
    """The engine-wide series of a virtual run an engine's periodic stats lines are made of."""

    @property
    def tok_t(self) -> Sequence[float]: ...  # tokens out of the last stage: when, how many
    @property
    def tok_n(self) -> Sequence[int]: ...
    @property
    def pf_t(self) -> Sequence[float]: ...  # prompt tokens computed: when, how many
    @property
    def pf_n(self) -> Sequence[int]: ...
    @property
    def st_t(self) -> Sequence[float]: ...  # the engine's state at each issued batch
    @property
    def st_running(self) -> Sequence[int]: ...
    @property
    def st_waiting(self) -> Sequence[int]: ...
    @property
    def st_kv_used(self) -> Sequence[int]: ...


@dataclass(frozen=True, slots=True)
class SimulatedRun:
    """One finished virtual run, as an engine's log writer reads it."""

    params: SimDeployment
    start_ns: int  # epoch ns of run second 0
    end_s: float  # the log ends here
    lead_s: float  # the configuration lines come this long before second 0
    records: Sequence[StepRecord]  # every step a rank logged, in no set order
    trace: SimTrace

    def ns(self, t_s: float) -> int:
        return self.start_ns + round(t_s * 1e9)


class StepLineWriter(Protocol):
    """An engine's log lines as its ranks write them while it runs (the real-time server and
    each of its nodes; the virtual run of an engine that logs each step)."""

    def startup(self, ts_ns: int, ranks: Iterable[tuple[int, int]]) -> list[str]:
        """The configuration lines logged before serving, for these (pp_rank, tp_rank)."""
        ...

    def step(self, ts_ns: int, stage: int, kind: str, fields: StepFields) -> str:
        """The line a stage's TP-0 rank logs for one step."""
        ...


@dataclass(frozen=True, slots=True)
class MetricSnapshot:
    """What an engine's metrics say at one moment, in the simulator's terms."""

    stage_fields: list[dict[str, float]]  # per PP rank: the newest logged value of each gauge field
    tokens_total: float = 0.0  # tokens generated so far (every rank runs every micro-batch)
    forward_s: list[float] = field(default_factory=list)  # per rank: kernel time so far
    running: int = 0  # engine-wide
    waiting: int = 0
    kv_usage_ratio: float = 0.0
    e2e_latency_sum_s: float = 0.0  # the finished requests' end-to-end latencies, summed
    e2e_count: int = 0  # the finished requests


class MetricSample(NamedTuple):
    """One sample a scrape of the engine's /metrics reads. ``kind``: "gauge", "counter" or
    "histogram" (a histogram's ``_sum`` or ``_count``)."""

    name: str
    labels: dict[str, str]
    value: float
    kind: str


@dataclass(frozen=True, slots=True)
class SimulatedEngine:
    """What the simulator writes for one engine, in the engine's own formats."""

    # a virtual run's whole scheduler log: (epoch ns it was written, line), in order
    write_log: Callable[[SimulatedRun], list[tuple[int, str]]]
    # the samples a scrape of its /metrics reads at one moment
    metric_samples: Callable[[SimDeployment, MetricSnapshot], list[MetricSample]]
    # the step fields whose newest value each rank's gauges hold (none: engine-wide series only)
    rank_gauges: frozenset[str] = frozenset()
    # its ranks' lines as it runs; None where the simulator does not serve it in real time
    step_lines: Callable[[SimDeployment], StepLineWriter] | None = None
