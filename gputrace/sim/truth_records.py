"""The ground truth of a virtual run and the fixes of its causes, as records (sim.truth makes
them; meta.extra["ground_truth"] holds them as JSON, so they stay dicts: TypedDicts).
"""

from __future__ import annotations

from typing import TypedDict

from gputrace.sim.params import ParamValue


class StageTruth(TypedDict):
    """One stage in one phase: its true busy and bubble shares and the micro-batch sizes it ran."""

    pp_rank: int
    busy_fraction: float
    bubble_fraction: float
    mean_microbatch_size: float | None  # None: no decode step in the phase
    max_microbatch_size: int | None
    p10_microbatch_size: float | None


class PhaseTruth(TypedDict):
    """One phase of a virtual run as the engine model truly ran it (meta.json's form)."""

    label: str
    start_ns: int
    end_ns: int
    target_concurrency: int
    throughput_tok_s: float
    stages: list[StageTruth]
    microbatches_in_flight: float | None  # time means; None where the engine issued nothing
    running_mean: float | None
    running_max: int
    queue_mean: float | None
    token_usage_max: float
    client_inflight_mean: float
    kv_admission_stalls: int
    pcie_hop_share: float
    # of stage 0's busy time, in prefill steps longer than a decode cycle (the other micro-batches'
    # decodes wait for them): a prefill stall where the bubble has no other cause
    long_prefill_share: float
    causes: list[str]


class GroundTruth(TypedDict):
    """meta.extra["ground_truth"] of a virtual run."""

    scenario: str
    seed: int
    causes: list[str]  # what the scenario preset is built to show
    micro_batch_cap: int
    slots: int
    phases: list[PhaseTruth]


class Fix(TypedDict):
    """The change that removes a cause: the engine setting (its flag, or "client"/"link") and
    value, and the simulator parameters that make it."""

    knob: str
    value: int | None
    params: dict[str, ParamValue]


class FixOutcome(TypedDict):
    """One phase a fix was run for: its throughput before and after, and the causes left."""

    throughput_tok_s: float
    fixed_throughput_tok_s: float
    causes_after: list[str]


class FixResult(TypedDict):
    """A fix run in the simulator with the run's seed (scenario_fixes)."""

    causes: list[str]
    knob: str
    value: int | None
    params: dict[str, ParamValue]
    phases: dict[str, FixOutcome]
