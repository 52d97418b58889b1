"""One virtual-time run: parameters through the engine model and its client, as a SimResult with
the log lines and the busy intervals. Its ground truth is sim.truth's; sim.virtual puts the two together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gputrace.engines.simulated import SimulatedRun, StepFields, StepRecord
from gputrace.errors import UsageError
from gputrace.sim.client import ClosedLoopClient, Phase, plan_phases
from gputrace.sim.engine import PipelineEngine, SimRequest
from gputrace.sim.params import SimParams, parse_start_ns
from gputrace.sim.truth_records import GroundTruth

STARTUP_LEAD_S = 5.0  # the configuration lines come this long before the first phase


@dataclass
class SimResult:
    """Everything one virtual run produced. Times in ``*_ns`` are epoch ns; ``t_s`` run seconds."""

    scenario: str
    params: SimParams
    start_ns: int
    end_s: float
    phases: list[Phase]
    requests: list[SimRequest]
    engine: PipelineEngine
    log_lines: list[str] = field(default_factory=list)
    log_ts_ns: list[int] = field(default_factory=list)  # exact emission time of each line
    _ground_truth: GroundTruth | None = field(default=None, repr=False)
    _intervals: dict[str, np.ndarray] | None = field(default=None, repr=False)

    @property
    def ground_truth(self) -> GroundTruth:
        """sim.truth's ground truth of the run, filled in by sim.virtual (a what-if replay has none)."""
        if self._ground_truth is None:
            raise ValueError(f"the {self.scenario} run was simulated without its ground truth")
        return self._ground_truth

    @ground_truth.setter
    def ground_truth(self, truth: GroundTruth) -> None:
        self._ground_truth = truth

    def ns(self, t_s: float) -> int:
        return self.start_ns + round(t_s * 1e9)

    @property
    def intervals(self) -> dict[str, np.ndarray]:
        """The kernel-busy intervals as arrays (stage, start_s, end_s, reqs, decode, tx, rx)."""
        if self._intervals is None:
            self._intervals = self._interval_arrays()
        return self._intervals

    def _interval_arrays(self) -> dict[str, np.ndarray]:
        return self.engine.trace.interval_columns()


def simulate(params: SimParams, scenario: str = "custom", log: bool = True) -> SimResult:
    """Run ``params`` in virtual time, without the ground truth; deterministic for a given
    ``params.seed``. ``log=False``: no scheduler log lines (a what-if replay reads only the trace
    and the requests; the same run otherwise)."""
    rng = np.random.default_rng(params.seed)
    records: list[StepRecord] = []

    def on_log(t_s: float, stage: int, kind: str, fields: StepFields) -> None:
        records.append(StepRecord(t_s, len(records), stage, kind, fields))

    engine = PipelineEngine(params, on_log=on_log if log else None)
    client = ClosedLoopClient(params, engine, rng)
    if params.client_mode == "burst":
        phases = _run_bursts(params, engine, client)
    else:
        phases = plan_phases(params)
        for phase in phases:
            engine.run_until(phase.start_s)
            client.start_phase(phase)
        engine.run_until(phases[-1].end_s)
    client.stop()
    end_s = phases[-1].end_s
    deadline = end_s + params.drain_s
    while engine.busy() and engine.now < deadline:
        engine.run_until(min(engine.now + 1.0, deadline))
    end_s = max(end_s, min(engine.now, deadline))
    start_ns = parse_start_ns(params.start)
    result = SimResult(scenario, params, start_ns, end_s, phases, client.requests, engine)
    if log:
        _format_log(result, records)
    return result


BURST_STEP_S = 0.02  # how finely a burst level's end is found


def _run_bursts(params: SimParams, engine: PipelineEngine, client: ClosedLoopClient) -> list[Phase]:
    """Each level's C requests at once; the level ends when its last request is back at the
    client (or after phase_s), and the next level starts then."""
    phases = []
    t = 0.0
    for c in params.concurrency:
        label = f"C={c}"
        first = len(client.requests)
        client.start_burst(label, c, t)
        deadline = t + params.phase_s
        while client.inflight and engine.now < deadline:
            engine.run_until(min(engine.now + BURST_STEP_S, deadline))
        done = [r.finish_s for r in client.requests[first:] if r.finish_s is not None]
        end = min(max(done, default=deadline) + params.client_latency_s, deadline)
        phases.append(Phase(label, c, t, max(end, t + BURST_STEP_S)))
        # The next burst goes out no earlier than the engine's clock, which the loop above left
        # up to BURST_STEP_S past the level's end (idle, every request done): sent before it,
        # a burst whose requests go out over a few ms (burst_offsets_s) would land all at once
        # in the engine's past and fill its first prefill turn, where the live engine's first
        # turn takes the first request alone (the demo's C=32: turns of 1, 7, 8, 8, 8)
        t = max(phases[-1].end_s, engine.now)
    return phases


def _format_log(result: SimResult, records: list[StepRecord]) -> None:
    """The run's scheduler log, as the simulated engine writes it (its own format)."""
    simulated = result.params.engine_spec.simulated
    if simulated is None:
        raise UsageError(f"the simulator does not write {result.params.engine_spec.name}'s log")
    run = SimulatedRun(result.params, result.start_ns, result.end_s, STARTUP_LEAD_S, records,
                       result.engine.trace)
    for ts_ns, line in simulated.write_log(run):
        result.log_lines.append(line)
        result.log_ts_ns.append(ts_ns)
