"""Virtual-time runs with their ground truth: the simulation (sim.simulate) and what it truly
held (sim.truth); ``run_scenario`` is the entry point.
"""

from __future__ import annotations

from gputrace.sim.params import Overrides, SimParams, scenario_params
from gputrace.sim.simulate import SimResult, simulate
from gputrace.sim.truth import scenario_ground_truth

__all__ = ["SimResult", "run_params", "run_scenario"]


def run_params(params: SimParams, scenario: str = "custom", log: bool = True) -> SimResult:
    """Run ``params`` in virtual time, with the ground truth; deterministic for a given ``params.seed``.
    ``log=False``: without the scheduler log's text (the same run and truth, in under half the time
    of formatting every line), for a run only its truth is read from."""
    result = simulate(params, scenario, log=log)
    result.ground_truth = scenario_ground_truth(result)
    return result


def run_scenario(name: str, seed: int = 0, overrides: Overrides | None = None,
                 log: bool = True) -> SimResult:
    """Run a preset (``SCENARIOS``) with parameter overrides in virtual time (``log``: as run_params)."""
    params = scenario_params(name, {**(overrides or {}), "seed": seed})
    return run_params(params, name, log)
